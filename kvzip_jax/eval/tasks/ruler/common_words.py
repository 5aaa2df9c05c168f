"""RULER's common words extraction: a numbered list in which 10 words appear 30 times each and the others 3 times
(6 and 1 below 4096 tokens), after one few-shot list of 40 words (10 x 10, 30 x 3; 20 words, 10 x 3, 10 x 1 below
4096 tokens) with its answer; the 10 common words expected."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from kvzip_jax.eval.tasks.ruler import corpus
from kvzip_jax.eval.tasks.ruler.length import draw_fitting, largest_fitting
from kvzip_jax.eval.tasks.ruler.sample import Sample
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import COMMON_WORDS

NUM_COMMON = 10
REPEATS, SHORT_REPEATS = (30, 3), (6, 1)  # (common, uncommon) times each word appears; below 4096 tokens
EXAMPLE, SHORT_EXAMPLE = (40, 10, 3), (20, 3, 1)  # few-shot (words, common repeats, uncommon repeats)
PROBE_WORDS = 4096
WORD_LISTS = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
STEP = 10  # words


@functools.cache
def vocabulary(seed: int) -> tuple[str, ...]:
    """wonderwords' nouns, adjectives and verbs, distinct, sorted, shuffled by random.Random(seed)."""
    words = sorted({word for name in WORD_LISTS for word in corpus.word_list(name)})
    random.Random(seed).shuffle(words)
    return tuple(words)


def numbered(words: list[str]) -> str:
    """The words numbered from 1: "1. a 2. b 3. c"."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def word_list(streams: Streams, num_words: int, common: int, uncommon: int) -> tuple[str, tuple[str, ...]]:
    """(numbered list, common words): num_words vocabulary words drawn without replacement, the first NUM_COMMON
    repeated `common` times, the rest `uncommon` times, shuffled by a fresh Random(seed)."""
    words = vocabulary(streams.seed)
    if num_words > len(words):
        raise ValueError(
            f"{num_words} words exceed wonderwords' {len(words)}: RULER then draws from its english_words.json, "
            "which is not installed (common words extraction stops at about 100K tokens)"
        )
    drawn = streams.py.sample(words, num_words)
    repeated = drawn[:NUM_COMMON] * common + drawn[NUM_COMMON:] * uncommon
    streams.fresh().shuffle(repeated)
    return numbered(repeated), tuple(drawn[:NUM_COMMON])


def draw(streams: Streams, num_words: int, max_seq_length: int) -> Sample:
    """The few-shot prompt with its answer (" 1. w1 ... 10. w10"), a newline, then the prompt over num_words words."""
    short = max_seq_length < 4096
    shot_words, shot_common, shot_uncommon = SHORT_EXAMPLE if short else EXAMPLE
    shot_list, shot_answer = word_list(streams, shot_words, shot_common, shot_uncommon)
    context, answers = word_list(streams, num_words, *(SHORT_REPEATS if short else REPEATS))
    shot = COMMON_WORDS.prompt.format(context=shot_list) + " " + numbered(list(shot_answer))
    return Sample(shot + "\n" + COMMON_WORDS.prompt.format(context=context), answers, num_words)


def samples(streams: Streams, num_samples: int, max_seq_length: int, count: Callable[[str], int]) -> list[Sample]:
    """num_samples samples whose prompt + 120 new tokens fit max_seq_length tokens. A probe draw of 4096 words gives
    the tokens per word; the size is searched in [10, max(2 x int(max_seq_length // that), 20)]."""
    draw_at = lambda n: draw(streams, n, max_seq_length)
    length = lambda sample: count(sample.text) + COMMON_WORDS.max_new_tokens
    per_word = count(draw_at(PROBE_WORDS).text) / PROBE_WORDS
    upper = max(int(max_seq_length // per_word) * 2, STEP * 2)
    size = largest_fitting(lambda n: length(draw_at(n)) <= max_seq_length, STEP, upper)
    size = STEP if size is None else size
    return [draw_fitting(draw_at, length, size, STEP, max_seq_length) for _ in range(num_samples)]
