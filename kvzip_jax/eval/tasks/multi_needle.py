"""Multiple needles: four "The special magic number for <city> is <7 digits>." sentences at spread depths."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "multi_needle"
NUM_NEEDLES = 4


def generate(rng: np.random.Generator, example_id: str, context_tokens: int,
             count_tokens: Callable[[str], int] = haystack.approx_tokens) -> Example:
    """A haystack of about context_tokens tokens with NUM_NEEDLES magic numbers of distinct cities, one per stratum
    of depth; a question per city."""
    cities = words.pick(rng, words.CITIES, NUM_NEEDLES)
    numbers = [str(number) for number in words.distinct_numbers(rng, 7, NUM_NEEDLES)]
    needles = [f"The special magic number for {city} is {number}." for city, number in zip(cities, numbers)]
    context = haystack.plant(rng, needles, context_tokens, count_tokens)
    questions = tuple(f"What is the special magic number for {city}? Answer with the number only." for city in cities)
    return Example(TASK, example_id, context, questions, tuple((number,) for number in numbers), "inclusion", 32)
