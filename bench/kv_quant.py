"""KV quantization stacked with KVzip eviction, side by side in one run (CPU here).

    python bench/kv_quant.py [--model smollm2-135m-instruct] [--tokens 2048] [--ratio 0.3] [--dtype bfloat16]
                             [--group N] [--decode-tokens 32] [--repeats 3]

On one context (the bundled demo document, repeated and cut to --tokens context tokens), scored once by KVzip:
  - bytes of every cache form at 16 (the model's dtype), 8 and 4 bits and 8/4 (int8 keys, int4 values), as a share
    of the full cache at 16 bits:
    "kept" counts the pairs held and visible (codes, scales and zero points included; kv.used_bytes), "allocated"
    the device arrays (a masked cache keeps the full arrays; a ragged one its bucketed store, its room for a
    64-token question and answer and, quantized, its full-precision window of 128 tokens);
  - decode time per token (XLA, greedy, no stop token) from the ragged cache at --ratio at each of those, all
    measured in turns (round robin, best of --repeats each), so load on the machine hits them alike
    (--decode-tokens 0: bytes only).
Compilation is excluded: every timed call runs once before.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
from kvzip import context_text  # bench/kvzip.py's context: the demo document cut to N tokens

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.kv_bits import KV_BITS
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK, evictable_layers
from kvzip_jax.quant.groups import QuantFormat, kv_formats
from kvzip_jax.weights import registry

QUESTION_ROOM = 64


def forms(cache, masked, ragged, group: int | None) -> dict:
    """{(form, bits): cache} of every form at every bit width."""
    out = {}
    for name, base in (("full", cache), ("masked", masked), ("ragged", ragged)):
        out[name, 16] = base
        for bits in KV_BITS[1:]:
            keys, values = kv_formats(bits, group)
            out[name, bits] = kv.quantized(base, keys, value_fmt=values)
    return out


def decode_round_robin(model, logits, caches: dict, steps: int, repeats: int) -> dict:
    """{key: best seconds per token} of greedy decoding from each cache, the caches taking turns each repeat."""
    states = {}
    for key, cache in caches.items():
        cache = jax.tree.map(jnp.array, cache)  # decode donates its cache
        states[key] = (cache, kv.mark(cache))
    best = {key: float("inf") for key in caches}
    for attempt in range(repeats + 1):  # the first round compiles
        for key, (cache, before) in states.items():
            start = time.perf_counter()
            out, after = gen.decode(model.params, model.cfg, logits, cache, steps)
            jax.block_until_ready(out)
            seconds = time.perf_counter() - start
            assert len(out[0]) == steps, f"{key}: decoding stopped early (cache full?)"
            states[key] = (kv.rewind(after, before), before)
            if attempt:
                best[key] = min(best[key], seconds / steps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=registry.SMOLLM2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--group", type=int, default=None, help="elements per scale (default: the format's, 64 for int8, 16 for int4)"
    )
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--decode-tokens", type=int, default=32, help="0: bytes only, no decode timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = registry.load(args.model, dtype=args.dtype)
    cfg, tok = model.cfg, model.tokenizer
    print(
        f"{model.name} {args.dtype}, jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores), "
        f"KVzip ratio {args.ratio}, groups of "
        + ", ".join(f"{min(QuantFormat(bits=b, group=args.group).group, cfg.head_dim)} (int{b})" for b in (8, 4))
        + f" (head dim {cfg.head_dim}), "
        f"{args.tokens} context tokens"
    )
    context, _ = prompts.split_for_reuse(tok, context_text(tok, args.tokens), ["?"])
    ids = context.ids()
    logits, cache = gen.prefill(model.params, cfg, [ids])
    prefix_len = context.context_start
    reread = kvzip.reread_inputs(tok, [prefix_len], [ids[prefix_len:]], args.chunk_size)
    scores = jax.jit(kvzip.score)(model.params, cfg, cache, reread)
    keep = kvzip.keep_mask(scores, reread.context_len, args.ratio, "pair", evictable_layers(cfg))
    masked = kv.mask_context(cache, keep, reread.prefix_len, reread.context_len)
    ragged = kv.pack(masked, QUESTION_ROOM)
    caches = forms(cache, masked, ragged, args.group)

    full_used, full_allocated = kv.used_bytes(cache), kv.nbytes(cache)
    print(
        f"\nfull cache at 16 bits: {full_used / 2**20:.2f} MiB kept pairs, {full_allocated / 2**20:.2f} MiB "
        f"allocated ({len(ids)} tokens, {prefix_len} of them the never-evicted prefix)"
    )
    print(
        "\n| form | bits | kept pairs (x full 16-bit) | context pairs alone (x full 16-bit) | allocated (x full "
        "16-bit) |"
    )
    print("|---|---:|---:|---:|---:|")
    context_used = lambda c: (
        kv.used_bytes(c)
        - prefix_len
        * sum(  # the prefix is never evicted
            cfg.num_kv_heads * kv.pair_bytes(layer.store if isinstance(layer, kv.QuantizedLayerCache) else layer)
            for layer in c.layers
        )
    )
    for (name, bits), c in caches.items():
        print(
            f"| {name}{'' if name == 'full' else f' {args.ratio}'} | {bits} | {kv.used_bytes(c) / full_used:.4f} | "
            f"{context_used(c) / context_used(cache):.4f} | {kv.nbytes(c) / full_allocated:.4f} |"
        )

    if args.decode_tokens == 0:  # bytes only
        return
    ragged_caches = {bits: caches["ragged", bits] for bits in KV_BITS}
    seconds = decode_round_robin(model, logits, ragged_caches, args.decode_tokens, args.repeats)
    base = seconds[16]
    print(
        f"\ndecode per token from the ragged cache at {args.ratio} (XLA, best of {args.repeats}, in turns): "
        + ", ".join(f"{bits} bits {seconds[bits] * 1e3:.1f} ms ({seconds[bits] / base:.2f}x)" for bits in KV_BITS)
    )


if __name__ == "__main__":
    main()
