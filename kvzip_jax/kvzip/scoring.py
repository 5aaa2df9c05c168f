"""KVzip reconstruction scoring: the model rereads its context on top of its own cache; every cached context pair
is scored by the largest attention it receives during that reread.

For each chunk of m context tokens the reread input is [reread prompt | anchor | answer header | chunk], forwarded
teacher-forced on top of the full cache (which the scoring leaves unchanged). In every layer the post-RoPE queries
of the reread attend, for scoring, to [prefix (system prompt) | this chunk's cached keys | the reread's own keys,
causal]; the softmax is float32 with the model's attention scale; a pair's score is the max over all reread
positions and over the G query heads of its KV head. Result: scores [L, B, K, n] for n context tokens.

Einsum legend: B batch, T reread positions, S cache slots, K KV heads, G query heads per KV head, H head dim,
D model width, L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax.config import FULL, ModelConfig
from kvzip_jax.errors import KvzipError
from kvzip_jax.models.attention import MASK_VALUE
from kvzip_jax.models.observer import AttentionView, map_key_blocks, take_keys
from kvzip_jax.models.transformer import forward
from pallas_kernels import resolve_impl, score_max
from pallas_kernels.dispatch import supports_head_dim

DEFAULT_CHUNK = 2048  # reread chunk: the KVzip paper's "2K" (its code uses 2,000; kvpress KVzipPress 2,048)
ANCHOR_TOKENS = 8  # KVzip code (prev_postfix_size=8): the previous chunk's last 8 tokens open the next reread
VARIANTS = ("softmax", "logits")


def _static(default):
    return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RereadObserver:
    """Scores one chunk's cached pairs in every layer (an observer for the forward's attention hook).

    Arrays are per batch row [B] and count cache slots. Returns per layer [B, K, width] scores of the slots
    [chunk_start, chunk_start + width); columns past chunk_len are meaningless.

    Nothing of size [reread x keys] is materialised: a pair's score max_t exp(s_t - lse_t) is reduced block by
    block from the logits s of the chunk's keys and the log-normaliser lse_t of each reread row over the scoring key
    set [prefix | chunk | reread], which the forward's own attention accumulates alongside its full normaliser
    (normaliser_subset), so the only extra work is q.k over the chunk's keys once more.
    """

    prefix_len: jax.Array  # slots [0, prefix_len) hold the never-evicted prefix
    chunk_start: jax.Array
    chunk_len: jax.Array
    num_valid: jax.Array  # real reread tokens; the rest is padding, excluded from the max
    width: int = _static(DEFAULT_CHUNK)
    variant: str = _static("softmax")
    kvzip_plus: bool = _static(False)
    scored_layers: tuple[int, ...] | None = _static(None)  # None: all; others get zeros (never evicted)
    whole_cache: bool = _static(False)  # one chunk: the cache holds only [prefix | this chunk]
    impl: str = _static("auto")  # the max-over-rows reduction: pallas_kernels.score_max or XLA key blocks

    def __call__(self, view: AttentionView) -> jax.Array:
        B, T, K, G, H = view.q.shape
        m = self.width
        if self.scored_layers is not None and view.layer not in self.scored_layers:
            return jnp.zeros((B, K, m), jnp.float32)
        qm = (view.q.astype(jnp.float32) * view.scale).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
        real_row = (jnp.arange(T) < self.num_valid[:, None])[:, None, None, :]  # [B, 1, 1, T]
        query_norm = jnp.linalg.norm(view.hidden.astype(jnp.float32), axis=-1)[:, None, None, :]  # [B, 1, 1, T]
        query_norm = jnp.where(real_row, query_norm, 1.0)  # padding rows are masked below; never divide by 0
        # One offset b_t per row: max_t exp(s_t - lse_t) / |h_t| = exp(max_t (s_t + b_t)) with b_t = -lse_t - log |h_t|,
        # the max over reread rows before exp, so exp runs once per key; padding rows get b_t = MASK_VALUE and never
        # win the max.
        bias = jnp.zeros((B, K, G, T), jnp.float32)
        if self.variant == "softmax":
            bias = -(view.lse if self.whole_cache else view.subset_lse)  # over [prefix | chunk | reread]
            if self.kvzip_plus:
                bias = bias - jnp.log(query_norm)
        elif self.kvzip_plus:
            qm = qm / query_norm[..., None]
        bias = jnp.where(real_row, bias, MASK_VALUE)
        if not self.kvzip_plus and resolve_impl(self.impl) == "pallas" and supports_head_dim(H):
            dtype = view.k.dtype  # products in the cache's dtype (bf16 on the matrix units), accumulated in float32
            chunk_k = slot_columns(view.k, self.chunk_start, m, axis=2)  # [B, K, m, H]
            return score_max(
                qm.reshape(B, K, G * T, H).astype(dtype),
                chunk_k.astype(dtype),
                bias.reshape(B, K, G * T),
                exp=self.variant == "softmax",
                impl=self.impl,
            )  # [B, K, m]
        o_proj = view.o_proj.reshape(K, G, -1, view.o_proj.shape[-1]).astype(jnp.float32)  # [K, G, Hv, D]

        def block_scores(kb, vb):  # keys, values [B, K, S, H] -> [B, K, S]
            stat = jnp.einsum("BKGTH,BKSH->BKGTS", qm, kb) + bias[..., None]  # logits + row offsets
            if not self.kvzip_plus:
                stat = stat.max(axis=(2, 3))  # [B, K, S]
                return jnp.exp(stat) if self.variant == "softmax" else stat
            stat = stat.max(axis=3)  # [B, K, G, S]
            if self.variant == "softmax":
                stat = jnp.exp(stat)  # attention weights over the scoring key set, / |h|
            # |W_O v| >= 0 scales after the max over rows.
            stat = stat * jnp.linalg.norm(jnp.einsum("BKSV,KGVD->BKGSD", vb, o_proj), axis=-1)  # [B, K, G, S]
            return stat.max(axis=2)

        def block(start, size):  # [B, K, size] scores of the chunk's keys [start, start + size)
            kb, vb = (
                slot_columns(x, self.chunk_start + start, size, axis=2).astype(jnp.float32) for x in (view.k, view.v)
            )
            return block_scores(kb, vb)

        return map_key_blocks(block, m)  # [B, K, m]

    @property
    def normaliser_subset(self):
        """The cache slots of the scoring key set, [prefix | this chunk], as a function of slots [B, K, S] -> bool
        (the reread's own keys are in it too); None when that is the whole cache (one chunk). The forward's
        attention returns each reread row's softmax normaliser over this subset, from the logits it computes
        anyway."""
        if self.whole_cache:
            return None
        start, end = self.chunk_start[:, None, None], (self.chunk_start + self.chunk_len)[:, None, None]
        return lambda slots: (slots < self.prefix_len[:, None, None]) | ((slots >= start) & (slots < end))


def slot_columns(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    """x [B, ...] restricted along `axis` to [start, start + size) per row (start [B]); indices past the end are
    clipped (those columns lie past the chunk and are never used)."""
    return jax.vmap(lambda row, row_start: take_keys(row, row_start, size, axis - 1))(x, start)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContextSpan:
    """Where each row's context lies in its cache: slots [prefix_len, prefix_len + context_len), read as `width`
    columns from prefix_len (static; columns past a row's context_len are padding)."""

    prefix_len: jax.Array  # [B]
    context_len: jax.Array  # [B]
    width: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RereadInputs:
    """The reread inputs of every chunk, built on the host by `reread_inputs`. Arrays [C, B, ...] for C chunks."""

    tokens: jax.Array  # [C, B, W] int32, right-padded
    num_valid: jax.Array  # [C, B]
    chunk_start: jax.Array  # [C, B] cache slot of the chunk's first token
    chunk_len: jax.Array  # [C, B]
    prefix_len: jax.Array  # [B]
    context_len: jax.Array  # [B]
    chunk_size: int = _static(DEFAULT_CHUNK)

    @property
    def span(self) -> ContextSpan:
        """Where the contexts lie, as wide as every chunk together (C m columns)."""
        return ContextSpan(self.prefix_len, self.context_len, self.chunk_size * self.tokens.shape[0])


def reread_inputs(
    tokenizer, prefix_len, context_tokens, chunk_size: int = DEFAULT_CHUNK, system: str | None = None
) -> RereadInputs:
    """Reread inputs for rows whose caches hold [prefix | context]: prefix_len [B] ints, context_tokens B sequences.

    Chunk t of a row is context tokens [t m, (t + 1) m); its reread input is the reread prompt (with the previous
    chunk's last 8 tokens as anchor from the second chunk on), the answer header, then the chunk itself.
    """
    from kvzip_jax import prompts

    rows = [np.asarray(c, np.int32) for c in context_tokens]
    num_chunks = max(-(-len(r) // chunk_size) for r in rows)
    if num_chunks == 1:  # one chunk: as wide as the longest context, bucketed
        chunk_size = min(chunk_size, -(-max(len(r) for r in rows) // 64) * 64)
    inputs = [[None] * len(rows) for _ in range(num_chunks)]
    for b, row in enumerate(rows):
        for t in range(num_chunks):
            chunk = row[t * chunk_size : (t + 1) * chunk_size]
            anchor = row[max(t * chunk_size - ANCHOR_TOKENS, 0) : t * chunk_size]
            inputs[t][b] = np.concatenate([prompts.reread_suffix(tokenizer, anchor, system), chunk])
    width = max(len(x) for chunk in inputs for x in chunk)
    width = -(-width // 64) * 64  # bucketed so nearby lengths share a compilation
    tokens = np.zeros((num_chunks, len(rows), width), np.int32)
    num_valid = np.zeros((num_chunks, len(rows)), np.int32)
    for t, chunk in enumerate(inputs):
        for b, x in enumerate(chunk):
            tokens[t, b, : len(x)] = x
            num_valid[t, b] = len(x)
    prefix = np.asarray(prefix_len, np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    starts = np.arange(num_chunks, dtype=np.int32)[:, None] * chunk_size
    return RereadInputs(
        tokens=jnp.asarray(tokens),
        num_valid=jnp.asarray(num_valid),
        chunk_start=jnp.asarray(prefix[None, :] + starts),
        chunk_len=jnp.asarray(np.clip(lengths[None, :] - starts, 0, chunk_size)),
        prefix_len=jnp.asarray(prefix),
        context_len=jnp.asarray(lengths),
        chunk_size=chunk_size,
    )


class CacheLayoutError(KvzipError, ValueError):
    """A cache to score does not hold exactly [prefix | context] in a row (a question or answer is still in it)."""


def check_context_cache(cache: kv.KVCache, prefix_len, context_len) -> None:
    """Raises CacheLayoutError unless every row of the cache holds exactly prefix_len + context_len [B] tokens in
    every layer and head, and continues at that position.

    Scoring needs it: the reread continues at the cache's next position, and with one chunk the forward's own
    normaliser (over everything the cache holds) stands for the one over [prefix | context | reread]. Under jit the
    same check runs on the host as a callback (the error then arrives wrapped in a JaxRuntimeError).
    """
    lengths, position = cache.lengths(), cache.next_position  # [L, B, K], [B]
    expected = jnp.asarray(prefix_len, jnp.int32) + jnp.asarray(context_len, jnp.int32)  # [B]
    if any(isinstance(x, jax.core.Tracer) for x in (lengths, position, expected)):
        if _HOST_CALLBACKS[-1]:
            jax.debug.callback(_raise_unless_context_only, lengths, position, expected)
    else:
        _raise_unless_context_only(lengths, position, expected)


def _raise_unless_context_only(lengths, position, expected) -> None:
    lengths, position, expected = np.asarray(lengths), np.asarray(position), np.asarray(expected)
    held = lengths.max(axis=(0, 2))  # [B]
    bad = np.flatnonzero((lengths != expected[None, :, None]).any(axis=(0, 2)) | (position != expected))
    if bad.size:
        b = int(bad[0])
        raise CacheLayoutError(
            f"row {b} of the cache holds {int(held[b])} tokens (next position {int(position[b])}), but the reread "
            f"inputs describe [prefix | context] = {int(expected[b])} tokens: KVzip scores a cache that holds its "
            f"context and nothing after it (rewind a question or answer first: cache.mark before, cache.rewind after)"
        )


def evictable_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Layers KVzip scores and evicts: the full-attention ones (Gemma 3's sliding layers keep their window)."""
    return tuple(i for i, kind in enumerate(cfg.layer_types) if kind == FULL)


def score(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    reread: RereadInputs,
    variant: str = "softmax",
    kvzip_plus: bool = False,
) -> jax.Array:
    """KVzip scores [L, B, K, C m] of the context pairs (context offset i is cache slot prefix_len + i).
    Layers outside evictable_layers(cfg) are not scored (zeros).

    The cache must hold exactly [prefix | context] per row (check_context_cache: CacheLayoutError otherwise). It is
    neither modified nor copied: the reread attends to it and to its own keys, and its writes are dropped. Columns
    past a row's context length are -inf.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    check_context_cache(cache, reread.prefix_len, reread.context_len)
    C, B, W = reread.tokens.shape

    def chunk_scores(t):  # [L, B, K, m] scores of chunk t's pairs
        observer = chunk_observer(cfg, reread, t, variant, kvzip_plus)
        _, _, aux = forward(
            params,
            reread.tokens[t],
            after_cache(cache, W),
            cache,
            cfg,
            observer,
            num_new=reread.num_valid[t],
            logits=None,
        )
        scores = jnp.stack(aux["observed"])
        if _HOST_CALLBACKS[-1]:
            jax.debug.callback(_report_chunk, t + 1, C, scores[0, 0, 0, 0])  # once computed
        return scores

    # One traced chunk forward whatever the number of chunks: compilation does not grow with the context.
    per_chunk = chunk_scores(0)[None] if C == 1 else jax.lax.map(chunk_scores, jnp.arange(C))  # [C, L, B, K, m]
    L, _, K, m = per_chunk.shape[1:]
    scores = per_chunk.transpose(1, 2, 3, 0, 4).reshape(L, B, K, C * m)
    return in_context_scores(scores, reread.context_len)  # [L, B, K, C m]


_PROGRESS: list[Callable[[int, int], None]] = []  # chunk_progress listeners
_HOST_CALLBACKS = [True]  # the innermost without_host_callbacks block sets False


@contextlib.contextmanager
def without_host_callbacks():
    """Traced within the block, `score` and `check_context_cache` add no host callback (no chunk progress, no layout
    check under jit): a program jax.export can serialize. Trace a fresh jit inside the block (jit reuses a trace)."""
    _HOST_CALLBACKS.append(False)
    try:
        yield
    finally:
        _HOST_CALLBACKS.pop()


@contextlib.contextmanager
def chunk_progress(callback: Callable[[int, int], None]):
    """Within the block, callback(done, total) runs on the host as each reread chunk of `score` is computed, jitted
    or not (a progress bar; chunks may finish out of order, so `done` can repeat or go back)."""
    _PROGRESS.append(callback)
    try:
        yield
    finally:
        _PROGRESS.remove(callback)


def _report_chunk(done, total, _) -> None:
    for callback in tuple(_PROGRESS):
        callback(int(done), int(total))


def chunk_observer(
    cfg: ModelConfig, reread: RereadInputs, t: int, variant: str = "softmax", kvzip_plus: bool = False
) -> RereadObserver:
    """The observer that scores chunk t's context pairs during its reread (score runs it over every chunk)."""
    return RereadObserver(
        prefix_len=reread.prefix_len,
        chunk_start=reread.chunk_start[t],
        chunk_len=reread.chunk_len[t],
        num_valid=reread.num_valid[t],
        width=reread.chunk_size,
        variant=variant,
        kvzip_plus=kvzip_plus,
        scored_layers=evictable_layers(cfg),
        whole_cache=reread.tokens.shape[0] == 1,
        impl=cfg.attention_impl,
    )


def after_cache(cache: kv.KVCache, width: int) -> jax.Array:
    """[B, width] positions of `width` tokens appended after the cache (the reread continues the context)."""
    return cache.next_position[:, None] + jnp.arange(width, dtype=jnp.int32)


def in_context_scores(scores: jax.Array, context_len: jax.Array) -> jax.Array:
    """scores [L, B, K, n] with columns past each row's context_len [B] set to -inf."""
    in_context = jnp.arange(scores.shape[-1]) < context_len[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], scores, -jnp.inf)
