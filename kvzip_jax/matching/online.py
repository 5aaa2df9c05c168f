"""Online compaction (reference/attention_matching.md, App. F.3): a generation that runs past its physical cache.

    tokens, cache, compactions = online.generate(params, cfg, prompt, 4096, capacity=1024)

Whenever the cache is full, everything but the first `keep_prefix` and the last `protect` tokens is compacted to
`ratio` of its pairs by Attention Matching (kv.defragment then frees the rest), and decoding goes on in the freed
slots. Logical positions keep counting (keys keep their RoPE) and the capacity never changes, so the decode step and
the compaction step compile once. Keys compacted before are compacted again (their bias enters the next fit), as in
the paper, which compacts all but the last 20 tokens by half.

Reference queries: the last `window` tokens (default: as many as the cache holds), teacher-forced on top of the full
cache (the self-study source with the recent text as its one probe): what the model asks while it writes stands for
what it will ask next (docs/results.md, online compaction, on the window's size). There is no
reread (the repeat source needs a segment's tokens, and compacted keys have none), so the selector is HAK or OMP,
not KVzip's scores; budgets are uniform, so every head's segment ends at the same slot for the next compaction.

One sequence at a time (rows of a batch would fill at different times). Sliding-window layers (Gemma 3) are refused:
they are never compacted, so they would never free a slot.
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
from kvzip_jax.config import FULL, ModelConfig
from kvzip_jax.errors import ContextTooLongError, UnsupportedArchitectureError
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.kvzip.scoring import ContextSpan
from kvzip_jax.matching.compact import compact_with
from kvzip_jax.matching.config import MatchingConfig
from kvzip_jax.matching.queries import Probes, reference_queries


def generate(
    params,
    cfg: ModelConfig,
    prompt,
    max_new_tokens: int,
    *,
    capacity: int,
    ratio: float = 0.5,
    protect: int = 20,
    keep_prefix: int = 0,
    window: int | None = None,
    selector: str = "hak",
    stop_tokens: Sequence[int] = (),
    sampling: gen.Sampling | None = None,
    query_cap: int = 4096,
):
    """Generates up to max_new_tokens after prompt [T] in a cache of `capacity` slots per head, compacting it
    whenever it is full. Returns (tokens, cache, compactions): the generated ids (a stop token ends them and is kept),
    the final cache (capacity slots, next_position = T + tokens fed) and how many compactions ran. window: reference
    tokens per compaction (default: capacity; a compaction briefly holds a copy of the cache with that much room)."""
    if any(kind != FULL for kind in cfg.layer_types):
        raise UnsupportedArchitectureError(
            "online compaction needs every layer compactable: sliding-window layers never free a slot"
        )
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    window = capacity if window is None else window
    if selector not in ("hak", "omp"):
        raise ValueError(f"online compaction selects by HAK or OMP (no reread, so no KVzip scores), got {selector!r}")
    if not 0 < ratio < 1:
        raise ValueError(f"ratio must be in (0, 1): a compaction has to free slots, got {ratio}")
    if protect < 0 or window < 1 or not 0 <= keep_prefix <= prompt.size:
        raise ValueError(
            f"need protect >= 0, window >= 1 and 0 <= keep_prefix <= the prompt's {prompt.size} tokens, "
            f"got {protect}, {window}, {keep_prefix}"
        )
    segment = capacity - keep_prefix - protect
    if segment - int(kept_count(ratio, jnp.asarray([max(segment, 0)]))[0]) < 1:
        raise ValueError(
            f"a capacity of {capacity} with keep_prefix {keep_prefix} and protect {protect} leaves "
            f"nothing a compaction at ratio {ratio} could free"
        )
    if prompt.size + max_new_tokens > cfg.max_position:
        raise ContextTooLongError(
            f"{prompt.size} prompt + {max_new_tokens} new tokens exceed the model's maximum position {cfg.max_position}"
        )
    config = MatchingConfig(
        ratio=ratio, selector=selector, budget="uniform", sources=("self-study",), query_cap=query_cap, same_bytes=False
    )
    sampling = sampling or gen.Sampling.make()
    logits, cache = gen.prefill(params, cfg, [prompt], capacity=capacity)
    history, out, compactions = list(prompt), [], 0
    while True:
        key = jax.random.fold_in(sampling.key, compactions)  # a fresh stream after each compaction
        new, cache, logits = gen.decode(
            params,
            cfg,
            logits,
            cache,
            max_new_tokens - len(out),
            stop_tokens=stop_tokens,
            sampling=dataclasses.replace(sampling, key=key),
            return_logits=True,
        )
        out, history = out + new[0], history + new[0]
        stopped = bool(new[0]) and new[0][-1] in stop_tokens
        if stopped or len(out) >= max_new_tokens or int(cache.room()[0]) > 0:
            return out, cache, compactions
        cache = compact_full(
            params, cfg, cache, history, config, keep_prefix=keep_prefix, protect=protect, window=window
        )
        compactions += 1


def compact_full(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    history: Sequence[int],
    config: MatchingConfig,
    *,
    keep_prefix: int,
    protect: int,
    window: int,
) -> kv.KVCache:
    """One online compaction of a one-row dense cache whose heads all hold the same count: slots [keep_prefix,
    used - protect) compacted to config.ratio with the last `window` ids of history (every token fed so far) as
    reference, then defragmented (same capacity, the freed slots empty)."""
    lengths = np.asarray(cache.lengths())  # [L, 1, K]
    if cache.batch_size != 1 or (lengths != lengths.flat[0]).any():
        raise ValueError("online compaction takes one row whose heads all hold the same number of pairs")
    used = int(lengths.flat[0])
    if used - keep_prefix - protect < 1:
        raise ValueError(
            f"nothing to compact: the cache holds {used} tokens, keep_prefix {keep_prefix} and protect "
            f"{protect} keep them all"
        )
    recent = np.asarray(history[-window:], np.int32)
    tokens = np.zeros((1, 1, window), np.int32)
    tokens[0, 0, : recent.size] = recent
    probes = Probes(tokens=jnp.asarray(tokens), num_valid=jnp.asarray([[recent.size]], jnp.int32))
    # the slots to compact, read as wide as the cache so every compaction of a cache shares one compilation
    segment = ContextSpan(
        prefix_len=jnp.asarray([keep_prefix], jnp.int32),
        context_len=jnp.asarray([used - keep_prefix - protect], jnp.int32),
        width=cache.capacity,
    )
    return _compacted(params, cfg, cache, probes, segment, config)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _compacted(
    params, cfg: ModelConfig, cache: kv.KVCache, probes: Probes, segment: ContextSpan, config: MatchingConfig
) -> kv.KVCache:
    roomy = kv.grown(cache, probes.tokens.shape[2])  # the probe runs on top of a full cache
    queries = reference_queries(params, cfg, roomy, None, config.sources, config.query_cap, probes=probes)
    compacted, _ = compact_with(queries, cfg, cache, segment, config)
    return kv.defragment(compacted)
