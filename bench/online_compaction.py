"""Online compaction (issue 16 item 4): how much of a text the model still remembers after its cache was compacted again
and again, against keeping the most recent tokens (StreamingLLM) in the same physical cache.

python bench/online_compaction.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 768] [--capacity 256 512]

The text is the first --tokens tokens of the bundled demo document, twice. It is fed 64 tokens at a time
(teacher-forced) into a cache of --capacity slots; whenever the next block would not fit, the cache is compacted to free
room: Attention Matching (matching.online.compact_full: all but the first 4 and the last 20 tokens to half, the queries
of the last --capacity tokens as reference, online.generate's default) or recent-window eviction (the first 4 and the
most recent tokens kept, as many slots freed). The full cache holds everything. Printed side by side: the mean negative
log-likelihood (nats per token) of the first copy's tokens fed after the first compaction, and of the second copy (whose
tokens the model can predict only by remembering the first copy), compactions, and seconds per compaction (compile
excluded)."""

from __future__ import annotations

import argparse
import time
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.matching import online
from kvzip_jax.weights import registry

BLOCK, KEEP_PREFIX, PROTECT, RATIO = 64, 4, 20, 0.5


def feed(params, cfg, ids: np.ndarray, capacity: int, free) -> tuple[np.ndarray, int, int, float]:
    """Per-token NLL [len(ids) - 1] of ids fed BLOCK at a time into a `capacity`-slot cache, `free(cache, history)`
    making room whenever a block would not fit -> (nll, compactions, first token fed after the first, seconds)."""
    logits, cache = gen.prefill(params, cfg, [ids[:BLOCK]], capacity=capacity)
    nll, compactions, first, seconds = [], 0, len(ids), []
    for start in range(BLOCK, len(ids), BLOCK):
        block = ids[start : start + BLOCK]
        if int(cache.room()[0]) < len(block):
            began = time.perf_counter()
            cache = free(cache, list(ids[:start]))
            jax.block_until_ready(cache)
            seconds.append(time.perf_counter() - began)
            compactions, first = compactions + 1, min(first, start)
        padded = np.zeros((1, BLOCK), np.int32)
        padded[0, : len(block)] = block
        out, cache = gen.forward_step(
            params, jnp.asarray(padded), jnp.asarray([len(block)], jnp.int32), cache, cfg, logits="all"
        )
        lp = jax.nn.log_softmax(jnp.concatenate([logits[:, None], out[:, : len(block) - 1]], axis=1), axis=-1)
        nll.extend(-np.asarray(jnp.take_along_axis(lp[0], jnp.asarray(block)[:, None], axis=-1))[:, 0])
        logits = out[:, len(block) - 1]
    spent = float(np.mean(seconds[1:])) if len(seconds) > 1 else float("nan")  # the first compiles
    return np.asarray(nll), compactions, first, spent


def recent_window(cache: kv.KVCache, history) -> kv.KVCache:
    """The first KEEP_PREFIX and the most recent tokens kept, as many slots freed as online compaction frees."""
    used = int(cache.layers[0].lengths[0, 0])
    segment = used - KEEP_PREFIX - PROTECT
    evicted = segment - int(kept_count(RATIO, jnp.asarray([segment]))[0])
    slots = jnp.arange(cache.capacity)
    keep = (slots < KEEP_PREFIX) | (slots >= KEEP_PREFIX + evicted)
    return kv.defragment(
        kv.KVCache(
            tuple(
                kv.LayerCache(layer.k, layer.v, layer.lengths, jnp.broadcast_to(keep, layer.k.shape[:3]))
                for layer in cache.layers
            ),
            cache.next_position,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=registry.QWEN)
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--capacity", type=int, nargs="+", default=[256, 512])
    args = parser.parse_args(argv)

    model = registry.load(args.model, dtype="float32")
    cfg, params, tok = model.cfg, model.params, model.tokenizer
    text = resources.files("kvzip_jax.data").joinpath("demo_document.txt").read_text()
    copy = np.asarray(tok.encode(text), np.int32)[: args.tokens]
    ids = np.concatenate([copy, copy])
    config = online.MatchingConfig(ratio=RATIO, budget="uniform", sources=("self-study",), same_bytes=False)
    am = lambda cache, history: online.compact_full(
        params, cfg, cache, history, config, keep_prefix=KEEP_PREFIX, protect=PROTECT, window=cache.capacity
    )
    full, _, _, _ = feed(params, cfg, ids, gen.capacity_for(len(ids), cfg), None)
    print(
        f"{args.model}, the first {len(copy)} tokens of the demo document twice ({len(ids)} tokens), fed "
        f"{BLOCK} at a time; NLL in nats per token"
    )
    print(
        f"{'capacity':>8} {'method':<14} {'compactions':>11} {'s/compaction':>12} {'NLL 1st copy':>12} "
        f"{'NLL 2nd copy':>12}"
    )
    for capacity in args.capacity:
        for name, free in (("attention-match", am), ("recent-window", recent_window)):
            nll, count, first, seconds = feed(params, cfg, ids, capacity, free)
            first_copy = slice(first - 1, len(copy) - 1)  # NLL index i is token i + 1
            print(
                f"{capacity:>8} {name:<14} {count:>11} {seconds:>12.2f} {nll[first_copy].mean():>12.3f} "
                f"{nll[len(copy) - 1 :].mean():>12.3f}   (full cache: {full[first_copy].mean():.3f}, "
                f"{full[len(copy) - 1 :].mean():.3f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
