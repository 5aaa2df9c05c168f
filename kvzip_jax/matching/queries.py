"""Reference queries for Attention Matching: queries that stand in for the ones later questions will ask of a context
cache (reference/attention_matching.md §4).

Sources (SOURCES), each a teacher-forced pass whose post-RoPE queries are captured in every layer:
  repeat      KVzip's reread ("Repeat the previous context exactly." and the context) on top of the cache, chunk by
              chunk; the same pass can give KVzip's scores (with_scores), which the kvzip-am method and the global
              budgets use, so KVzip and Attention Matching share one pass.
  context     the context itself again, each chunk at its own positions on top of what precedes it (context-prefill).
  self-study  probes: turns the model itself wrote about the context (self_study.probes), teacher-forced on top of
              the cache.
Capture is capped: each pass keeps evenly spaced token rows (the same tokens in every layer and head, a
deterministic subsample), each with the G query heads of its KV head, so a KV head gets at most `cap` rows in all.
The fit then matches every captured query against all context keys (no causal mask, as in the reference code).

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
from kvzip_jax.models.attention import AttentionView
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
    which weigh nothing), kvzip_scores [L, B, K, n] from the repeat pass, or None."""

    q: tuple[jax.Array, ...]
    valid: jax.Array
    kvzip_scores: jax.Array | None = None


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
    """One teacher-forced pass of a source: tokens [B, W] at positions [B, W] (num_valid [B] real) on top of the
    cache, or of `before` (context-prefill: the cache rewound to the chunk's start); rows [B, R] captured (valid
    [B, R]); scorer: KVzip's observer of a repeat chunk when its scores are wanted, else None."""

    tokens: jax.Array
    positions: jax.Array
    num_valid: jax.Array
    rows: jax.Array
    valid: jax.Array
    scorer: scoring.RereadObserver | None = None
    before: kv.KVCache | None = None


def reference_passes(cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs | None,
                     sources: tuple[str, ...], cap: int, probes: Probes | None = None,
                     with_scores: bool = False) -> list[ReferencePass]:
    """The passes of the sources, at most `cap` captured rows per KV head and layer in all (split evenly over the
    sources and their passes); with_scores: repeat passes carry KVzip's scorer. reread: None with self-study only."""
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

    def on_top(tokens, num_valid, count, scorer=None, positions=None, before=None):
        rows, valid = sample_rows(num_valid, min(count, tokens.shape[1]))
        if positions is None:
            positions = scoring.after_cache(cache, tokens.shape[1])
        return ReferencePass(tokens, positions, num_valid, rows, valid, scorer, before)

    passes = []
    if "repeat" in sources:
        for t in range(chunks):
            scorer = scoring.chunk_observer(cfg, reread, t) if with_scores else None
            passes.append(on_top(reread.tokens[t], reread.num_valid[t], -(-per_source // chunks), scorer))
    if "context" in sources:
        for t in range(chunks):  # chunk t on top of [prefix | chunks before t], at its own positions
            start = reread.chunk_start[t]  # [B]
            before = kv.rewind(cache, kv.CacheMark(tuple(jnp.broadcast_to(start[:, None], layer.lengths.shape)
                                                         for layer in cache.layers), start))
            positions = start[:, None] + jnp.arange(reread.chunk_size, dtype=jnp.int32)
            passes.append(on_top(_context_chunk(reread, t), reread.chunk_len[t], -(-per_source // chunks),
                                 positions=positions, before=before))
    if "self-study" in sources:
        count = probes.tokens.shape[0]
        for p in range(count):
            passes.append(on_top(probes.tokens[p], probes.num_valid[p], -(-per_source // count)))
    return passes


def stack_rows(passes, G: int):
    """Per-pass captures [(per layer [B, K, G, R_i, H], valid [B, R_i])] -> (per layer [B, K, G R, H], valid [B, G R])
    with R = sum R_i."""
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


def reference_queries(params, cfg: ModelConfig, cache: kv.KVCache, reread: scoring.RereadInputs | None,
                      sources: tuple[str, ...] = ("repeat",), cap: int = 8192, with_scores: bool = False,
                      probes: Probes | None = None) -> ReferenceQueries:
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
        _, _, aux = forward(params, p.tokens, p.positions, cache if p.before is None else p.before, cfg,
                            QueryObserver(p.rows, p.scorer), num_new=p.num_valid, logits=None)
        captured.append((tuple(q for q, _ in aux["observed"]), p.valid))
        if p.scorer is not None:
            per_chunk.append(jnp.stack([x for _, x in aux["observed"]]))  # [L, B, K, m]
    scores = None
    if with_scores:
        scores = scoring.in_context_scores(jnp.concatenate(per_chunk, axis=-1), reread.context_len)
    q, valid = stack_rows(captured, cfg.group_size)
    return ReferenceQueries(q=q, valid=valid, kvzip_scores=scores)
