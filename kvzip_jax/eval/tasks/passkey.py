"""Pass keys: four labelled five-digit keys ("The pass key for the red door is 48213.") at spread depths."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, labelled_numbers, words
from kvzip_jax.eval.tasks.base import Example

TASK = "passkey"
NUM_KEYS = 4
NEEDLE = "The pass key for the {label} door is {number}."
QUESTION = "What is the pass key for the {label} door? Answer with the number only."


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A haystack of about context_tokens tokens with NUM_KEYS pass keys, one per stratum of depth; a question per
    key."""
    colours = words.pick(rng, words.COLOURS, NUM_KEYS)
    return labelled_numbers.example(
        rng, TASK, example_id, context_tokens, count_tokens, colours, 5, NEEDLE, QUESTION, max_new_tokens=16
    )
