"""Multiple needles: four "The special magic number for <city> is <7 digits>." sentences at spread depths."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, labelled_numbers, words
from kvzip_jax.eval.tasks.base import Example

TASK = "multi_needle"
NUM_NEEDLES = 4
NEEDLE = "The special magic number for {label} is {number}."
QUESTION = "What is the special magic number for {label}? Answer with the number only."


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A haystack of about context_tokens tokens with NUM_NEEDLES magic numbers of distinct cities, one per stratum
    of depth; a question per city."""
    cities = words.pick(rng, words.CITIES, NUM_NEEDLES)
    return labelled_numbers.example(
        rng, TASK, example_id, context_tokens, count_tokens, cities, 7, NEEDLE, QUESTION, max_new_tokens=32
    )
