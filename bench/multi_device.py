"""Meshes side by side on the devices at hand: the same prefill, KVzip scoring and decode on each, one device first.

    python bench/multi_device.py [--model NAME_OR_CONFIG_DIR] [--tokens 8192] [--batch 8] [--meshes 1,1,1 1,1,4 ...]

For machines with several accelerators (a GPU node, a TPU slice); on CPU it runs on simulated devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8), which checks it end to end but measures nothing real. Random
weights at the model's config (weights.registry.load_random; no weights to download), bfloat16 on GPU/TPU. Per mesh
(data, seq, tensor): prefill, scoring and decode seconds (compilation excluded: each timed call runs once before),
bytes per device of params and cache, and whether the kept masks are bit for bit the first mesh's and the last
decode logits within --atol of it. Default meshes: every (data, seq, tensor) with tensor dividing the KV heads, over
all devices, plus one device.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import dtypes, kvzip, sharding
from kvzip_jax import generate as gen
from kvzip_jax.kvzip.scoring import RereadInputs
from kvzip_jax.weights import registry

GiB = 1 << 30


def reread(tokens: np.ndarray, prefix: int, chunk: int) -> RereadInputs:
    """Rereads of every chunk of the context (a fixed 8-token prompt stands in for the reread prompt)."""
    B, n = tokens.shape[0], tokens.shape[1] - prefix
    chunks, width = -(-n // chunk), -(-(chunk + 8) // 64) * 64
    rows = np.zeros((chunks, B, width), np.int32)
    for t in range(chunks):
        piece = tokens[:, prefix + t * chunk : prefix + (t + 1) * chunk]
        rows[t, :, 8 : 8 + piece.shape[1]] = piece
    starts = prefix + chunk * np.arange(chunks)[:, None] + np.zeros((1, B), int)
    lengths = np.clip(n - chunk * np.arange(chunks), 0, chunk)[:, None] + np.zeros((1, B), int)
    return RereadInputs(
        tokens=jnp.asarray(rows),
        num_valid=jnp.asarray(lengths + 8, jnp.int32),
        chunk_start=jnp.asarray(starts, jnp.int32),
        chunk_len=jnp.asarray(lengths, jnp.int32),
        prefix_len=jnp.full((B,), prefix, jnp.int32),
        context_len=jnp.full((B,), n, jnp.int32),
        chunk_size=chunk,
    )


def timed(fn, repeats: int = 1):
    out = jax.block_until_ready(fn())  # compiles
    start = time.perf_counter()
    for _ in range(repeats):
        out = jax.block_until_ready(fn())
    return (time.perf_counter() - start) / repeats, out


def run(model, mesh, tokens, args):
    cfg, B = model.cfg, tokens.shape[0]
    params = sharding.shard_params(model.params, cfg, mesh)
    empty = lambda: sharding.shard_cache(kv.init_cache(cfg, B, args.capacity, dtypes.of_params(params)), mesh)
    inputs = reread(tokens, 16, args.chunk)
    with jax.set_mesh(mesh):
        prefill_s, (logits, cache) = timed(lambda: gen.prefill(params, cfg, tokens, empty(), chunk=args.chunk))
        compress = jax.jit(kvzip.score_and_evict)
        score_s, (masked, _) = timed(lambda: compress(params, cfg, cache, inputs, args.ratio))
        token = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        step = lambda c: gen.forward_step(params, token, jnp.ones((B,), jnp.int32), c, cfg)
        copy = lambda: jax.tree.map(jnp.copy, masked)
        step(copy())  # compiles
        fed, start = copy(), time.perf_counter()
        for _ in range(args.steps):
            out, fed = step(fed)
        jax.block_until_ready(out)
        decode_s = (time.perf_counter() - start) / args.steps
    per_device = lambda tree: max(sharding.bytes_per_device(tree).values()) / GiB
    keep = np.asarray(jnp.stack([layer.keep for layer in masked.layers]))
    return dict(
        prefill=prefill_s,
        score=score_s,
        decode_ms=1e3 * decode_s,
        params=per_device(params),
        cache=per_device(cache),
        keep=keep,
        logits=np.asarray(out[:, 0], np.float32),
    )


def default_meshes(kv_heads: int) -> list[tuple[int, int, int]]:
    n = jax.device_count()
    meshes = [(1, 1, 1)]
    for tensor in (t for t in range(1, n + 1) if n % t == 0 and kv_heads % t == 0):
        rest = n // tensor
        meshes += [(rest, 1, tensor), (1, rest, tensor)]
    return list(dict.fromkeys(meshes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=registry.QWEN, help="bundled name or converted checkpoint (its config)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--atol", type=float, default=1e-3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--meshes", nargs="*", help="data,seq,tensor each (default: see above)")
    args = parser.parse_args()
    model = registry.load_random(args.model, dtype=args.dtype)
    args.capacity = gen.bucket(args.tokens + args.steps + 16)
    tokens = np.random.default_rng(0).integers(100, model.cfg.vocab_size - 100, (args.batch, args.tokens + 16))
    meshes = (
        [tuple(int(x) for x in m.split(",")) for m in args.meshes]
        if args.meshes
        else default_meshes(model.cfg.num_kv_heads)
    )
    print(
        f"{model.name} ({jnp.dtype(dtypes.of_params(model.params)).name}), "
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, batch {args.batch} x {args.tokens} tokens"
    )
    print(
        "| mesh (data, seq, tensor) | prefill s | scoring s | decode ms/step | params GiB/dev | cache GiB/dev | "
        "masks = first | logits = first |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    first = None
    for shape in meshes:
        got = run(model, sharding.make_mesh(*shape), tokens, args)
        first = first or got
        same_keep = bool((got["keep"] == first["keep"]).all())
        close = float(np.abs(got["logits"] - first["logits"]).max()) <= args.atol
        print(
            f"| {shape} | {got['prefill']:.2f} | {got['score']:.2f} | {got['decode_ms']:.1f} | {got['params']:.3f} | "
            f"{got['cache']:.3f} | {same_keep} | {close} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
