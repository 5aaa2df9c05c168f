"""Eviction: which context pairs to keep, given scores and a ratio (the fraction of context pairs kept).

Levels (budgets are exact; ties are broken by position, earlier pairs first):
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

from kvzip_jax.errors import KvzipError

LEVELS = ("pair", "pair-uniform", "layer", "head")


class RatioError(KvzipError, ValueError):
    """A compression ratio outside (0, 1]."""


def check_ratio(ratio) -> None:
    """Raises RatioError for a concrete ratio outside (0, 1]; traced ratios are left to the caller."""
    if isinstance(ratio, jax.core.Tracer):
        return
    if not 0 < float(ratio) <= 1:
        raise RatioError(f"ratio is the fraction of context pairs kept and must lie in (0, 1], got {ratio}")


def _top_counts(scores: jax.Array, counts: jax.Array) -> jax.Array:
    """keep [..., M] bool: the counts [...] highest of scores [..., M], ties broken by lower index."""
    M = scores.shape[-1]
    flat = scores.reshape(-1, M)  # [R, M]
    order = jnp.argsort(-flat, axis=-1, stable=True)  # [R, M] entries by rank
    rows = jnp.arange(flat.shape[0])[:, None]
    places = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), flat.shape)
    ranks = jnp.zeros_like(places).at[rows, order].set(places, unique_indices=True)  # the inverse permutation
    return ranks.reshape(scores.shape) < counts[..., None]


def keep_mask(scores: jax.Array, context_len: jax.Array, ratio, level: str = "pair",
              evictable: tuple[int, ...] | None = None) -> jax.Array:
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
    ratio = jnp.asarray(ratio, jnp.float32)
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    scores = jnp.where(in_context[None, :, None, :], scores.astype(jnp.float32), -jnp.inf)
    ctx = context_len.astype(jnp.float32)  # [B]
    # A hair below the product, so that ratio * count landing exactly on an integer is not lost to rounding.
    floor = lambda x: jnp.floor(x * (1 + 1e-6)).astype(jnp.int32)
    if level == "pair":
        flat = scores.transpose(1, 0, 2, 3).reshape(B, L * K * n)  # [B, L K n]
        keep = _top_counts(flat, floor(ratio * L * K * ctx)).reshape(B, L, K, n).transpose(1, 0, 2, 3)
    elif level == "pair-uniform":
        keep = _top_counts(scores, jnp.broadcast_to(floor(ratio * ctx)[None, :, None], (L, B, K)))
    elif level == "layer":
        per_layer = scores.reshape(L, B, K * n)
        keep = _top_counts(per_layer, jnp.broadcast_to(floor(ratio * K * ctx)[None, :], (L, B))).reshape(L, B, K, n)
    else:
        head = scores.max(axis=-1).transpose(1, 0, 2).reshape(B, L * K)  # [B, L K]
        kept_heads = _top_counts(head, floor(ratio * L * K * jnp.ones_like(ctx))).reshape(B, L, K)
        keep = jnp.broadcast_to(kept_heads.transpose(1, 0, 2)[..., None], (L, B, K, n))
    return keep & in_context[None, :, None, :]
