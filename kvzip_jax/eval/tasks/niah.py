"""Needle in a haystack: one needle sentence carrying four random facts, at a random depth; a question per fact."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "niah"
PLACES = (
    "hidden archive",
    "old lighthouse",
    "mountain observatory",
    "river museum",
    "night library",
    "glass greenhouse",
)


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A haystack of about context_tokens tokens holding "The <place> was founded by <person> in <city> in <year>,
    and its door code is <code>." once; four questions, one per fact."""
    place = words.pick(rng, PLACES, 1)[0]
    person = f"{words.pick(rng, words.FIRST_NAMES, 1)[0]} {words.pick(rng, words.LAST_NAMES, 1)[0]}"
    city = words.pick(rng, words.CITIES, 1)[0]
    year = str(int(rng.integers(1700, 2000)))
    code = str(words.distinct_numbers(rng, 6, 1)[0])
    needle = f"The {place} was founded by {person} in {city} in {year}, and its door code is {code}."
    sentences = haystack.draw(rng, context_tokens - count_tokens(needle), count_tokens)
    context = haystack.insert_needles(sentences, [needle], [float(rng.random())])
    questions = (
        f"Who founded the {place}? Answer with the name only.",
        f"In which city was the {place} founded? Answer with the city only.",
        f"In which year was the {place} founded? Answer with the year only.",
        f"What is the door code of the {place}? Answer with the code only.",
    )
    return Example(TASK, example_id, context, questions, ((person,), (city,), (year,), (code,)), "inclusion", 32)
