"""Random eviction: uniform random scores, a floor for every other method.

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def random_scores(key: jax.Array, context_len: jax.Array, num_layers: int, num_kv_heads: int, n: int) -> jax.Array:
    """[L, B, K, n] uniform in [0, 1) from the PRNG key (the same key, the same scores); -inf past context_len.

    key: one PRNG key, or one per row [B]; then a row's scores depend neither on the batch it is in nor on the
    padded width n (column j's scores come from the row's key folded with j).
    """
    B = context_len.shape[0]
    if key.ndim == 1:  # one key per row
        column = lambda k, j: jax.random.uniform(jax.random.fold_in(k, j), (num_layers, num_kv_heads))  # [L, K]
        row = lambda k: jax.vmap(lambda j: column(k, j), out_axes=2)(jnp.arange(n))  # [L, K, n]
        scores = jax.vmap(row, out_axes=1)(key)  # [L, B, K, n]
    else:
        scores = jax.random.uniform(key, (num_layers, B, num_kv_heads, n))  # [L, B, K, n]
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], scores, -jnp.inf)
