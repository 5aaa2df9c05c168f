"""Baselines of the KVzip paper (App. A), scored on the same cache as KVzip and evicted at the same ratio.

    scores = baseline_scores("snapkv", params, cfg, cache, prefix_len, context_len, context_tokens, question)
    keep = keep_for("snapkv", scores, context_len, 0.3)          # [L, B, K, n], then cache.mask_context

Budget rule per method (ratio = fraction of context pairs kept):
  kvzip         one global top-k over layers and heads (eviction level "pair"; scores from kvzip.score)
  h2o, snapkv,  the same count in every layer (budgets.uniform_layer_counts), shared by its KV heads with a per-head
  random        floor (budgets.keep_by_layer); h2o's and snapkv's observation windows are kept and paid for first
  pyramidkv     PyramidKV's layer budgets (pyramidkv.pyramid_budgets: a line over the budget minus the window, the
                window kept in every layer), shared by the heads as above
  streamingllm  the same count in every (layer, KV head) (level "pair-uniform")
Query-aware methods (QUERY_AWARE) observe a question appended after the context when one is given.

Einsum legend: B batch, K KV heads, L layers, n context columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.baselines.budgets import keep_by_layer, uniform_layer_counts
from kvzip_jax.baselines.h2o import h2o_scores
from kvzip_jax.baselines.observe import observe_span
from kvzip_jax.baselines.pyramidkv import pyramid_budgets
from kvzip_jax.baselines.random import random_scores
from kvzip_jax.baselines.snapkv import snapkv_scores, window_sizes
from kvzip_jax.baselines.streaming import streaming_scores
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.kvzip.eviction import keep_mask

METHODS = ("kvzip", "h2o", "snapkv", "pyramidkv", "streamingllm", "random")
QUERY_AWARE = ("h2o", "snapkv", "pyramidkv")
SCORED_HERE = METHODS[1:]  # kvzip's scores come from kvzip_jax.kvzip.score


def keep_for(
    method: str, scores: jax.Array, context_len: jax.Array, ratio, evictable: tuple[int, ...] | None = None
) -> jax.Array:
    """keep [L, B, K, n] bool for scores [L, B, K, n] under the method's budget rule (module docstring).

    evictable: the layers that are evicted (default all); the others keep their whole context, and the budgets
    (pyramidkv's slope included) span the evictable layers only.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "kvzip":
        return keep_mask(scores, context_len, ratio, "pair", evictable)
    if method == "streamingllm":
        return keep_mask(scores, context_len, ratio, "pair-uniform", evictable)
    check_ratio(ratio)
    L, B, K, n = scores.shape
    layers = tuple(range(L)) if evictable is None else tuple(evictable)
    budget = pyramid_budgets if method == "pyramidkv" else uniform_layer_counts
    chosen = jnp.asarray(layers, jnp.int32)
    keep = keep_by_layer(scores[chosen], context_len, budget(ratio, context_len, len(layers), K))
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    whole = jnp.broadcast_to(in_context[None, :, None, :], (L, B, K, n))
    return whole.at[chosen].set(keep)


def baseline_scores(
    method: str,
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    prefix_len: jax.Array,
    context_len: jax.Array,
    context_tokens: jax.Array,
    question=None,
    key=None,
) -> jax.Array:
    """Scores [L, B, K, n] of a baseline for a cache holding [prefix | context] (context_tokens [B, n]).

    question: (tokens [B, Tq], lengths [B]) appended after the context, observed by QUERY_AWARE methods and
    ignored by the others; key: the PRNG key of "random".
    """
    L, K, n = cfg.num_layers, cfg.num_kv_heads, context_tokens.shape[1]
    if method == "h2o":
        return h2o_scores(params, cfg, cache, prefix_len, context_len, context_tokens, question)
    if method in ("snapkv", "pyramidkv"):
        return snapkv_scores(params, cfg, cache, prefix_len, context_len, context_tokens, question)
    if method == "streamingllm":
        return streaming_scores(context_len, L, K, n)
    if method == "random":
        if key is None:
            raise ValueError("random scores need a PRNG key")
        return random_scores(key, context_len, L, K, n)
    raise ValueError(f"baseline_scores scores {SCORED_HERE} (kvzip's come from kvzip_jax.kvzip.score), got {method!r}")


__all__ = [
    "METHODS",
    "QUERY_AWARE",
    "baseline_scores",
    "h2o_scores",
    "keep_by_layer",
    "keep_for",
    "observe_span",
    "pyramid_budgets",
    "random_scores",
    "snapkv_scores",
    "streaming_scores",
    "uniform_layer_counts",
    "window_sizes",
]
