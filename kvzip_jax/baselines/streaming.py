"""StreamingLLM: keep the attention sinks (the first 4 context tokens) and the most recent tokens.

Scores depend on position only (sinks +inf, then later columns higher), the same in every head, so the method is
evicted with the same count in every (layer, KV head) (eviction level "pair-uniform").

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SINKS = 4  # attention sinks: StreamingLLM (Xiao et al. 2023, arXiv 2309.17453) keeps the first 4 tokens


def streaming_scores(
    context_len: jax.Array, num_layers: int, num_kv_heads: int, n: int, sinks: int = SINKS
) -> jax.Array:
    """[L, B, K, n]: +inf for the first `sinks` columns, the column index after them, -inf past context_len."""
    columns = jnp.arange(n)
    row = jnp.where(columns < sinks, jnp.inf, columns.astype(jnp.float32))  # [n]
    row = jnp.where(columns < context_len[:, None], row, -jnp.inf)  # [B, n]
    return jnp.broadcast_to(row[None, :, None, :], (num_layers, row.shape[0], num_kv_heads, n))
