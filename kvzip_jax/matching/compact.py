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

import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring
from kvzip_jax.matching.config import MatchingConfig, check_choices
from kvzip_jax.matching.heads import budget, context_of, fit_heads, written
from kvzip_jax.matching.on_policy import compact_on_policy
from kvzip_jax.matching.queries import Probes, ReferenceQueries, reference_queries, thinned


def compact(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: scoring.RereadInputs,
    config: MatchingConfig = MatchingConfig(),
    probes: Probes | None = None,
    queries: ReferenceQueries | None = None,
):
    """The compacted cache of a cache holding [prefix | context] per row, and the kept keys per head [L, B, K]
    (all layers; uncompacted layers count their whole context). reread: kvzip.reread_inputs of the contexts (the
    repeat source, and where the context lies); probes: self-study turns (queries.Probes) for that source; queries:
    this cache's reference queries when already captured (a sweep shares them), else captured here."""
    check_choices(cfg, config)
    if queries is None and (not config.on_policy or config.budget == "global"):  # on-policy uniform: no full pass
        queries = reference_queries(
            params, cfg, cache, reread, config.sources, config.query_cap, config.needs_kvzip_scores, probes
        )
    if not config.on_policy:
        return compact_with(queries, cfg, cache, reread, config)
    _check_compactable(cfg, cache, queries, config)
    size, counts, _ = budget(queries, cfg, cache, reread.span, config, selecting=False)
    if size is None:
        return cache, counts
    return compact_on_policy(params, cfg, cache, reread, config, probes, counts, size)


def compact_with(
    queries: ReferenceQueries,
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: scoring.RereadInputs | scoring.ContextSpan,
    config: MatchingConfig,
):
    """compact from reference queries already captured (one reference pass serves many ratios and methods); every
    layer's queries come from the full cache (off-policy: MatchingConfig.on_policy needs compact). reread: the
    contexts' reread inputs, or only where the contexts lie (a ContextSpan: all the fit needs)."""
    if config.on_policy:
        raise ValueError("on-policy compaction runs the model layer by layer: call compact, not compact_with")
    _check_compactable(cfg, cache, queries, config)
    if config.self_study_queries is not None:
        queries = thinned(queries, config.self_study_queries)
    span = reread if isinstance(reread, scoring.ContextSpan) else reread.span
    size, counts, attention = budget(queries, cfg, cache, span, config, selecting=True)
    if size is None:
        return cache, counts
    layers = scoring.evictable_layers(cfg)
    q = jnp.stack([queries.q[i] for i in layers])  # [L, B, K, R, H]
    k, v, bias = context_of([cache.layers[i] for i in layers], span, cfg)  # [L, B, K, n, H], bias [L, B, K, n]
    rank = None  # OMP selects by itself
    if config.selector == "kvzip":
        rank = queries.kvzip_scores[jnp.asarray(layers)]
    elif config.selector == "hak":
        rank = attention
    fitted = fit_heads(q, queries.valid, k, v, bias, span, rank, counts[jnp.asarray(layers)], size, cfg, config)
    return written(cache, span, layers, fitted, config, cfg), counts


def _check_compactable(
    cfg: ModelConfig, cache: kv.KVCache, queries: ReferenceQueries | None, config: MatchingConfig
) -> None:
    check_choices(cfg, config)
    if any(not isinstance(layer, kv.LayerCache) or layer.keep is not None for layer in cache.layers):
        raise scoring.CacheLayoutError(
            "compact a dense cache: this one is ragged or masked (kv.defragment a masked or compacted one first)"
        )
    if config.needs_kvzip_scores and queries is not None and queries.kvzip_scores is None:
        raise ValueError("these reference queries carry no KVzip scores (reference_queries(..., with_scores=True))")
