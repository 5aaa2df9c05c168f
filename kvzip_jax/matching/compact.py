"""compact: a context cache replaced by a shorter one fitted in closed form (Attention Matching, arXiv 2602.16284).

    compact = jax.jit(matching.compact)
    compacted, counts = compact(params, cfg, cache, reread, matching.MatchingConfig(ratio=0.1, selector="omp"))
    ragged = kv.pack(compacted, room=64)                  # only the kept keys stored, with their bias

Per compacted (layer, KV head): reference queries (queries.py) pick t keys (selector: Highest-Attention-Keys,
Orthogonal Matching Pursuit, or KVzip's own scores), then fit.fit_head gives each kept key a bias beta (NNLS on the
attention mass) and a new value (least squares on the attention output). The selected keys stay at their original
slots with their original RoPE, so the compacted cache is a masked cache whose kept slots carry the new values and
the bias: every cache operation (pack, decode, the Pallas kernels) takes it as it is, and new tokens get no bias.
Never compacted: the prefix before the context, anything after it, and sliding-window layers (Gemma 3).

Budgets (budgets.py) are uniform or global. `same_bytes` (default) counts the bias' 4 bytes per kept pair: a ratio
keeps fewer pairs (x 2 H b / (2 H b + 4) for head dim H and b bytes per element, 0.8% fewer at H = 64 in float32),
so a compacted cache holds at most the bytes of an evicted one at the same ratio.

`compact` runs the reference pass and the fit; a sweep runs `reference_queries` once per context and
`compact_with` per ratio and method.

Einsum legend: L compacted layers, B batch, K KV heads, C cache slots, n context columns, R reference rows,
S kept keys per head (static), H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.matching.budgets import BUDGETS, head_counts, static_count
from kvzip_jax.matching.fit import fit_head
from kvzip_jax.matching.queries import SOURCES, Probes, ReferenceQueries, reference_queries
from kvzip_jax.matching.select import AGGREGATIONS, OMP_UPPER, attention_key_scores, orthogonal_matching_pursuit

SELECTORS = ("hak", "omp", "kvzip")
BUDGET_SCORES = ("kvzip", "attention")
METHODS = {"am-hak": "hak", "am-omp": "omp", "kvzip-am": "kvzip"}  # method name -> selector
BIAS_BYTES = 4  # a float32 beta per kept pair


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MatchingConfig:
    """Static choices of a compaction (hashable: jit needs no extra arguments; the ratio sets shapes, so it lives here).

    ratio: fraction of context pairs kept, in (0, 1]. selector: hak | omp | kvzip. aggregate: HAK's aggregation over
    queries (rms | max | mean). budget: uniform | global; budget_scores: what global budgets rank (KVzip's scores,
    or the reference queries' aggregated attention); head_cap: a head keeps at most head_cap x the uniform count.
    sources: reference query sources (queries.SOURCES); query_cap: most reference rows per KV head and layer.
    omp_step, omp_refit: OMP's keys per step and steps per refit (1, 1: exact; 4, 2: AM-OMP-fast).
    """

    ratio: float = 0.1
    selector: str = "hak"
    aggregate: str = "rms"
    budget: str = "global"
    budget_scores: str = "kvzip"
    head_cap: float = 4.0
    sources: tuple[str, ...] = ("repeat",)
    query_cap: int = 8192
    omp_step: int = 1
    omp_refit: int = 1
    same_bytes: bool = True

    def __post_init__(self):
        check_ratio(self.ratio)
        for name, value, choices in (("selector", self.selector, SELECTORS), ("aggregate", self.aggregate,
                                     AGGREGATIONS), ("budget", self.budget, BUDGETS),
                                     ("budget_scores", self.budget_scores, BUDGET_SCORES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if not self.sources or set(self.sources) - set(SOURCES):
            raise ValueError(f"sources must be among {SOURCES}, got {self.sources}")
        if self.head_cap < 1 or self.query_cap < 1 or self.omp_step < 1 or self.omp_refit < 1:
            raise ValueError("head_cap, query_cap, omp_step and omp_refit must be >= 1")
        if self.needs_kvzip_scores and "repeat" not in self.sources:
            raise ValueError("KVzip's scores (selector kvzip, or global budgets by kvzip) need the 'repeat' source")

    @property
    def needs_kvzip_scores(self) -> bool:
        return self.selector == "kvzip" or (self.budget == "global" and self.budget_scores == "kvzip")

    @property
    def needs_attention_scores(self) -> bool:
        return self.selector == "hak" or (self.budget == "global" and self.budget_scores == "attention")

    def box(self) -> tuple[float, float, int]:
        """(lower, upper, gradient steps) of the NNLS weights: OMP's [1e-12, e^7] with none, else HAK's e^+-3
        with 2 (the reference code's settings)."""
        return (1e-12, OMP_UPPER, 0) if self.selector == "omp" else (math.exp(-3.0), math.exp(3.0), 2)


def method_config(method: str, ratio: float, **choices) -> MatchingConfig:
    """The MatchingConfig of a named method (METHODS) at a ratio."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    return MatchingConfig(ratio=ratio, selector=METHODS[method], **choices)


def effective_ratio(config: MatchingConfig, cache: kv.KVCache) -> float:
    """The ratio of pairs kept: config.ratio, less the bias' bytes when same_bytes."""
    if not config.same_bytes:
        return config.ratio
    layer = cache.layers[0]
    pair = 2 * layer.k.shape[-1] * layer.k.dtype.itemsize
    return config.ratio * pair / (pair + BIAS_BYTES)


def compact(params, cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs,
            config: MatchingConfig = MatchingConfig(), probes: Probes | None = None):
    """The compacted cache of a cache holding [prefix | context] per row, and the kept keys per head [L, B, K]
    (all layers; uncompacted layers count their whole context). reread: kvzip.reread_inputs of the contexts (the
    repeat source, and where the context lies); probes: self-study turns (queries.Probes) for that source."""
    queries = reference_queries(params, cfg, cache, reread, config.sources, config.query_cap,
                                config.needs_kvzip_scores, probes)
    return compact_with(queries, cfg, cache, reread, config)


def compact_with(queries: ReferenceQueries, cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs,
                 config: MatchingConfig):
    """compact from reference queries already captured (one reference pass serves many ratios and methods)."""
    if any(not isinstance(layer, kv.LayerCache) or layer.keep is not None or layer.bias is not None
           for layer in cache.layers):
        raise scoring.CacheLayoutError("compact a full dense cache: this one is ragged, masked or compacted")
    if config.needs_kvzip_scores and queries.kvzip_scores is None:
        raise ValueError("these reference queries carry no KVzip scores (reference_queries(..., with_scores=True))")
    prefix_len, context_len = reread.prefix_len, reread.context_len
    n = reread.chunk_size * reread.tokens.shape[0]  # context columns
    layers = scoring.evictable_layers(cfg)
    full_counts = jnp.broadcast_to(context_len[None, :, None], (cfg.num_layers,) + cache.layers[0].lengths.shape)
    if config.ratio >= 1.0 or not layers:
        return cache, full_counts.astype(jnp.int32)
    ratio = effective_ratio(config, cache)
    size = static_count(ratio, n, config.budget, config.head_cap)  # static keys per head

    take = lambda x: scoring.slot_columns(x, prefix_len, n, axis=2)  # [B, K, C, H] -> [B, K, n, H]
    q = jnp.stack([queries.q[i] for i in layers])  # [L, B, K, R, H]
    k = jnp.stack([take(cache.layers[i].k) for i in layers])  # [L, B, K, n, H]
    v = jnp.stack([take(cache.layers[i].v) for i in layers])
    L, B, K, R, H = q.shape
    key_valid = jnp.broadcast_to((jnp.arange(n) < context_len[:, None])[None, :, None, :], (L, B, K, n))
    query_valid = jnp.broadcast_to(queries.valid[None, :, None, :], (L, B, K, R))
    heads = lambda x: x.reshape((L * B * K,) + x.shape[3:])  # [L, B, K, ...] -> [L B K, ...]
    scale = cfg.query_scale

    kvzip_rank = hak = None
    if config.needs_kvzip_scores:
        kvzip_rank = queries.kvzip_scores[jnp.asarray(layers)][..., :n]  # [L, B, K, n]
    if config.needs_attention_scores:
        hak = jax.lax.map(lambda a: attention_key_scores(a[0], a[1], scale, config.aggregate, a[2], a[3]),
                          (heads(q), heads(k), heads(key_valid), heads(query_valid))).reshape(L, B, K, n)
    rank = {"hak": hak, "kvzip": kvzip_rank}.get(config.selector)  # OMP ranks nothing: it selects greedily
    budget_rank = {"kvzip": kvzip_rank, "attention": hak}[config.budget_scores] if config.budget == "global" else None
    counts = head_counts(ratio, context_len, (L, B, K, n), config.budget, budget_rank, size)  # [L, B, K]
    lower, upper, iters = config.box()

    def fit_one(args):
        q_h, qv_h, k_h, v_h, kv_h, count, rank_h = args
        if config.selector == "omp":
            selected = orthogonal_matching_pursuit(q_h, k_h, scale, size, kv_h, query_valid=qv_h, limit=count,
                                                   per_step=config.omp_step, refit_every=config.omp_refit)
        else:
            _, selected = jax.lax.top_k(rank_h, size)
        active = (jnp.arange(size) < count) & kv_h[selected]  # [S]
        _, beta, c_v = fit_head(q_h, k_h, v_h, selected, scale, kv_h, query_valid=qv_h, active=active,
                                lower=lower, upper=upper, iters=iters)
        return selected.astype(jnp.int32), active, beta, c_v

    if size == 0:
        shape = (L * B * K, 0)
        selected, active = jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool)
        beta, c_v = jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (H,), jnp.float32)
    else:
        rank_heads = heads(rank) if rank is not None else jnp.zeros((L * B * K, n), jnp.float32)
        selected, active, beta, c_v = jax.lax.map(fit_one, (heads(q), heads(query_valid), heads(k), heads(v),
                                                            heads(key_valid), counts.reshape(-1), rank_heads))
    unflat = lambda x: x.reshape((L, B, K) + x.shape[1:])
    selected, active, beta, c_v = unflat(selected), unflat(active), unflat(beta), unflat(c_v)

    new_layers = list(cache.layers)
    for j, i in enumerate(layers):
        new_layers[i] = _compacted_layer(cache.layers[i], prefix_len, context_len, selected[j], active[j], beta[j],
                                         c_v[j])
    all_counts = full_counts.astype(jnp.int32).at[jnp.asarray(layers)].set(active.sum(-1, dtype=jnp.int32))
    return dataclasses.replace(cache, layers=tuple(new_layers)), all_counts


def _compacted_layer(layer: kv.LayerCache, prefix_len, context_len, selected, active, beta, c_v) -> kv.LayerCache:
    """The layer with its context slots masked but for the selected ones [B, K, S], which take the fitted values
    c_v [B, K, S, H] and the bias beta [B, K, S]."""
    B, K, C, _ = layer.k.shape
    slots = jnp.arange(C, dtype=jnp.int32)  # [C]
    in_context = (slots >= prefix_len[:, None]) & (slots < (prefix_len + context_len)[:, None])  # [B, C]
    target = jnp.where(active, prefix_len[:, None, None] + selected, C)  # [B, K, S]; inactive aim past the end
    batch, head = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
    keep = jnp.broadcast_to(~in_context[:, None, :], (B, K, C)).at[batch, head, target].set(True, mode="drop")
    values = layer.v.at[batch, head, target].set(c_v.astype(layer.v.dtype), mode="drop")
    bias = jnp.zeros((B, K, C), jnp.float32).at[batch, head, target].set(beta, mode="drop")
    return dataclasses.replace(layer, v=values, keep=keep, bias=bias)
