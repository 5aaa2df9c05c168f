"""Chunked, bucketed prefill; a jitted decode loop (one `while_loop`, cache donated); sampling; multi-turn append.

Recompilation discipline: the jitted step sees tokens [B, chunk] and a cache of a bucketed capacity, so a new
context length reuses the compiled step as long as its capacity bucket is the same. The decode loop's output
buffer is bucketed too; the real number of steps is an array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import dtypes
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ContextTooLongError, EmptyInputError
from kvzip_jax.models.transformer import forward
from kvzip_jax.sharding.mesh import to_host

DEFAULT_CHUNK = 512
MIN_CAPACITY = 256
MAX_STOP_TOKENS = 8


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def capacity_for(num_tokens: int, cfg: ModelConfig) -> int:
    """Cache capacity bucket for num_tokens (a power of two, at least MIN_CAPACITY, at most max_position)."""
    if num_tokens > cfg.max_position:
        raise ContextTooLongError(f"{num_tokens} tokens exceed the model's maximum context of {cfg.max_position}")
    return min(bucket(num_tokens, MIN_CAPACITY), cfg.max_position)


def append_tokens(params, tokens, num_new, cache: kv.KVCache, cfg: ModelConfig, logits: str | None = "last", at=None):
    """tokens [B, T] (the first num_new [B] real) appended at each row's next position. -> (logits, cache).
    logits and at as in models.transformer.forward."""
    positions = cache.next_position[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [B, T]
    out, cache, _ = forward(params, tokens, positions, cache, cfg, num_new=num_new, logits=logits, at=at)
    return out, cache


forward_step = jax.jit(append_tokens, donate_argnames=("cache",), static_argnames=("logits",))


@functools.partial(jax.jit, donate_argnames=("cache",))
def observed_step(params, tokens, num_new, cache: kv.KVCache, cfg: ModelConfig, observer):
    """append_tokens with an observer (a pytree): -> (last logits [B, 1, V], cache, observed [L, ...] stacked)."""
    positions = cache.next_position[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)  # [B, T]
    out, cache, aux = forward(params, tokens, positions, cache, cfg, observer, num_new=num_new)
    return out, cache, jnp.stack(aux["observed"])


def on_params_device(cache: kv.KVCache, params) -> kv.KVCache:
    """An uncommitted cache committed to the one device its params are committed to (a committed cache, or params
    on several devices or none: as given). jit keys its programs on whether each argument is committed, and a step's
    output cache is: an uncommitted fresh cache would compile the step once for the first chunk and again for every
    later one of the same width."""
    leaf = jax.tree.leaves(params)[0]
    devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) and leaf.committed else set()
    if len(devices) != 1 or jax.tree.leaves(cache)[0].committed:
        return cache
    return jax.device_put(cache, next(iter(devices)))


def _as_rows(tokens) -> list[np.ndarray]:
    if isinstance(tokens, (np.ndarray, jax.Array)) and np.ndim(tokens) == 1:
        tokens = [tokens]
    rows = [np.asarray(row, np.int32).reshape(-1) for row in tokens]
    if not rows:
        raise EmptyInputError("no sequences given")
    if any(row.size == 0 for row in rows):
        raise EmptyInputError("an empty token sequence was given")
    return rows


def prefill(
    params,
    cfg: ModelConfig,
    tokens,
    cache: kv.KVCache | None = None,
    *,
    capacity: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    reserve: int = 256,
    on_chunk: Callable[[int, int], None] | None = None,
):
    """Appends token rows (a list of sequences, or [B, T]) to cache in chunks; returns (last_logits [B, V], cache).

    With no cache, a fresh one (in the params' dtype) is made with capacity `capacity` or the bucket of the longest
    row plus `reserve` (room for questions and answers). Appending to an existing cache is multi-turn: positions
    continue. The given cache is donated (its arrays are consumed); an uncommitted one goes to the params' device
    first (on_params_device). on_chunk(done, total): called after each chunk with the tokens of the longest row fed
    so far (a progress bar).
    """
    logits, cache, _ = _prefill(params, cfg, tokens, cache, capacity, chunk, reserve, on_chunk, None)
    return logits, cache


def prefill_observed(
    params,
    cfg: ModelConfig,
    tokens,
    observer,
    cache: kv.KVCache | None = None,
    *,
    capacity: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    reserve: int = 256,
    on_chunk: Callable[[int, int], None] | None = None,
):
    """prefill with an observer (a pytree) on every layer's attention: -> (last_logits [B, V], cache, observed), the
    observer's per-layer outputs of each chunk concatenated along their last axis (the chunk's tokens: token t of
    the rows is column t; columns past a row's length are padding)."""
    return _prefill(params, cfg, tokens, cache, capacity, chunk, reserve, on_chunk, observer)


def _prefill(params, cfg, tokens, cache, capacity, chunk, reserve, on_chunk, observer):
    rows = _as_rows(tokens)
    lengths = np.array([row.size for row in rows], np.int32)  # [B]
    B = len(rows)
    if cache is not None and cache.batch_size != B:
        raise ValueError(f"{B} token rows for a cache of batch size {cache.batch_size}")
    positions_after = lengths + (0 if cache is None else to_host(cache.next_position))  # [B]
    if np.any(positions_after > cfg.max_position):
        raise ContextTooLongError(
            f"position {int(positions_after.max())} exceeds the model's maximum context of {cfg.max_position}"
        )
    if cache is None:
        need = int(lengths.max())
        cache = kv.init_cache(
            cfg, B, capacity or capacity_for(min(need + reserve, cfg.max_position), cfg), dtypes.of_params(params)
        )
    cache = on_params_device(cache, params)
    room = to_host(cache.room())  # [B]
    if np.any(lengths > room):
        raise ContextTooLongError(
            f"{int(lengths.max())} new tokens exceed the cache's capacity: room for {int(room.min())} more"
        )

    last_logits, observed = None, []
    for start in range(0, int(lengths.max()), chunk):
        num_new = np.clip(lengths - start, 0, chunk).astype(np.int32)  # [B]
        width = min(chunk, bucket(int(num_new.max())))
        block = np.zeros((B, width), np.int32)  # [B, T] right-padded
        for b, row in enumerate(rows):
            piece = row[start : start + width]
            block[b, : piece.size] = piece
        if observer is None:
            logits, cache = forward_step(params, jnp.asarray(block), jnp.asarray(num_new), cache, cfg)
        else:
            logits, cache, seen = observed_step(params, jnp.asarray(block), jnp.asarray(num_new), cache, cfg, observer)
            observed.append(seen)
        logits = logits[:, 0]  # [B, V]
        last_logits = logits if last_logits is None else jnp.where((num_new > 0)[:, None], logits, last_logits)
        if on_chunk is not None:
            on_chunk(min(start + chunk, int(lengths.max())), int(lengths.max()))
    return last_logits, cache, (jnp.concatenate(observed, axis=-1) if observed else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling settings as arrays (changing them never recompiles). temperature 0 means greedy."""

    temperature: jax.Array  # [] float32
    top_p: jax.Array  # [] float32
    key: jax.Array  # PRNG key

    @classmethod
    def make(cls, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> "Sampling":
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        return cls(jnp.float32(temperature), jnp.float32(top_p), jax.random.key(seed))


def sample(logits: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """Next tokens [B] from logits [B, V]: argmax when temperature is 0, else top-p (nucleus) sampling."""

    def nucleus(_):
        scaled = logits / sampling.temperature
        order = jnp.argsort(-scaled, axis=-1)  # [B, V]
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(mass_before < sampling.top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)  # [B] index into the sorted order
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]

    greedy = lambda _: jnp.argmax(logits, axis=-1)
    return jax.lax.cond(sampling.temperature > 0, nucleus, greedy, None).astype(jnp.int32)


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("buffer",))
def _decode_loop(
    params, cfg: ModelConfig, logits, cache: kv.KVCache, max_new, stop_tokens, sampling: Sampling, buffer: int
):
    B = logits.shape[0]

    def cond(state):
        step, _, done, cache, _, _ = state
        return (step < max_new) & ~jnp.all(done | (cache.room() <= 0))

    def body(state):
        step, out, done, cache, logits, key = state
        done = done | (cache.room() <= 0)  # a row whose cache is full ends; the others go on
        key, sub = jax.random.split(key)
        token = sample(logits, sampling, sub)  # [B]
        token = jnp.where(done, 0, token)
        out = out.at[:, step].set(jnp.where(done, -1, token))
        done = done | jnp.any(token[:, None] == stop_tokens[None, :], axis=-1)
        num_new = jnp.where(done, 0, 1).astype(jnp.int32)  # a stop token is emitted but not fed back
        new_logits, cache = append_tokens(params, token[:, None], num_new, cache, cfg)
        return step + 1, out, done, cache, new_logits[:, 0], key

    out = jnp.full((B, buffer), -1, jnp.int32)  # [B, buffer], -1 after a row stops
    state = (jnp.int32(0), out, jnp.zeros((B,), bool), cache, logits, sampling.key)
    _, out, _, cache, logits, _ = jax.lax.while_loop(cond, body, state)
    return out, cache, logits


def decode(
    params,
    cfg: ModelConfig,
    logits,
    cache: kv.KVCache,
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[int] = (),
    sampling: Sampling | None = None,
    return_logits: bool = False,
):
    """Generates up to max_new_tokens from the logits [B, V] of the last prefilled token.

    Returns (tokens list per row, cache), plus with return_logits the logits [B, V] after each row's last fed
    token (where decoding would go on; meaningless for a stopped row). A row stops after emitting one of
    stop_tokens (kept in its output, not fed); a row also stops when its cache is full, while the other rows go
    on. The given cache is donated.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(stop_tokens) > MAX_STOP_TOKENS:
        raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens, got {len(stop_tokens)}")
    stops = np.full((MAX_STOP_TOKENS,), -1, np.int32)
    stops[: len(stop_tokens)] = list(stop_tokens)
    sampling = sampling or Sampling.make()
    out, cache, logits = _decode_loop(
        params,
        cfg,
        logits,
        cache,
        jnp.int32(max_new_tokens),
        jnp.asarray(stops),
        sampling,
        buffer=bucket(max_new_tokens),
    )
    tokens = [[int(t) for t in row[:max_new_tokens] if t >= 0] for row in to_host(out)]
    return (tokens, cache, logits) if return_logits else (tokens, cache)


def ask(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    question_tokens,
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[int] = (),
    sampling: Sampling | None = None,
):
    """Appends question_tokens [T] (question + answer header) to a one-row context cache, generates an answer,
    then drops question and answer again. Returns (answer tokens, cache as it was), so one prefilled context
    serves any number of questions. The given cache is donated."""
    before = kv.mark(cache)
    logits, cache = prefill(params, cfg, [question_tokens], cache)
    answers, cache = decode(params, cfg, logits, cache, max_new_tokens, stop_tokens=stop_tokens, sampling=sampling)
    return answers[0], kv.rewind(cache, before)
