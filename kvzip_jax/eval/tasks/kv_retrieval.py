"""Key-value retrieval (SCBench Retr.KV): the context is a JSON object of random UUID pairs; each question asks for
the value of one key."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack
from kvzip_jax.eval.tasks.base import Example

TASK = "kv_retrieval"
NUM_QUESTIONS = 4
SAMPLE_PAIRS = 8  # pairs measured to size the object


def random_uuid(rng: np.random.Generator) -> str:
    """A version-4 UUID string from the rng (uuid4 would not be reproducible)."""
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A JSON object of about context_tokens tokens (at least NUM_QUESTIONS pairs); NUM_QUESTIONS questions about
    keys at spread positions."""
    pairs = {random_uuid(rng): random_uuid(rng) for _ in range(SAMPLE_PAIRS)}
    tokens_per_pair = count_tokens(json.dumps(pairs)) / SAMPLE_PAIRS
    num_pairs = max(NUM_QUESTIONS, round(context_tokens / tokens_per_pair))
    while len(pairs) < num_pairs:
        pairs[random_uuid(rng)] = random_uuid(rng)
    items = list(pairs.items())[:num_pairs]
    asked = [items[int(depth * num_pairs)] for depth in haystack.spread_depths(rng, NUM_QUESTIONS)]
    questions = tuple(
        f'What is the value of the key "{key}" in the JSON object? Answer with the value only.' for key, _ in asked
    )
    return Example(
        TASK, example_id, json.dumps(dict(items)), questions, tuple((value,) for _, value in asked), "inclusion", 40
    )
