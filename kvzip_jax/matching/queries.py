"""Reference queries for Attention Matching: queries that stand in for the ones later questions will ask of a context
cache (reference/attention_matching.md §4).

Sources (SOURCES), each a teacher-forced pass whose post-RoPE queries are captured in every layer:
  repeat      KVzip's reread ("Repeat the previous context exactly." and the context) on top of the cache, chunk by
              chunk; the same pass can give KVzip's scores (with_scores), which the kvzip-am method and the global
              budgets use, so KVzip and Attention Matching share one pass.
  context     the context itself again, each chunk at its own positions on top of what precedes it (context-prefill).
  self-study  probes: turns the model itself wrote about the context (self_study.probes), teacher-forced on top of
              the cache, all in one pass (the cache's rows tiled once per probe).
Capture is capped: each pass keeps evenly spaced token rows (the same tokens in every layer and head, a
deterministic subsample), each with the G query heads of its KV head, so a KV head gets at most `cap` rows in all.
The fit then matches every captured query against all context keys (no causal mask, as in the reference code).
ReferenceQueries marks its self-study rows, so that one capture serves several counts of them
(MatchingConfig.self_study_queries thins them with `thinned`).

Einsum legend: B batch, T pass positions, R captured rows, K KV heads, G query heads per KV head, H head dim,
L layers, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring
from kvzip_jax.models.observer import AttentionView
from kvzip_jax.models.transformer import forward

SOURCES = ("repeat", "context", "self-study")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Probes:
    """Token sequences to teacher-force on top of a context cache (self-study turns): tokens [P, B, W] right-padded,
    num_valid [P, B]."""

    tokens: jax.Array
    num_valid: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReferenceQueries:
    """Captured queries: q per layer [B, K, R, H] float32 (unscaled, post-RoPE), valid [B, R] (False: padding rows,
    which weigh nothing), kvzip_scores [L, B, K, n] from the repeat pass, or None; self_study [R] bool: the rows of
    self-study probes (None: none marked)."""

    q: tuple[jax.Array, ...]
    valid: jax.Array
    kvzip_scores: jax.Array | None = None
    self_study: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryObserver:
    """Captures the queries of input rows `rows` [B, R] in every layer -> ([B, K, G, R, H], inner's output); inner:
    another observer run in the same pass (KVzip's RereadObserver), or None."""

    rows: jax.Array
    inner: scoring.RereadObserver | None = None

    def __call__(self, view: AttentionView):
        q = jnp.take_along_axis(view.q, self.rows[:, :, None, None, None], axis=1)  # [B, R, K, G, H]
        captured = q.astype(jnp.float32).transpose(0, 2, 3, 1, 4)  # [B, K, G, R, H]
        return captured, (None if self.inner is None else self.inner(view))

    @property
    def normaliser_subset(self):
        return None if self.inner is None else self.inner.normaliser_subset


def sample_rows(num_valid: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """(rows [B, count] int32, valid [B, count]): `count` evenly spaced rows among each row's num_valid [B] real
    ones (all of them, then padding, when there are fewer)."""
    j = jnp.arange(count, dtype=jnp.int32)[None, :]
    n = num_valid.astype(jnp.int32)[:, None]
    rows = jnp.where(n > count, (j * n) // count, j)
    return rows, j < jnp.minimum(n, count)


@dataclasses.dataclass(frozen=True)
class ReferencePass:
    """One teacher-forced pass of a source: tokens [copies B, W] at positions [copies B, W] (num_valid [copies B]
    real) on top of the cache (its rows tiled `copies` times: row c B + b reads row b), or of `before`
    (context-prefill: the cache rewound to the chunk's start); rows [copies B, R] captured (valid alike); scorer:
    KVzip's observer of a repeat chunk when its scores are wanted, else None."""

    source: str
    tokens: jax.Array
    positions: jax.Array
    num_valid: jax.Array
    rows: jax.Array
    valid: jax.Array
    scorer: scoring.RereadObserver | None = None
    before: kv.KVCache | None = None
    copies: int = 1

    def cache_under(self, cache):
        """The cache this pass reads (`before` if any), or one layer of it (on-policy passes have no `before`), its
        rows tiled `copies` times."""
        base = cache if self.before is None else self.before
        return base if self.copies == 1 else kv.tiled_rows(base, self.copies)

    def folded(self, captured: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(captured [B, K, G, copies R, H], valid [B, copies R]) from this pass's capture [copies B, K, G, R, H]:
        every copy's rows side by side, per context row."""
        n, K, G, R, H = captured.shape
        B, c = n // self.copies, self.copies
        q = captured.reshape(c, B, K, G, R, H).transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, c * R, H)
        return q, self.valid.reshape(c, B, R).transpose(1, 0, 2).reshape(B, c * R)


def reference_passes(
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: scoring.RereadInputs | None,
    sources: tuple[str, ...],
    cap: int,
    probes: Probes | None = None,
    with_scores: bool = False,
) -> list[ReferencePass]:
    """The passes of the sources, at most `cap` captured rows per KV head and layer in all (split evenly over the
    sources and their passes); with_scores: repeat passes carry KVzip's scorer. reread: None with self-study only.
    An MLA model's queries are the absorbed ones (its one KV head's N query heads, width latent + RoPE)."""
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown or not sources:
        raise ValueError(f"sources must be among {SOURCES}, got {sources}")
    if reread is None and {"repeat", "context"} & set(sources):
        raise ValueError("the repeat and context sources read the context: give its reread inputs")
    if with_scores and "repeat" not in sources:
        raise ValueError("KVzip's scores come from the repeat pass: add 'repeat' to the sources")
    if "self-study" in sources and probes is None:
        raise ValueError("the self-study source needs probes (matching.self_study.probes)")
    per_source = max(cap // (cfg.group_size * len(sources)), 1)  # token rows per source
    chunks = 0 if reread is None else reread.tokens.shape[0]

    def on_top(source, tokens, num_valid, count, scorer=None, positions=None, before=None, copies=1):
        rows, valid = sample_rows(num_valid, min(count, tokens.shape[1]))
        if positions is None:
            positions = jnp.tile(scoring.after_cache(cache, tokens.shape[1]), (copies, 1))
        return ReferencePass(source, tokens, positions, num_valid, rows, valid, scorer, before, copies)

    passes = []
    if "repeat" in sources:
        for t in range(chunks):
            scorer = scoring.chunk_observer(cfg, reread, t) if with_scores else None
            passes.append(on_top("repeat", reread.tokens[t], reread.num_valid[t], -(-per_source // chunks), scorer))
    if "context" in sources:
        for t in range(chunks):  # chunk t on top of [prefix | chunks before t], at its own positions
            start = reread.chunk_start[t]  # [B]
            before = kv.rewind(
                cache,
                kv.CacheMark(
                    tuple(jnp.broadcast_to(start[:, None], layer.lengths.shape) for layer in cache.layers), start
                ),
            )
            positions = start[:, None] + jnp.arange(reread.chunk_size, dtype=jnp.int32)
            passes.append(
                on_top(
                    "context",
                    _context_chunk(reread, t),
                    reread.chunk_len[t],
                    -(-per_source // chunks),
                    positions=positions,
                    before=before,
                )
            )
    if "self-study" in sources:  # one pass: probe p on row p B + b of the tiled cache
        count, B, W = probes.tokens.shape
        passes.append(
            on_top(
                "self-study",
                probes.tokens.reshape(count * B, W),
                probes.num_valid.reshape(count * B),
                -(-per_source // count),
                copies=count,
            )
        )
    return passes


def stack_rows(passes, G: int):
    """Per-pass captures [(per layer [B, K, G, R_i, H], valid [B, R_i])] (ReferencePass.folded) -> (per layer
    [B, K, G R, H], valid [B, G R]) with R = sum R_i; row g R + r is query head g of captured row r."""
    layers = tuple(jnp.concatenate(per_layer, axis=3) for per_layer in zip(*(q for q, _ in passes)))
    valid = jnp.concatenate([v for _, v in passes], axis=1)  # [B, R]
    B, K, _, R, H = layers[0].shape
    return tuple(x.reshape(B, K, G * R, H) for x in layers), jnp.tile(valid, (1, G))


def _context_chunk(reread: scoring.RereadInputs, t: int) -> jax.Array:
    """[B, m] the context tokens of reread chunk t (they close its reread input), right-padded."""
    m = reread.chunk_size
    start = reread.num_valid[t] - reread.chunk_len[t]  # [B]
    index = jnp.clip(start[:, None] + jnp.arange(m), 0, reread.tokens.shape[2] - 1)  # [B, m]
    return jnp.take_along_axis(reread.tokens[t], index, axis=1)


def self_study_rows(passes: list[ReferencePass], G: int) -> jax.Array:
    """[G R] bool: the rows of stack_rows(passes' captures) that come from self-study probes."""
    per_pass = [jnp.full((p.copies * p.rows.shape[1],), p.source == "self-study") for p in passes]
    return jnp.tile(jnp.concatenate(per_pass), G)


def thinned(queries: ReferenceQueries, count: int) -> ReferenceQueries:
    """The queries with at most `count` self-study rows valid per batch row (per KV head and layer), evenly spaced
    among the valid ones; the other sources' rows as they were. Unmarked queries (self_study None) are returned."""
    if queries.self_study is None:
        return queries
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    studied = queries.self_study[None, :] & queries.valid  # [B, R]
    rank = jnp.cumsum(studied, axis=1) - 1  # [B, R] index among the row's valid self-study rows
    total = jnp.maximum(studied.sum(axis=1, keepdims=True), 1)  # [B, 1]
    chosen = (rank + 1) * count // total > rank * count // total  # min(count, total) rows, evenly spaced
    return dataclasses.replace(queries, valid=queries.valid & (~studied | chosen))


def reference_queries(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: scoring.RereadInputs | None,
    sources: tuple[str, ...] = ("repeat",),
    cap: int = 8192,
    with_scores: bool = False,
    probes: Probes | None = None,
) -> ReferenceQueries:
    """The reference queries of a cache, at most `cap` rows per KV head and layer, split evenly over the sources and
    their passes. with_scores: KVzip's scores [L, B, K, n] from the repeat pass (needs "repeat"). The repeat and
    context sources read the cache as [prefix | context] per row (scoring.check_context_cache); self-study probes go
    on top of whatever it holds (online compaction: [prefix | segment | recent tokens]; reread None when self-study
    is the only source). The cache is left unchanged.
    """
    passes = reference_passes(cfg, cache, reread, sources, cap, probes, with_scores)
    if {"repeat", "context"} & set(sources):
        scoring.check_context_cache(cache, reread.prefix_len, reread.context_len)
    captured, per_chunk = [], []
    for p in passes:
        _, _, aux = forward(
            params,
            p.tokens,
            p.positions,
            p.cache_under(cache),
            cfg,
            QueryObserver(p.rows, p.scorer),
            num_new=p.num_valid,
            logits=None,
        )
        folded = [p.folded(q) for q, _ in aux["observed"]]
        captured.append((tuple(q for q, _ in folded), folded[0][1]))
        if p.scorer is not None:
            per_chunk.append(jnp.stack([x for _, x in aux["observed"]]))  # [L, B, K, m]
    scores = None
    if with_scores:
        scores = scoring.in_context_scores(jnp.concatenate(per_chunk, axis=-1), reread.context_len)
    q, valid = stack_rows(captured, cfg.group_size)
    return ReferenceQueries(q=q, valid=valid, kvzip_scores=scores, self_study=self_study_rows(passes, cfg.group_size))
