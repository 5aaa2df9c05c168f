"""Per-layer budgets, as the KVzip paper ran its baselines (App. A): each layer keeps a given number of context
pairs, shared by its KV heads, with a per-head floor as Ada-KV allocates them.

Within a layer of budget U pairs:
  1. forced pairs, scored +inf (an observation window: SnapKV, PyramidKV and H2O never evict their last w tokens),
     are kept and paid for first (F of them);
  2. every head keeps its own best floor(FLOOR_SHARE x (U - F) / K) other pairs, so no head is starved;
  3. the rest of U goes to the best remaining pairs of the whole layer, whichever head holds them.
Counts are exact integers (kvzip.budget), ties go to the lower index (earlier head, then earlier position). When a
budget cannot even pay for the forced pairs (ratio x context shorter than the window), they are all kept anyway:
the published methods never evict their window.

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.kvzip.budget import kept_count, top_counts

# Ada-KV's safeguard: each head is guaranteed this share of its even split of the layer's budget (floor_alpha=0.2
# in FFY0/AdaKV pred.py; alpha_safeguard=0.20 in kvpress AdaKVPress).
FLOOR_SHARE = 0.2


def uniform_layer_counts(ratio, context_len: jax.Array, num_layers: int, num_kv_heads: int) -> jax.Array:
    """counts [L, B] int32: floor(ratio x K x context_len) in every layer (keep_mask's level "layer")."""
    per_layer = kept_count(ratio, num_kv_heads * context_len.astype(jnp.int32))  # [B]
    return jnp.broadcast_to(per_layer[None, :], (num_layers,) + per_layer.shape)


def keep_by_layer(
    scores: jax.Array, context_len: jax.Array, counts: jax.Array, floor_share: float = FLOOR_SHARE
) -> jax.Array:
    """keep [L, B, K, n] bool: counts [L, B] pairs of every layer for scores [L, B, K, n] (module docstring: +inf
    pairs first, then a per-head floor of floor_share of the rest's even split, then the layer's best). Columns past
    context_len [B] are never kept; a count above what a layer holds keeps it all."""
    L, B, K, n = scores.shape
    in_context = (jnp.arange(n) < context_len[:, None])[None, :, None, :]  # [1, B, 1, n]
    scores = scores.astype(jnp.float32)
    forced = in_context & jnp.isposinf(scores)  # [L, B, K, n]
    candidate = in_context & ~forced
    rest = jnp.maximum(counts.astype(jnp.int32) - forced.sum((2, 3), dtype=jnp.int32), 0)  # [L, B]
    floor = kept_count(floor_share, rest) // K  # [L, B] floor(share x rest / K) per head
    by_head = top_counts(jnp.where(candidate, scores, -jnp.inf), jnp.broadcast_to(floor[..., None], (L, B, K)))
    by_head &= candidate
    remaining = rest - by_head.sum((2, 3), dtype=jnp.int32)  # [L, B]
    open_ = candidate & ~by_head
    by_layer = top_counts(jnp.where(open_, scores, -jnp.inf).reshape(L, B, K * n), remaining).reshape(L, B, K, n)
    return forced | by_head | (by_layer & open_)
