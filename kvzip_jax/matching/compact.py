"""compact: a context cache replaced by a shorter one fitted in closed form (Attention Matching, arXiv 2602.16284).

    compact = jax.jit(matching.compact)
    compacted, counts = compact(params, cfg, cache, reread, matching.MatchingConfig(ratio=0.1, selector="omp"))
    ragged = kv.pack(compacted, room=64)                  # only the kept keys stored, with their bias

Per compacted (layer, KV head): reference queries (queries.py) pick t keys (selector: Highest-Attention-Keys,
Orthogonal Matching Pursuit, or KVzip's own scores), then fit.fit_head gives each kept key a bias beta (NNLS on the
attention mass) and a new value (least squares on the attention output). The selected keys stay at their original
slots with their original RoPE, so the compacted cache is a masked cache whose kept slots carry the new values and
the bias: every cache operation (pack, decode, the Pallas kernels) takes it as it is, and new tokens get no bias.
Never compacted: the prefix before the context, anything after it, and sliding-window layers (Gemma 3). A cache
compacted before (dense, with a bias: kv.defragment of a compacted cache, as online.py makes) compacts again: every
score and fit counts the bias its keys already carry, and a kept key's new bias includes it.

Multi-head latent attention (cfg.mla): a layer's one "KV head" is the latent cache, the reference queries are the
absorbed ones of all N heads ([W_UK q_nope | q_rope] against keys [latent | RoPE key]), so a kept token is chosen
from every head's attention together (HAK's aggregate over all of their rows) and gets one bias fitted to all heads'
masses (NNLS over their rows stacked, as a GQA group's heads share theirs). The latent is the slot's key as well
as its value, so by default (latent_values "kept") it stays as it is and refinement (which moves values) is refused.
With latent_values "fitted" a kept token also gets a value latent fitted by least squares to every head's latent
output (their rows stacked), and refinement may move the value latents. Budgets and bytes: config.py.

`compact` runs the reference pass and the fit; a sweep runs `reference_queries` once per context and
`compact_with` per ratio and method.

Einsum legend: L compacted layers, B batch, K KV heads, C cache slots, n context columns, R reference rows,
S kept keys per head (static), H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring
from kvzip_jax.matching.budgets import check_profile, fit_sizes, head_counts, profile_scores, static_count
from kvzip_jax.matching.config import MatchingConfig, check_choices, effective_ratio
from kvzip_jax.matching.fit import fit_head
from kvzip_jax.matching.queries import (
    Probes,
    QueryObserver,
    ReferenceQueries,
    reference_passes,
    reference_queries,
    stack_rows,
    thinned,
)
from kvzip_jax.matching.refine import refine_head
from kvzip_jax.matching.select import attention_key_scores, orthogonal_matching_pursuit
from kvzip_jax.models import mla
from kvzip_jax.models.transformer import apply_block, embed_tokens


def compact(params, cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs,
            config: MatchingConfig = MatchingConfig(), probes: Probes | None = None,
            queries: ReferenceQueries | None = None):
    """The compacted cache of a cache holding [prefix | context] per row, and the kept keys per head [L, B, K]
    (all layers; uncompacted layers count their whole context). reread: kvzip.reread_inputs of the contexts (the
    repeat source, and where the context lies); probes: self-study turns (queries.Probes) for that source; queries:
    this cache's reference queries when already captured (a sweep shares them), else captured here."""
    check_choices(cfg, config)
    if queries is None and (not config.on_policy or config.budget == "global"):  # on-policy uniform: no full pass
        queries = reference_queries(params, cfg, cache, reread, config.sources, config.query_cap,
                                    config.needs_kvzip_scores, probes)
    if not config.on_policy:
        return compact_with(queries, cfg, cache, reread, config)
    _check_compactable(cfg, cache, queries, config)
    size, counts, _ = _budget(queries, cfg, cache, reread.span, config, selecting=False)
    if size is None:
        return cache, counts
    return _compact_on_policy(params, cfg, cache, reread, config, probes, counts, size)


def compact_with(queries: ReferenceQueries, cfg: ModelConfig, cache: kv.KVCache,
                 reread: scoring.RereadInputs | scoring.ContextSpan, config: MatchingConfig):
    """compact from reference queries already captured (one reference pass serves many ratios and methods); every
    layer's queries come from the full cache (off-policy: MatchingConfig.on_policy needs compact). reread: the
    contexts' reread inputs, or only where the contexts lie (a ContextSpan: all the fit needs)."""
    if config.on_policy:
        raise ValueError("on-policy compaction runs the model layer by layer: call compact, not compact_with")
    _check_compactable(cfg, cache, queries, config)
    if config.self_study_queries is not None:
        queries = thinned(queries, config.self_study_queries)
    span = reread if isinstance(reread, scoring.ContextSpan) else reread.span
    size, counts, attention = _budget(queries, cfg, cache, span, config, selecting=True)
    if size is None:
        return cache, counts
    layers = scoring.evictable_layers(cfg)
    q = jnp.stack([queries.q[i] for i in layers])  # [L, B, K, R, H]
    k, v, bias = _context([cache.layers[i] for i in layers], span, cfg)  # [L, B, K, n, H], bias [L, B, K, n]
    rank = None  # OMP selects by itself
    if config.selector == "kvzip":
        rank = queries.kvzip_scores[jnp.asarray(layers)]
    elif config.selector == "hak":
        rank = attention
    fitted = _fit(q, queries.valid, k, v, bias, span, rank, counts[jnp.asarray(layers)], size, cfg, config)
    return _written(cache, span, layers, fitted, config, cfg), counts


def _check_compactable(cfg: ModelConfig, cache: kv.KVCache, queries: ReferenceQueries | None,
                       config: MatchingConfig) -> None:
    check_choices(cfg, config)
    if any(not isinstance(layer, kv.LayerCache) or layer.keep is not None for layer in cache.layers):
        raise scoring.CacheLayoutError("compact a dense cache: this one is ragged or masked (kv.defragment a masked "
                                       "or compacted one first)")
    if config.needs_kvzip_scores and queries is not None and queries.kvzip_scores is None:
        raise ValueError("these reference queries carry no KVzip scores (reference_queries(..., with_scores=True))")


def _context(layers: list[kv.LayerCache], span: scoring.ContextSpan,
             cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The context keys and values of these layers, each [L, B, K, n, H] with n = span.width, and their bias
    [L, B, K, n] (0 where a layer has none). MLA: the keys the absorbed queries meet, [latent | RoPE key]."""
    n = span.width
    take = lambda x: scoring.slot_columns(x, span.prefix_len, n, axis=2)  # [B, K, C, ...] -> [B, K, n, ...]
    bias = lambda layer: (jnp.zeros(layer.k.shape[:3], jnp.float32) if layer.bias is None else layer.bias)
    keys = lambda layer: layer.k if cfg.mla is None else mla.split_layout(cfg, layer).k
    return (jnp.stack([take(keys(layer)) for layer in layers]), jnp.stack([take(layer.v) for layer in layers]),
            jnp.stack([take(bias(layer)) for layer in layers]))


def _per_head(q, valid, k, span: scoring.ContextSpan):
    """(key_valid [L, B, K, n], query_valid [L, B, K, R], heads) for queries q [L, B, K, R, H] (valid [B, R]) and keys
    k [L, B, K, n, H]; heads flattens [L, B, K, ...] -> [L B K, ...] for a lax.map over heads."""
    L, B, K, n, _ = k.shape
    key_valid = jnp.broadcast_to((jnp.arange(n) < span.context_len[:, None])[None, :, None, :], (L, B, K, n))
    query_valid = jnp.broadcast_to(valid[None, :, None, :], q.shape[:4])
    return key_valid, query_valid, lambda x: x.reshape((L * B * K,) + x.shape[3:])


def _attention_scores(q, valid, k, bias, span: scoring.ContextSpan, cfg: ModelConfig, config: MatchingConfig):
    """HAK's per-key scores [L, B, K, n] of queries q [L, B, K, R, H] (valid [B, R]) over keys k [L, B, K, n, H] with
    their bias [L, B, K, n]."""
    L, B, K, n, _ = k.shape
    key_valid, query_valid, heads = _per_head(q, valid, k, span)
    return jax.lax.map(lambda a: attention_key_scores(a[0], a[1], cfg.query_scale, config.aggregate, a[2], a[3],
                                                      a[4]),
                       (heads(q), heads(k), heads(key_valid), heads(query_valid), heads(bias))).reshape(L, B, K, n)


def _budget(queries: ReferenceQueries | None, cfg: ModelConfig, cache: kv.KVCache, span: scoring.ContextSpan,
            config: MatchingConfig, selecting: bool):
    """(size, counts [L_all, B, K], attention): the most keys of one head (static; None: nothing to compact), every
    layer's count (uncompacted layers count their whole context), and HAK's per-key scores [L, B, K, n] of the
    compacted layers when the budgets rank them or, selecting, the selector does (else None): computed once for
    both."""
    layers = scoring.evictable_layers(cfg)
    n = span.width
    full = jnp.broadcast_to(span.context_len[None, :, None],
                            (cfg.num_layers,) + cache.layers[0].lengths.shape).astype(jnp.int32)
    if config.ratio >= 1.0 or not layers:
        return None, full, None
    ratio = effective_ratio(config, cache)
    size = static_count(ratio, n, config.budget, config.head_cap)
    shape = (len(layers),) + cache.layers[0].lengths.shape + (n,)
    global_by_attention = config.budget == "global" and config.budget_scores == "attention"
    attention = None
    if global_by_attention or (selecting and config.selector == "hak"):
        q = jnp.stack([queries.q[i] for i in layers])
        k, _, bias = _context([cache.layers[i] for i in layers], span, cfg)
        attention = _attention_scores(q, queries.valid, k, bias, span, cfg, config)
    scores = None
    if config.budget == "global":
        scores = attention if global_by_attention else queries.kvzip_scores[jnp.asarray(layers)][..., :n]
    elif config.budget == "profile":
        check_profile(config.profile, len(layers), shape[2])
        scores = profile_scores(jnp.asarray(config.profile, jnp.float32), span.context_len, n)
    counts = head_counts(ratio, span.context_len, shape, config.budget, scores, config.head_cap)  # [L, B, K]
    return size, full.at[jnp.asarray(layers)].set(counts), attention


def _fit(q, valid, k, v, bias, span: scoring.ContextSpan, rank, counts, size: int, cfg: ModelConfig,
         config: MatchingConfig):
    """Per head: select `counts` [L, B, K] of the keys k [L, B, K, n, H] (with their bias [L, B, K, n]; by rank
    [L, B, K, n], or OMP), then fit their bias and values -> (selected [L, B, K, S] int32, active bool, beta float32
    (the kept keys' whole bias), c_v [L, B, K, S, H'] with H' the values' width) with S = size. The heads are fitted
    one after another, each at the smallest static size of budgets.fit_sizes that holds its count (a switch at run
    time); a fit does not depend on its padding, so the ladder only saves work."""
    L, B, K, n, _ = k.shape
    key_valid, query_valid, heads = _per_head(q, valid, k, span)
    scale = cfg.query_scale
    lower, upper, iters = config.nnls_bounds()

    def fit_one(t, args):  # one head fitted at t keys, padded to `size`
        q_h, qv_h, k_h, v_h, b_h, kv_h, count, rank_h = args
        if config.selector == "omp":
            selected = orthogonal_matching_pursuit(q_h, k_h, scale, t, kv_h, query_valid=qv_h, limit=count,
                                                   per_step=config.omp_step, refit_every=config.omp_refit,
                                                   key_bias=b_h)
        else:
            _, selected = jax.lax.top_k(rank_h[:n], t)
        active = (jnp.arange(t) < count) & kv_h[selected]  # [t]
        c_k, beta, c_v = fit_head(q_h, k_h, v_h, selected, scale, kv_h, query_valid=qv_h, active=active,
                                  lower=lower, upper=upper, iters=iters, value_ridge=config.value_ridge,
                                  key_bias=b_h, fit_values=cfg.mla is None or config.latent_values == "fitted")
        if config.refine_steps:  # keys stay at their slots: only beta (when fitted) and C_v move
            _, beta, c_v, _ = refine_head(q_h, k_h, v_h, c_k, beta, c_v, scale, kv_h, query_valid=qv_h,
                                          active=active, steps=config.refine_steps, train_bias=config.fit_bias,
                                          key_bias=b_h)
        pad = lambda x: jnp.pad(x, [(0, size - t)] + [(0, 0)] * (x.ndim - 1))  # [t, ...] -> [S, ...]
        return pad(selected.astype(jnp.int32)), pad(active), pad(beta), pad(c_v)

    def nothing_kept(args):  # a head whose count is 0
        return (jnp.zeros((size,), jnp.int32), jnp.zeros((size,), bool), jnp.zeros((size,), jnp.float32),
                jnp.zeros((size, v.shape[-1]), jnp.float32))

    sizes = fit_sizes(size)  # descending
    branches = [nothing_kept] + [functools.partial(fit_one, s) for s in sizes]

    def fit_at_its_size(args):  # branch i >= 1 fits at sizes[i - 1], the smallest that holds the count
        count = args[6]
        branch = jnp.where(count > 0, jnp.sum(jnp.asarray(sizes) >= count), 0)
        return jax.lax.switch(branch, branches, args)

    rank_heads = heads(rank) if rank is not None else jnp.zeros((L * B * K, n), jnp.float32)
    inputs = (heads(q), heads(query_valid), heads(k), heads(v), heads(bias), heads(key_valid), counts.reshape(-1),
              rank_heads)
    fitted = jax.lax.map(fit_at_its_size, inputs)  # a loop, not a vmap: each head runs its own branch only
    return tuple(x.reshape((L, B, K) + x.shape[1:]) for x in fitted)


def _written(cache: kv.KVCache, span: scoring.ContextSpan, layers, fitted, config: MatchingConfig,
             cfg: ModelConfig) -> kv.KVCache:
    """The cache with layers[j] compacted to fitted[...][j] (_fit's outputs); without config.fit_bias the fitted beta
    (the kept keys' own bias, if any, when beta is not fitted) is not written and each layer keeps the bias it had.
    MLA with fitted value latents: each layer first takes the split layout (its latents copied into its keys)."""
    selected, active, beta, c_v = fitted
    new_layers = list(cache.layers)
    for j, i in enumerate(layers):
        layer = cache.layers[i]
        if config.latent_values == "fitted":
            layer = mla.split_layout(cfg, layer)
        new_layers[i] = _compacted_layer(layer, span.prefix_len, span.context_len, selected[j], active[j],
                                         beta[j] if config.fit_bias else None, c_v[j])
    return dataclasses.replace(cache, layers=tuple(new_layers))


def _compact_on_policy(params, cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs,
                       config: MatchingConfig, probes: Probes | None, counts, size: int):
    """Layer-sequential compaction: the reference passes run layer by layer, and layer l's queries (and KVzip
    scores) come from the residual stream of layers < l already compacted, so each layer is fitted to the queries it
    will see. Counts come from the full cache's pass (global budgets rank every layer at once). Called eagerly, each
    step is a small jitted graph (one per layer, shared by every ratio); under an outer jit they inline."""
    passes = reference_passes(cfg, cache, reread, config.sources, config.query_cap, probes,
                              with_scores=config.selector == "kvzip")
    streams = [embed_tokens(params["embed"], p.tokens, cfg) for p in passes]  # each [B, W, D]
    compacted = set(scoring.evictable_layers(cfg))
    for i in range(cfg.num_layers):
        if i in compacted:
            observed = [_observed_block(params, cfg, i, x, p.positions, p.cache_under(cache.layers[i]), p.num_valid,
                                        QueryObserver(p.rows, p.scorer)) for x, p in zip(streams, passes)]
            folded = [p.folded(o[0]) for o, p in zip(observed, passes)]
            fitted = _fit_layer(cfg, config, size, cache.layers[i], reread.span, counts[i], [q for q, _ in folded],
                                [v for _, v in folded], [o[1] for o, p in zip(observed, passes) if p.scorer])
            cache = _written(cache, reread.span, (i,), fitted, config, cfg)
        if i < cfg.num_layers - 1:
            streams = [_block(params, cfg, i, x, p.positions, p.cache_under(cache.layers[i]), p.num_valid)
                       for x, p in zip(streams, passes)]
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
def _fit_layer(cfg: ModelConfig, config: MatchingConfig, size: int, layer: kv.LayerCache, span, counts,
               captured, valid, scored):
    """_fit of one layer from its captured queries (per pass [B, K, G, R_i, H], valid [B, R_i]) and, for the kvzip
    selector, its per-chunk KVzip scores [B, K, m] -> fitted arrays with a leading layer axis of 1."""
    q, valid = stack_rows([((c,), v) for c, v in zip(captured, valid)], cfg.group_size)
    q = q[0][None]  # [1, B, K, R, H]
    k, v, bias = _context([layer], span, cfg)
    rank = None
    if config.selector == "kvzip":
        rank = scoring.in_context_scores(jnp.concatenate(scored, axis=-1)[None], span.context_len)
    elif config.selector == "hak":
        rank = _attention_scores(q, valid, k, bias, span, cfg, config)
    return _fit(q, valid, k, v, bias, span, rank, counts[None], size, cfg, config)


@jax.jit
def _compacted_layer(layer: kv.LayerCache, prefix_len, context_len, selected, active, beta, c_v) -> kv.LayerCache:
    """The layer with its context slots masked but for the selected ones [B, K, S], which take the fitted values
    c_v [B, K, S, H] and the bias beta [B, K, S] (other slots keep the bias they had, if any; beta None: the layer
    keeps its bias, or none)."""
    B, K, C, _ = layer.k.shape
    slots = jnp.arange(C, dtype=jnp.int32)  # [C]
    in_context = (slots >= prefix_len[:, None]) & (slots < (prefix_len + context_len)[:, None])  # [B, C]
    target = jnp.where(active, prefix_len[:, None, None] + selected, C)  # [B, K, S]; inactive aim past the end
    batch, head = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
    keep = jnp.broadcast_to(~in_context[:, None, :], (B, K, C)).at[batch, head, target].set(True, mode="drop")
    values = layer.v.at[batch, head, target].set(c_v.astype(layer.v.dtype), mode="drop")
    if beta is None:
        return dataclasses.replace(layer, v=values, keep=keep)
    bias = jnp.zeros((B, K, C), jnp.float32) if layer.bias is None else layer.bias
    bias = bias.at[batch, head, target].set(beta, mode="drop")
    return dataclasses.replace(layer, v=values, keep=keep, bias=bias)
