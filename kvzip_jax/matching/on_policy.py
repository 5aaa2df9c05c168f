"""On-policy (layer-sequential) compaction: layer l is fitted to the queries of a model whose layers below l are
already compacted, each step a small jitted graph shared by every ratio.

Einsum legend: B batch, K KV heads, G query heads per KV head, R reference rows, W pass width, D model width,
H head dim, m chunk columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring
from kvzip_jax.matching.config import MatchingConfig
from kvzip_jax.matching.heads import attention_scores, context_of, fit_heads, written
from kvzip_jax.matching.queries import Probes, QueryObserver, reference_passes, stack_rows
from kvzip_jax.models.transformer import apply_block, embed_tokens


def compact_on_policy(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: scoring.RereadInputs,
    config: MatchingConfig,
    probes: Probes | None,
    counts,
    size: int,
):
    """Layer-sequential compaction: the reference passes run layer by layer, and layer l's queries (and KVzip
    scores) come from the residual stream of layers < l already compacted, so each layer is fitted to the queries it
    will see. Counts come from the full cache's pass (global budgets rank every layer at once). Called eagerly, each
    step is a small jitted graph (one per layer, shared by every ratio); under an outer jit they inline."""
    passes = reference_passes(
        cfg, cache, reread, config.sources, config.query_cap, probes, with_scores=config.selector == "kvzip"
    )
    streams = [embed_tokens(params["embed"], p.tokens, cfg) for p in passes]  # each [B, W, D]
    compacted = set(scoring.evictable_layers(cfg))
    for i in range(cfg.num_layers):
        if i in compacted:
            observed = [
                _observed_block(
                    params,
                    cfg,
                    i,
                    x,
                    p.positions,
                    p.cache_under(cache.layers[i]),
                    p.num_valid,
                    QueryObserver(p.rows, p.scorer),
                )
                for x, p in zip(streams, passes)
            ]
            folded = [p.folded(o[0]) for o, p in zip(observed, passes)]
            fitted = _fit_layer(
                cfg,
                config,
                size,
                cache.layers[i],
                reread.span,
                counts[i],
                [q for q, _ in folded],
                [v for _, v in folded],
                [o[1] for o, p in zip(observed, passes) if p.scorer],
            )
            cache = written(cache, reread.span, (i,), fitted, config, cfg)
        if i < cfg.num_layers - 1:
            streams = [
                _block(params, cfg, i, x, p.positions, p.cache_under(cache.layers[i]), p.num_valid)
                for x, p in zip(streams, passes)
            ]
    return cache, counts


@functools.partial(jax.jit, static_argnums=(1, 2))
def _observed_block(params, cfg: ModelConfig, index: int, x, positions, layer_cache, num_new, observer):
    """Layer `index`'s observer output on the residual stream x [B, W, D]."""
    return apply_block(params, cfg, index, x, positions, layer_cache, num_new, observer)[2]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _block(params, cfg: ModelConfig, index: int, x, positions, layer_cache, num_new):
    """The residual stream after layer `index`."""
    return apply_block(params, cfg, index, x, positions, layer_cache, num_new)[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _fit_layer(
    cfg: ModelConfig, config: MatchingConfig, size: int, layer: kv.LayerCache, span, counts, captured, valid, scored
):
    """fit_heads of one layer from its captured queries (per pass [B, K, G, R_i, H], valid [B, R_i]) and, for the kvzip
    selector, its per-chunk KVzip scores [B, K, m] -> fitted arrays with a leading layer axis of 1."""
    q, valid = stack_rows([((c,), v) for c, v in zip(captured, valid)], cfg.group_size)
    q = q[0][None]  # [1, B, K, R, H]
    k, v, bias = context_of([layer], span, cfg)
    rank = None
    if config.selector == "kvzip":
        rank = scoring.in_context_scores(jnp.concatenate(scored, axis=-1)[None], span.context_len)
    elif config.selector == "hak":
        rank = attention_scores(q, valid, k, bias, span, cfg, config)
    return fit_heads(q, valid, k, v, bias, span, rank, counts[None], size, cfg, config)
