"""Pass keys: four labelled five-digit keys ("The pass key for the red door is 48213.") at spread depths."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "passkey"
NUM_KEYS = 4


def generate(rng: np.random.Generator, example_id: str, context_tokens: int,
             count_tokens: Callable[[str], int] = haystack.approx_tokens) -> Example:
    """A haystack of about context_tokens tokens with NUM_KEYS pass keys, one per stratum of depth; a question per
    key."""
    colours = words.pick(rng, words.COLOURS, NUM_KEYS)
    keys = [str(key) for key in words.distinct_numbers(rng, 5, NUM_KEYS)]
    needles = [f"The pass key for the {colour} door is {key}." for colour, key in zip(colours, keys)]
    context = haystack.plant(rng, needles, context_tokens, count_tokens)
    questions = tuple(f"What is the pass key for the {colour} door? Answer with the number only." for colour in colours)
    return Example(TASK, example_id, context, questions, tuple((key,) for key in keys), "inclusion", 16)
