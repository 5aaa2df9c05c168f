"""Key selection for Attention Matching: which t of a head's T keys the compacted block keeps (reference §2).

Einsum legend: N reference queries, T block keys, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.matching.fit import logits

AGGREGATIONS = ("rms", "max", "mean")


def attention_key_scores(q: jax.Array, k: jax.Array, scale: float, aggregate: str = "rms",
                         key_valid: jax.Array | None = None) -> jax.Array:
    """[T] float32: each key's attention over the reference queries q [N, H] (row softmax over keys k [T, H]),
    aggregated over queries by root mean square (the paper's choice), max or mean; invalid keys score -inf."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {aggregate!r}")
    weights = jax.nn.softmax(logits(q, k, scale, key_valid), axis=1)  # [N, T]
    if aggregate == "rms":
        score = jnp.sqrt(jnp.mean(weights * weights, axis=0))
    elif aggregate == "max":
        score = weights.max(axis=0)
    else:
        score = weights.mean(axis=0)
    return score if key_valid is None else jnp.where(key_valid, score, -jnp.inf)


def highest_attention_keys(q: jax.Array, k: jax.Array, scale: float, count: int, aggregate: str = "rms",
                           key_valid: jax.Array | None = None) -> jax.Array:
    """[count] int32 indices of the keys with the highest aggregated attention (HAK), in position order; count is
    static and at most T."""
    if not 0 <= count <= k.shape[0]:
        raise ValueError(f"count must be in [0, {k.shape[0]}], got {count}")
    _, chosen = jax.lax.top_k(attention_key_scores(q, k, scale, aggregate, key_valid), count)
    return jnp.sort(chosen).astype(jnp.int32)
