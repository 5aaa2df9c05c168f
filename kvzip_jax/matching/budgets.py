"""How many keys each (layer, KV head) keeps in a compacted cache (reference/attention_matching.md §5).

  uniform   every compacted head keeps floor(ratio x its context length) keys
  global    one top-k over every compacted head's keys of a row by a per-key score (KVzip's, or the aggregated
            attention of the reference queries): heads that matter more keep more, as KVzip's pair level does. The
            paper finds non-uniform budgets the most important part of the method; its budgets come from an offline
            per-model search we do not have, so a per-key score stands in. A head keeps at most `head_cap` x the
            uniform count (at least one key), which fixes the static size of the fit (the paper caps heads at 0.75
            of their keys).
Counts are exact integers (kvzip.budget.kept_count); a ratio applies to the context pairs of the compacted layers.

Einsum legend: L compacted layers, B batch, K KV heads, n context columns.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvzip_jax.kvzip.budget import RATIO_UNITS, kept_count, top_counts

BUDGETS = ("uniform", "global")


def static_count(ratio: float, n: int, budget: str, head_cap: float) -> int:
    """The most keys one head can keep (the static size of its fit) for n context columns."""
    uniform = round(ratio * RATIO_UNITS) * n // RATIO_UNITS  # kept_count's arithmetic, on the host
    if budget == "uniform":
        return uniform
    return min(n, max(math.ceil(head_cap * ratio * n), 1))


def head_counts(ratio: float, context_len: jax.Array, shape: tuple[int, int, int, int], budget: str,
                scores: jax.Array | None = None, cap: int | None = None) -> jax.Array:
    """counts [L, B, K] int32 for context_len [B] and (L, B, K, n) = shape. global: scores [L, B, K, n] (-inf past a
    row's context) and cap, the most keys of one head."""
    L, B, K, n = shape
    if budget == "uniform":
        return jnp.broadcast_to(kept_count(ratio, context_len)[None, :, None], (L, B, K)).astype(jnp.int32)
    if budget != "global":
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    capped = top_counts(scores, jnp.full((L, B, K), cap, jnp.int32))  # [L, B, K, n] each head's `cap` best
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    candidates = jnp.where(capped & in_context[None, :, None, :], scores, -jnp.inf)
    flat = candidates.transpose(1, 0, 2, 3).reshape(B, L * K * n)
    keep = top_counts(flat, kept_count(ratio, L * K * context_len.astype(jnp.int32)))  # [B, L K n]
    return keep.reshape(B, L, K, n).sum(-1, dtype=jnp.int32).transpose(1, 0, 2)
