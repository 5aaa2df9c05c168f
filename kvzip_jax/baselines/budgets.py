"""Per-layer budgets, as the KVzip paper ran its baselines: each layer keeps a given number of context pairs,
chosen freely across its KV heads (top scores, ties broken by lower index, heads first).

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.kvzip.budget import kept_count, top_counts


def uniform_layer_counts(ratio, context_len: jax.Array, num_layers: int, num_kv_heads: int) -> jax.Array:
    """counts [L, B] int32: floor(ratio x K x context_len) in every layer (keep_mask's level "layer")."""
    per_layer = kept_count(ratio, num_kv_heads * context_len.astype(jnp.int32))  # [B]
    return jnp.broadcast_to(per_layer[None, :], (num_layers,) + per_layer.shape)


def keep_by_layer(scores: jax.Array, context_len: jax.Array, counts: jax.Array) -> jax.Array:
    """keep [L, B, K, n] bool: the counts [L, B] best pairs of every layer across its K heads, for scores
    [L, B, K, n]; columns past context_len [B] are never kept (a count above K x context_len keeps them all)."""
    L, B, K, n = scores.shape
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    scores = jnp.where(in_context[None, :, None, :], scores.astype(jnp.float32), -jnp.inf)
    keep = top_counts(scores.reshape(L, B, K * n), counts).reshape(L, B, K, n)
    return keep & in_context[None, :, None, :]
