"""Prefix-suffix retrieval (SCBench Retr.Prefix-Suffix): the context is a list of random strings, one a line; each
question asks for the string with a given prefix and suffix. For every asked string the list also holds one decoy
with its prefix and one with its suffix, so both ends are needed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "prefix_suffix"
NUM_QUESTIONS = 4
MIN_LENGTH, MAX_LENGTH = 16, 24
AFFIX_LENGTH = 4  # characters of the prefix and of the suffix
SAMPLE_STRINGS = 16  # strings measured to size the list


def random_line(rng: np.random.Generator) -> str:
    """A random string of lower-case letters and digits, MIN_LENGTH..MAX_LENGTH long."""
    return words.random_string(rng, int(rng.integers(MIN_LENGTH, MAX_LENGTH + 1)))


def affixes(text: str) -> tuple[str, str]:
    """(prefix, suffix) of a string."""
    return text[:AFFIX_LENGTH], text[-AFFIX_LENGTH:]


def distinct_targets(rng: np.random.Generator, count: int) -> list[str]:
    """count strings whose prefixes are all different and whose suffixes are all different."""
    while True:
        targets = [random_line(rng) for _ in range(count)]
        prefixes, suffixes = zip(*map(affixes, targets))
        if len(set(prefixes)) == len(set(suffixes)) == count:
            return targets


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """About context_tokens tokens of strings (at least 3 * NUM_QUESTIONS); the asked strings sit at spread
    positions, and any other string with an asked (prefix, suffix) is dropped, so each question has one answer."""
    targets = distinct_targets(rng, NUM_QUESTIONS)
    strings = [random_line(rng) for _ in range(SAMPLE_STRINGS)]
    tokens_per_string = count_tokens("\n".join(strings) + "\n") / SAMPLE_STRINGS
    num_strings = max(3 * NUM_QUESTIONS, round(context_tokens / tokens_per_string))
    strings = (strings + [random_line(rng) for _ in range(num_strings - len(strings))])[:num_strings]
    positions = [int(depth * num_strings) for depth in haystack.spread_depths(rng, NUM_QUESTIONS)]
    decoys = rng.choice(sorted(set(range(num_strings)) - set(positions)), 2 * NUM_QUESTIONS, replace=False)
    for k, (position, target) in enumerate(zip(positions, targets)):
        prefix, suffix = affixes(target)
        strings[position] = target
        strings[decoys[2 * k]] = prefix + random_line(rng)[AFFIX_LENGTH:]
        strings[decoys[2 * k + 1]] = random_line(rng)[:-AFFIX_LENGTH] + suffix
    asked = set(map(affixes, targets))
    kept = [s for i, s in enumerate(strings) if i in positions or affixes(s) not in asked]
    questions = tuple(
        f'Which string in the list starts with "{prefix}" and ends with "{suffix}"? Answer with the string only.'
        for prefix, suffix in map(affixes, targets)
    )
    return Example(
        TASK, example_id, "\n".join(kept), questions, tuple((target,) for target in targets), "inclusion", 32
    )
