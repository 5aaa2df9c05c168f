"""Short numbers behind random keys: NUM_PAIRS lines "jpiexg: 564" (six random letters, a colon, three digits) at
spread depths in prose; each question asks which number follows one key: exact retrieval of a short number with no
word around it to help."""

from __future__ import annotations

import string
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "key_numbers"
NUM_PAIRS = 8
NUM_QUESTIONS = 4
KEY_LETTERS = 6
DIGITS = 3
QUESTION = "What number follows '{key}:'? Answer with the number only."


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A haystack of about context_tokens tokens with NUM_PAIRS "key: number" lines, one per stratum of depth;
    questions about NUM_QUESTIONS of them, one per stratum of the pairs, in order."""
    keys: list[str] = []
    while len(keys) < NUM_PAIRS:  # distinct keys
        key = words.random_string(rng, KEY_LETTERS, string.ascii_lowercase)
        keys += [key] if key not in keys else []
    numbers = [str(n) for n in words.distinct_numbers(rng, DIGITS, NUM_PAIRS)]
    context = haystack.plant(
        rng, [f"{key}: {number}" for key, number in zip(keys, numbers)], context_tokens, count_tokens
    )
    asked = [int(depth * NUM_PAIRS) for depth in haystack.spread_depths(rng, NUM_QUESTIONS)]
    return Example(
        TASK,
        example_id,
        context,
        tuple(QUESTION.format(key=keys[i]) for i in asked),
        tuple((numbers[i],) for i in asked),
        "inclusion",
        16,
    )
