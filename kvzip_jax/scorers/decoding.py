"""Compression while decoding (Fast KVzip's decoding rule): a long generation whose cache is cut back to a budget
every `interval` generated tokens, by a trained scorer, so it never outgrows a fixed physical cache.

    tokens, cache, cuts = decoding.generate(params, cfg, prompt, 4096, scorer=gate, budget=1024)

The prompt is prefilled with the scorer on every layer (generate.prefill_observed). Then, block after block, up to
`interval` tokens are decoded; the block's tokens are fed again as one teacher-forced chunk with the scorer (the
buffered hidden states of the block: the same keys and values, and their scores) and, when the cache holds more
than budget x L x K pairs, the highest-scoring budget x L x K are kept over every layer and KV head (per-head
budgets vary, each at most the capacity less one interval), the first `first` tokens and the last `window` ones
always; kv.defragment moves what is kept to the front of each head and decoding goes on in the freed slots. With a
threshold instead, every pair scoring below it outside the first tokens and the window goes. Logical positions keep
counting (keys keep their RoPE); the capacity never changes, so every step compiles once.

One sequence at a time. Einsum legend: L layers, B batch (1), K KV heads, C cache slots.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.cache.layouts import visible_slots
from kvzip_jax.config import FULL, ModelConfig
from kvzip_jax.errors import ContextTooLongError, UnsupportedArchitectureError
from kvzip_jax.kvzip.budget import top_counts
from kvzip_jax.scorers.features import ScorerObserver
from kvzip_jax.scorers.scorer import Scorer

INTERVAL = 128  # generated tokens between cuts (Fast KVzip's buffer)
FIRST = 4  # first tokens of the sequence never evicted
WINDOW = 128  # most recent tokens never evicted


@dataclasses.dataclass(frozen=True)
class Cut:
    """One cut: tokens generated before it, pairs held before and after (summed over layers and heads), bytes after."""

    generated: int
    held: int
    kept: int
    bytes: int


def generate(
    params,
    cfg: ModelConfig,
    prompt,
    max_new_tokens: int,
    *,
    scorer: Scorer,
    budget: int | None = None,
    threshold: float | None = None,
    interval: int = INTERVAL,
    first: int = FIRST,
    window: int = WINDOW,
    capacity: int | None = None,
    reserve: int = 0,
    stop_tokens: Sequence[int] = (),
    sampling: gen.Sampling | None = None,
    cache: kv.KVCache | None = None,
    scores: jax.Array | None = None,
    forced: Sequence[int] | None = None,
):
    """Generates up to max_new_tokens after prompt [T], cutting the cache every `interval` tokens to `budget` pairs
    per (layer, KV head) on average (or to the pairs scoring at least `threshold`). capacity: slots per head (default
    2 x budget + interval + reserve, at least the prompt + interval + reserve); reserve: slots every cut leaves free
    beyond the next block (room for a question after the generation). cache, scores: go on from a one-row dense
    cache (donated) and its slots' scores [L, 1, K, C] (start_from), the prompt appended to it. Returns (tokens,
    cache, cuts: list of Cut)."""
    if any(kind != FULL for kind in cfg.layer_types) or cfg.mla is not None:
        raise UnsupportedArchitectureError(
            "compression while decoding needs every layer evictable, by KV head (no sliding window, no latent cache)"
        )
    if (budget is None) == (threshold is None):
        raise ValueError("give a budget or a threshold")
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if forced is not None:
        forced = np.asarray(forced, np.int32).reshape(-1)
        max_new_tokens = min(max_new_tokens, forced.size)
    if min(interval, window + 1, first + 1, max_new_tokens) < 1 or (budget is not None and budget <= first + window):
        raise ValueError(
            f"need interval, max_new_tokens >= 1, first, window >= 0 and a budget above first + window "
            f"({first} + {window}); got {interval}, {max_new_tokens}, {first}, {window}, {budget}"
        )
    if prompt.size + max_new_tokens > cfg.max_position:
        raise ContextTooLongError(
            f"{prompt.size} prompt + {max_new_tokens} new tokens exceed the model's maximum position {cfg.max_position}"
        )
    room = interval + reserve  # what every cut leaves free in each head
    if (cache is None) != (scores is None):
        raise ValueError("a cache to go on from comes with its slots' scores (start_from)")
    occupied = 0 if cache is None else int(kv.kept_per_head(cache).max())  # the fullest head's pairs
    capacity = cache.layers[0].capacity if cache is not None else capacity
    capacity = capacity or max(2 * (budget or 0) + room, prompt.size + room)
    if reserve < 0 or capacity < occupied + prompt.size + room:
        raise ValueError(
            f"a capacity of {capacity} holds no prompt of {prompt.size} tokens, a block of {interval} and a reserve "
            f"of {reserve}" + (f" beside the {occupied} pairs held" if occupied else "")
        )
    observer = ScorerObserver(scorer)
    if cache is None:
        logits, cache, prompt_scores = gen.prefill_observed(params, cfg, [prompt], observer, capacity=capacity)
        scores = _slot_scores(prompt_scores, capacity)  # [L, 1, K, C]
    else:
        mark = kv.mark(cache)
        logits, cache, prompt_scores = gen.prefill_observed(params, cfg, [prompt], observer, cache)
        scores = _placed(scores, prompt_scores[..., : prompt.size], mark)
    sampling = sampling or gen.Sampling.make()
    out, cuts = [], []
    while len(out) < max_new_tokens:
        mark = kv.mark(cache)
        size = min(interval, max_new_tokens - len(out))
        if forced is None:
            key = jax.random.fold_in(sampling.key, len(cuts))
            new, cache, logits = gen.decode(
                params,
                cfg,
                logits,
                cache,
                size,
                stop_tokens=stop_tokens,
                sampling=dataclasses.replace(sampling, key=key),
                return_logits=True,
            )
            block = new[0]
            stopped = bool(block) and block[-1] in stop_tokens
            fed = block[:-1] if stopped else block  # a stop token is not fed
        else:
            fed = forced[len(out) : len(out) + size]
            block, cache = predictions(params, cfg, cache, fed)
            stopped = False
        out += block
        if stopped or len(out) >= max_new_tokens or len(fed) == 0:
            return out, cache, cuts
        cache, block_scores = _rescored(params, cfg, kv.rewind(cache, mark), np.asarray(fed, np.int32), observer)
        scores = _placed(scores, block_scores, mark)
        held = int(kv.kept_per_head(cache).sum())
        over = threshold is not None or held > budget * cfg.num_layers * cfg.num_kv_heads
        if not over and int(cache.room()[0]) >= room:  # within budget, and the next block fits every head
            continue
        cache, scores = _cut(cache, scores, budget, threshold, first, window, room)
        cuts.append(Cut(len(out), held, int(kv.kept_per_head(cache).sum()), kv.used_bytes(cache)))
    return out, cache, cuts


def predictions(params, cfg: ModelConfig, cache: kv.KVCache, tokens: np.ndarray):
    """tokens [T] appended to a one-row cache (donated; no scorer): (the greedy prediction after each, list of T
    ints; cache)."""
    logits, cache = gen.forward_step(
        params, jnp.asarray(tokens[None]), jnp.full((1,), tokens.size), cache, cfg, logits="all"
    )
    return [int(t) for t in np.asarray(jnp.argmax(logits[0], axis=-1))], cache


def _slot_scores(scores: jax.Array, capacity: int) -> jax.Array:
    """[L, 1, K, C] the prefill's per-token scores [L, 1, K, T] in their slots (a fresh cache: token t in slot t)."""
    T = scores.shape[-1]
    if T >= capacity:
        return scores[..., :capacity]
    return jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, capacity - T)), constant_values=-jnp.inf)


def _rescored(params, cfg, cache, tokens: np.ndarray, observer):
    """The block's tokens appended again with the scorer: (cache, scores [L, 1, K, T])."""
    _, cache, scores = gen.prefill_observed(params, cfg, [tokens], observer, cache, chunk=max(tokens.size, 16))
    return cache, scores[..., : tokens.size]


def _placed(scores: jax.Array, block: jax.Array, mark) -> jax.Array:
    """scores [L, 1, K, C] with the block's [L, 1, K, T] written at each head's slots from its length at the mark."""
    T = block.shape[-1]
    starts = jnp.stack(mark.lengths)  # [L, 1, K]
    slots = starts[..., None] + jnp.arange(T)  # [L, 1, K, T]
    return _scatter(scores, slots, block)


@jax.jit
def _scatter(scores, slots, block):
    L, B, K, _ = scores.shape
    index = jnp.indices((L, B, K, block.shape[-1]))
    return scores.at[index[0], index[1], index[2], slots].set(block, mode="drop")


@functools.partial(jax.jit, static_argnames=("budget", "threshold", "first", "window", "room"))
def _cut(cache: kv.KVCache, scores: jax.Array, budget, threshold, first: int, window: int, room: int):
    """The cache cut back (masked, then defragmented) and its scores moved along, each head left `room` free slots.
    Protected: the first `first` logical tokens (slots [0, first): never moved, as they are kept) and each head's
    last `window` filled slots."""
    L, B, K, C = scores.shape
    filled = jnp.stack([visible_slots(layer) for layer in cache.layers])  # [L, 1, K, C]
    lengths = jnp.stack([layer.lengths for layer in cache.layers])  # [L, 1, K]
    slots = jnp.arange(C)
    protected = (slots < first) | (slots >= lengths[..., None] - window)  # [L, 1, K, C]
    ranked = jnp.where(filled, jnp.where(protected, jnp.inf, scores), -jnp.inf)
    if threshold is not None:
        keep = filled & (ranked >= threshold)
    else:
        total = jnp.full((B,), budget * L * K, jnp.int32)
        keep = top_counts(ranked.transpose(1, 0, 2, 3).reshape(B, -1), total).reshape(B, L, K, C).transpose(1, 0, 2, 3)
        keep &= filled
    # Each head keeps at most C - room, so the next block fits: its lowest extras go.
    order = jnp.argsort(jnp.where(keep, -ranked, jnp.inf), axis=-1, stable=True)  # kept best-first
    rank = jnp.argsort(order, axis=-1)  # [L, 1, K, C] each slot's place in its head
    keep &= rank < C - room
    layers = tuple(dataclasses.replace(layer, keep=k) for layer, k in zip(cache.layers, keep))
    return start_from(dataclasses.replace(cache, layers=layers), scores)


@jax.jit
def start_from(masked: kv.KVCache, scores: jax.Array):
    """(dense cache, scores [L, B, K, C]) from a masked cache and its slots' scores: kv.defragment moves each head's
    kept pairs to the front, the scores move with them (-inf on the freed slots)."""
    keep = jnp.stack([visible_slots(layer) for layer in masked.layers])  # [L, B, K, C]
    C = keep.shape[-1]
    moved = jnp.argsort(jnp.where(keep, 0, C) + jnp.arange(C), axis=-1)  # kv.defragment's order
    return kv.defragment(masked), jnp.take_along_axis(jnp.where(keep, scores, -jnp.inf), moved, axis=-1)
