"""Per-head compaction over a stack of layers: the context keys, values and bias; HAK's per-key scores; every
head's budget; each head's selected keys with their fitted bias and values (at the smallest static size that holds
its count); the fitted heads written into the cache. compact.py and on_policy.py run these.

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
from kvzip_jax.matching.config import MatchingConfig, effective_ratio
from kvzip_jax.matching.fit import fit_head
from kvzip_jax.matching.queries import ReferenceQueries
from kvzip_jax.matching.refine import refine_head
from kvzip_jax.matching.select import attention_key_scores, orthogonal_matching_pursuit
from kvzip_jax.models import mla


def context_of(
    layers: list[kv.LayerCache], span: scoring.ContextSpan, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The context keys and values of these layers, each [L, B, K, n, H] with n = span.width, and their bias
    [L, B, K, n] (0 where a layer has none). MLA: the keys the absorbed queries meet, [latent | RoPE key]."""
    n = span.width
    take = lambda x: scoring.slot_columns(x, span.prefix_len, n, axis=2)  # [B, K, C, ...] -> [B, K, n, ...]
    bias = lambda layer: jnp.zeros(layer.k.shape[:3], jnp.float32) if layer.bias is None else layer.bias
    keys = lambda layer: layer.k if cfg.mla is None else mla.split_layout(cfg, layer).k
    return (
        jnp.stack([take(keys(layer)) for layer in layers]),
        jnp.stack([take(layer.v) for layer in layers]),
        jnp.stack([take(bias(layer)) for layer in layers]),
    )


def per_head(q, valid, k, span: scoring.ContextSpan):
    """(key_valid [L, B, K, n], query_valid [L, B, K, R], heads) for queries q [L, B, K, R, H] (valid [B, R]) and keys
    k [L, B, K, n, H]; heads flattens [L, B, K, ...] -> [L B K, ...] for a lax.map over heads."""
    L, B, K, n, _ = k.shape
    key_valid = jnp.broadcast_to((jnp.arange(n) < span.context_len[:, None])[None, :, None, :], (L, B, K, n))
    query_valid = jnp.broadcast_to(valid[None, :, None, :], q.shape[:4])
    return key_valid, query_valid, lambda x: x.reshape((L * B * K,) + x.shape[3:])


def attention_scores(q, valid, k, bias, span: scoring.ContextSpan, cfg: ModelConfig, config: MatchingConfig):
    """HAK's per-key scores [L, B, K, n] of queries q [L, B, K, R, H] (valid [B, R]) over keys k [L, B, K, n, H] with
    their bias [L, B, K, n]."""
    L, B, K, n, _ = k.shape
    key_valid, query_valid, heads = per_head(q, valid, k, span)
    return jax.lax.map(
        lambda a: attention_key_scores(a[0], a[1], cfg.query_scale, config.aggregate, a[2], a[3], a[4]),
        (heads(q), heads(k), heads(key_valid), heads(query_valid), heads(bias)),
    ).reshape(L, B, K, n)


def budget(
    queries: ReferenceQueries | None,
    cfg: ModelConfig,
    cache: kv.KVCache,
    span: scoring.ContextSpan,
    config: MatchingConfig,
    selecting: bool,
):
    """(size, counts [L_all, B, K], attention): the most keys of one head (static; None: nothing to compact), every
    layer's count (uncompacted layers count their whole context), and HAK's per-key scores [L, B, K, n] of the
    compacted layers when the budgets rank them or, selecting, the selector does (else None): computed once for
    both."""
    layers = scoring.evictable_layers(cfg)
    n = span.width
    full = jnp.broadcast_to(span.context_len[None, :, None], (cfg.num_layers,) + cache.layers[0].lengths.shape).astype(
        jnp.int32
    )
    if config.ratio >= 1.0 or not layers:
        return None, full, None
    ratio = effective_ratio(config, cache)
    size = static_count(ratio, n, config.budget, config.head_cap)
    shape = (len(layers),) + cache.layers[0].lengths.shape + (n,)
    global_by_attention = config.budget == "global" and config.budget_scores == "attention"
    attention = None
    if global_by_attention or (selecting and config.selector == "hak"):
        q = jnp.stack([queries.q[i] for i in layers])
        k, _, bias = context_of([cache.layers[i] for i in layers], span, cfg)
        attention = attention_scores(q, queries.valid, k, bias, span, cfg, config)
    scores = None
    if config.budget == "global":
        scores = attention if global_by_attention else queries.kvzip_scores[jnp.asarray(layers)][..., :n]
    elif config.budget == "profile":
        check_profile(config.profile, len(layers), shape[2])
        scores = profile_scores(jnp.asarray(config.profile, jnp.float32), span.context_len, n)
    counts = head_counts(ratio, span.context_len, shape, config.budget, scores, config.head_cap)  # [L, B, K]
    return size, full.at[jnp.asarray(layers)].set(counts), attention


def fit_heads(
    q, valid, k, v, bias, span: scoring.ContextSpan, rank, counts, size: int, cfg: ModelConfig, config: MatchingConfig
):
    """Per head: select `counts` [L, B, K] of the keys k [L, B, K, n, H] (with their bias [L, B, K, n]; by rank
    [L, B, K, n], or OMP), then fit their bias and values -> (selected [L, B, K, S] int32, active bool, beta float32
    (the kept keys' whole bias), c_v [L, B, K, S, H'] with H' the values' width) with S = size. The heads are fitted
    one after another, each at the smallest static size of budgets.fit_sizes that holds its count (a switch at run
    time); a fit does not depend on its padding, so the ladder only saves work."""
    L, B, K, n, _ = k.shape
    key_valid, query_valid, heads = per_head(q, valid, k, span)
    scale = cfg.query_scale
    lower, upper, iters = config.nnls_bounds()

    def fit_one(t, args):  # one head fitted at t keys, padded to `size`
        q_h, qv_h, k_h, v_h, b_h, kv_h, count, rank_h = args
        if config.selector == "omp":
            selected = orthogonal_matching_pursuit(
                q_h,
                k_h,
                scale,
                t,
                kv_h,
                query_valid=qv_h,
                limit=count,
                per_step=config.omp_step,
                refit_every=config.omp_refit,
                key_bias=b_h,
            )
        else:
            _, selected = jax.lax.top_k(rank_h[:n], t)
        active = (jnp.arange(t) < count) & kv_h[selected]  # [t]
        c_k, beta, c_v = fit_head(
            q_h,
            k_h,
            v_h,
            selected,
            scale,
            kv_h,
            query_valid=qv_h,
            active=active,
            lower=lower,
            upper=upper,
            iters=iters,
            value_ridge=config.value_ridge,
            key_bias=b_h,
            fit_values=cfg.mla is None or config.latent_values == "fitted",
        )
        if config.refine_steps:  # keys stay at their slots: only beta (when fitted) and C_v move
            _, beta, c_v, _ = refine_head(
                q_h,
                k_h,
                v_h,
                c_k,
                beta,
                c_v,
                scale,
                kv_h,
                query_valid=qv_h,
                active=active,
                steps=config.refine_steps,
                train_bias=config.fit_bias,
                key_bias=b_h,
            )
        pad = lambda x: jnp.pad(x, [(0, size - t)] + [(0, 0)] * (x.ndim - 1))  # [t, ...] -> [S, ...]
        return pad(selected.astype(jnp.int32)), pad(active), pad(beta), pad(c_v)

    def nothing_kept(args):  # a head whose count is 0
        return (
            jnp.zeros((size,), jnp.int32),
            jnp.zeros((size,), bool),
            jnp.zeros((size,), jnp.float32),
            jnp.zeros((size, v.shape[-1]), jnp.float32),
        )

    sizes = fit_sizes(size)  # descending
    branches = [nothing_kept] + [functools.partial(fit_one, s) for s in sizes]

    def fit_at_its_size(args):  # branch i >= 1 fits at sizes[i - 1], the smallest that holds the count
        count = args[6]
        branch = jnp.where(count > 0, jnp.sum(jnp.asarray(sizes) >= count), 0)
        return jax.lax.switch(branch, branches, args)

    rank_heads = heads(rank) if rank is not None else jnp.zeros((L * B * K, n), jnp.float32)
    inputs = (
        heads(q),
        heads(query_valid),
        heads(k),
        heads(v),
        heads(bias),
        heads(key_valid),
        counts.reshape(-1),
        rank_heads,
    )
    fitted = jax.lax.map(fit_at_its_size, inputs)  # a loop, not a vmap: each head runs its own branch only
    return tuple(x.reshape((L, B, K) + x.shape[1:]) for x in fitted)


def written(
    cache: kv.KVCache, span: scoring.ContextSpan, layers, fitted, config: MatchingConfig, cfg: ModelConfig
) -> kv.KVCache:
    """The cache with layers[j] compacted to fitted[...][j] (fit_heads' outputs); without config.fit_bias the fitted
    beta (the kept keys' own bias, if any, when beta is not fitted) is not written and each layer keeps its bias.
    MLA with fitted value latents: each layer first takes the split layout (its latents copied into its keys)."""
    selected, active, beta, c_v = fitted
    new_layers = list(cache.layers)
    for j, i in enumerate(layers):
        layer = cache.layers[i]
        if config.latent_values == "fitted":
            layer = mla.split_layout(cfg, layer)
        new_layers[i] = compacted_layer(
            layer,
            span.prefix_len,
            span.context_len,
            selected[j],
            active[j],
            beta[j] if config.fit_bias else None,
            c_v[j],
        )
    return dataclasses.replace(cache, layers=tuple(new_layers))


@jax.jit
def compacted_layer(layer: kv.LayerCache, prefix_len, context_len, selected, active, beta, c_v) -> kv.LayerCache:
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
