"""RULER's frequent words extraction: coded words (6 random lower-case letters) repeated by a zeta law of exponent
2 (the rank-k word int(n k^-2 / zeta(2)) times), the top-ranked one replaced by "..." (noise); the three next most
frequent words expected."""

from __future__ import annotations

import functools
import string
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks.ruler.sample import Sample
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import FREQ_WORDS

ALPHA = 2.0
WORD_LENGTH = 6
NOISE_WORD = "..."
TOKENS_PER_VOCABULARY_WORD = 50  # vocabulary size: (max_seq_length - new tokens) // 50
STEPS = 32  # the word-count step: (max_seq_length - new tokens) // 32


@functools.cache
def zeta(alpha: float) -> float:
    """The Riemann zeta function at alpha (scipy's, as RULER computes it; scipy imported on first use)."""
    from scipy.special import zeta as riemann_zeta

    return float(riemann_zeta(alpha))


def coded_vocabulary(streams: Streams, size: int) -> list[str]:
    """`size` distinct coded words (more drawn while any repeats), sorted, shuffled by a fresh Random(seed); the
    first made NOISE_WORD."""
    new_word = lambda: "".join(streams.py.choices(string.ascii_lowercase, k=WORD_LENGTH))
    words = [new_word() for _ in range(size)]
    while len(set(words)) < size:
        words.append(new_word())
    words = sorted(set(words))
    streams.fresh().shuffle(words)
    words[0] = NOISE_WORD
    return words


def coded_text(streams: Streams, vocabulary: list[str], num_words: int) -> Sample:
    """The prompt over about num_words words: the rank-k word (k from 1) int(num_words k^-ALPHA / zeta(ALPHA))
    times, all shuffled by a fresh Random(seed), joined by spaces; answers: ranks 2 to 4."""
    ranks = np.arange(1, len(vocabulary) + 1)
    counts = (num_words * (ranks**-ALPHA) / zeta(ALPHA)).astype(int)
    words = [word for word, times in zip(vocabulary, counts) for _ in range(times)]
    streams.fresh().shuffle(words)
    return Sample(FREQ_WORDS.prompt.format(context=" ".join(words)), tuple(vocabulary[1:4]), num_words)


def samples(streams: Streams, num_samples: int, max_seq_length: int, count: Callable[[str], int]) -> list[Sample]:
    """num_samples samples whose prompt + 50 new tokens fit max_seq_length tokens. With budget = max_seq_length - 50
    and step = budget // 32: a first vocabulary's word count grows by step from budget // 6 until its prompt
    reaches budget tokens, then one step back; each sample draws its own vocabulary and shrinks that count by step
    while its prompt exceeds budget."""
    budget = max_seq_length - FREQ_WORDS.max_new_tokens
    vocabulary_size, step = budget // TOKENS_PER_VOCABULARY_WORD, budget // STEPS
    vocabulary = coded_vocabulary(streams, vocabulary_size)
    num_words = budget // WORD_LENGTH
    while count(coded_text(streams, vocabulary, num_words).text) < budget:
        num_words += step
    num_words -= step
    found = []
    for _ in range(num_samples):
        vocabulary, size = coded_vocabulary(streams, vocabulary_size), num_words
        while count((sample := coded_text(streams, vocabulary, size)).text) > budget:
            if size <= step:
                raise ValueError(f"no sample fits {max_seq_length} tokens, even with {size} words")
            size -= step
        found.append(sample)
    return found
