"""Eviction: which context pairs to keep, given scores and a ratio (the fraction of context pairs kept).

Levels (budgets are exact integers, budget.kept_count: floor(ratio x candidates) with the ratio taken in millionths;
ties are broken by position, earlier pairs first):
  pair          one global top-k over all layers and KV heads: non-uniform budgets (KVzip's default)
  pair-uniform  the same count in every (layer, KV head)
  layer         the same count in every layer, free across the KV heads inside it (the paper's baseline rule)
  head          whole (layer, KV head) units by their head score: a kept head keeps its whole context
Only context pairs are candidates: the prefix before the context and everything after it are never evicted.
kvpress's `compression_ratio` is the fraction removed, i.e. 1 - ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.kvzip.budget import check_candidates, check_ratio, kept_count, select_top, top_counts

LEVELS = ("pair", "pair-uniform", "layer", "head")


def keep_mask(
    scores: jax.Array, context_len: jax.Array, ratio, level: str = "pair", evictable: tuple[int, ...] | None = None
) -> jax.Array:
    """keep [L, B, K, n] bool for scores [L, B, K, n] (columns past context_len [B] are never kept).

    evictable: the layers whose pairs compete (default all); the others keep their whole context (Gemma 3's
    sliding-window layers), and the ratio counts evictable layers only. For level "head", scores are per-head
    constants broadcast over n.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    check_ratio(ratio)
    L, B, K, n = scores.shape
    if evictable is not None and tuple(evictable) != tuple(range(L)):
        chosen = jnp.asarray(evictable, jnp.int32)
        partial = keep_mask(scores[chosen], context_len, ratio, level)
        in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
        full = jnp.broadcast_to(in_context[None, :, None, :], (L, B, K, n))
        return full.at[chosen].set(partial)
    check_candidates(L * K * n)
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    scores = jnp.where(in_context[None, :, None, :], scores.astype(jnp.float32), -jnp.inf)
    ctx = context_len.astype(jnp.int32)[None, :, None, None]  # [1, B, 1, 1]
    if level == "pair":  # one budget per row over (L, K, n)
        keep = select_top(scores, kept_count(ratio, L * K * ctx), (0, 2, 3))
    elif level == "pair-uniform":  # one per (layer, row, head) over n
        keep = select_top(scores, jnp.broadcast_to(kept_count(ratio, ctx), (L, B, K, 1)), (3,))
    elif level == "layer":  # one per (layer, row) over (K, n)
        keep = select_top(scores, jnp.broadcast_to(kept_count(ratio, K * ctx), (L, B, 1, 1)), (2, 3))
    else:
        head = scores.max(axis=-1).transpose(1, 0, 2).reshape(B, L * K)  # [B, L K]
        kept_heads = top_counts(head, jnp.broadcast_to(kept_count(ratio, L * K), (B,))).reshape(B, L, K)
        keep = jnp.broadcast_to(kept_heads.transpose(1, 0, 2)[..., None], (L, B, K, n))
    return keep & in_context[None, :, None, :]
