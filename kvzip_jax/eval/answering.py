"""Batched answers from one cache: greedy decoding and teacher-forced next-token logits, cache left as it was.

One question per row: suffix rows [question | answer header] are appended after each row's context, answered, and
dropped again (mark and rewind), so a cache serves any number of questions. `answer_forced` also forwards a given
answer after the suffix in the same pass, which yields both the teacher-forced logits over that answer and the
state to decode from (the cache rewound to just after the suffix).

Einsum legend: B batch, T appended tokens, A answer tokens, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.sharding.mesh import to_host

SEGMENT = 8  # decoding steps between regathers of the rows still decoding


@dataclasses.dataclass(frozen=True)
class Answers:
    """tokens: the greedy answer of each row (stop token included); logits [B, A, V]: teacher-forced next-token
    logits over the forced answer (None when none was forced); valid [B, A] bool marks real answer positions."""

    tokens: list[list[int]]
    logits: jax.Array | None = None
    valid: np.ndarray | None = None


def pad_rows(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [B, W] block (W the longest row rounded up to 16) and the row lengths [B]."""
    lengths = np.array([len(r) for r in rows], np.int32)
    block = np.zeros((len(rows), -(-int(lengths.max()) // 16) * 16), np.int32)
    for b, row in enumerate(rows):
        block[b, : len(row)] = row
    return block, lengths


def _advanced(to: kv.CacheMark, count: np.ndarray) -> kv.CacheMark:
    """The mark `count` [B] tokens after `to` (valid once those tokens are written)."""
    count = jnp.asarray(count, jnp.int32)
    return dataclasses.replace(
        to, lengths=tuple(lengths + count[:, None] for lengths in to.lengths), next_position=to.next_position + count
    )


def answer(
    params, cfg, cache: kv.KVCache, suffixes: list[np.ndarray], max_new_tokens: int, stop_tokens
) -> tuple[Answers, kv.KVCache]:
    """Greedy answers to one suffix per row. Returns (answers, the cache as it was). The cache is donated."""
    before = kv.mark(cache)
    logits, cache = gen.prefill(params, cfg, suffixes, cache)
    _, tokens, cache = _decode_rows(params, cfg, logits, cache, np.full(len(suffixes), max_new_tokens), stop_tokens)
    return Answers(tokens), kv.rewind(cache, before)


def answer_forced(
    params,
    cfg,
    cache: kv.KVCache,
    suffixes: list[np.ndarray],
    forced: list[list[int]],
    max_new_tokens: int,
    stop_tokens,
) -> tuple[Answers, kv.KVCache]:
    """Teacher-forced logits over `forced` answers (one per row, e.g. the full cache's greedy answers) and this
    cache's own greedy answers, from one forward of [suffix | forced
    answer] per row (max_new_tokens 0: logits only). Returns (answers, the cache as it was). Donates the cache.

    Greedy decoding follows the forced answer for as long as the forced logits' argmax agrees with it; so a row's
    greedy answer is the forced answer up to the first disagreement, and only from there on is it decoded. Rows
    that follow the forced answer through a stop token (or for max_new_tokens tokens) are not decoded.
    """
    before = kv.mark(cache)
    suffix_len = np.array([len(s) for s in suffixes], np.int32)  # [B]
    answer_len = np.array([len(a) for a in forced], np.int32)  # [B]
    if np.any(answer_len < 1):
        raise ValueError("every forced answer needs at least one token")
    block, lengths = pad_rows([np.concatenate([s, np.asarray(a, np.int32)]) for s, a in zip(suffixes, forced)])
    if np.any(lengths > to_host(cache.room())):
        raise ValueError("question and answer exceed the cache's room")
    # Position suffix_len - 1 + a predicts answer token a; a = answer_len predicts what follows the forced answer.
    # The LM head runs only there (A + 1 rounded up to a multiple of 8, so new answer lengths rarely recompile).
    A = int(answer_len.max())
    at = suffix_len[:, None] - 1 + np.arange(-(-(A + 1) // 8) * 8)[None, :]  # [B, P >= A + 1]
    at = np.minimum(at, block.shape[1] - 1).astype(np.int32)
    logits, cache = gen.forward_step(
        params, jnp.asarray(block), jnp.asarray(lengths), cache, cfg, logits="at", at=jnp.asarray(at)
    )
    next_logits = logits[:, : A + 1]  # [B, A + 1, V]
    forced_logits = next_logits[:, :A]  # [B, A, V]
    valid = np.arange(A)[None, :] < answer_len[:, None]  # [B, A]
    if max_new_tokens == 0:
        return Answers([[] for _ in suffixes], forced_logits, valid), kv.rewind(cache, before)

    forced_ids = np.full((len(forced), A), -1, np.int32)  # [B, A]
    for b, a in enumerate(forced):
        forced_ids[b, : len(a)] = a
    differs = (to_host(jnp.argmax(forced_logits, axis=-1)) != forced_ids) & valid  # [B, A]
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), answer_len)  # [B] first disagreement
    # Tokens through each forced answer's first stop token (answer_len + 1 when it has none).
    through_stop = np.array([next((i + 1 for i, t in enumerate(a) if t in stop_tokens), len(a) + 1) for a in forced])
    stopped = through_stop <= first  # greedy follows the forced answer through its stop token, and ends there
    first = np.minimum(np.where(stopped, through_stop, first), max_new_tokens)
    finished = stopped | (first == max_new_tokens)  # greedy = forced[:first]
    tokens = [list(a[:f]) for a, f in zip(forced, first)]
    if not finished.all():
        # Unfinished rows resume after forced[:first] (the logits there pick the next token).
        resume = np.where(finished, answer_len, first)  # [B]
        start = jnp.take_along_axis(next_logits, jnp.asarray(resume)[:, None, None], axis=1)[:, 0]  # [B, V]
        cache = kv.rewind(cache, _advanced(before, suffix_len + resume))
        budget = np.where(finished, 0, max_new_tokens - first)  # [B] tokens left to decode per row
        rows, rest, cache = _decode_rows(params, cfg, start, cache, budget, stop_tokens)
        for b, r in zip(rows, rest):
            tokens[b] = tokens[b] + r
    return Answers(tokens, forced_logits, valid), kv.rewind(cache, before)


def _decode_rows(params, cfg, start, cache: kv.KVCache, budget: np.ndarray, stop_tokens):
    """Greedy decoding of the rows with budget [B] > 0 (their token limits) from logits start [B, V].
    -> (their indices, their tokens, the cache: donated, returned with every row at least as long as it came).

    A step costs what the batch costs, so decoding goes in segments of SEGMENT steps, and before each segment the
    rows still decoding are gathered into a copy of the cache sized to the next power of two (padded with a
    repeat) whenever that is smaller than the batch at hand. The other rows of a batch are handed a stop token,
    so a segment ends as soon as its live rows do."""
    rows = [int(b) for b in np.flatnonzero(budget > 0)]
    tokens = {b: [] for b in rows}
    done = set()  # rows that emitted a stop token, reached their budget or found the cache full
    where = {b: b for b in rows}  # row -> its index in the batch being decoded
    work, logits, in_place = cache, start, True
    while len(done) < len(rows):
        live = [b for b in rows if b not in done]
        size = gen.bucket(len(live), 1)
        if size < logits.shape[0]:
            pick = np.array([where[b] for b in live] + [where[live[0]]] * (size - len(live)))
            work = jax.tree.map(lambda x: jnp.take(x, jnp.asarray(pick), axis=0), work)  # a copy: safe to donate
            logits, where, in_place = logits[pick], {b: i for i, b in enumerate(live)}, False
        elif len(live) < logits.shape[0] and stop_tokens:
            decoding = np.zeros(logits.shape[0], bool)
            decoding[[where[b] for b in live]] = True
            stop = jax.nn.one_hot(stop_tokens[0], logits.shape[-1]) * 1e9
            logits = jnp.where(jnp.asarray(decoding)[:, None], logits, stop)
        steps = min(SEGMENT, max(int(budget[b]) - len(tokens[b]) for b in live))
        out, work, logits = gen.decode(params, cfg, logits, work, steps, stop_tokens=stop_tokens, return_logits=True)
        if in_place:
            cache = work
        for b in live:
            new = out[where[b]][: int(budget[b]) - len(tokens[b])]
            tokens[b] += new
            if len(tokens[b]) == budget[b] or (new and new[-1] in stop_tokens) or len(new) < steps:
                done.add(b)
    return np.array(rows, np.int64), [tokens[b] for b in rows], cache


def copy_cache(cache: kv.KVCache) -> kv.KVCache:
    """A copy safe to donate (masked caches share their key/value arrays with the cache they mask)."""
    return jax.tree.map(jnp.copy, cache)
