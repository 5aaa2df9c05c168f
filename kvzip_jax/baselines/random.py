"""Random eviction: uniform random scores, a floor for every other method.

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def random_scores(key: jax.Array, context_len: jax.Array, num_layers: int, num_kv_heads: int, n: int) -> jax.Array:
    """[L, B, K, n] uniform in [0, 1) from the PRNG key (the same key, the same scores); -inf past context_len."""
    scores = jax.random.uniform(key, (num_layers, context_len.shape[0], num_kv_heads, n))  # [L, B, K, n]
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], scores, -jnp.inf)
