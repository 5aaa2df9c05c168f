"""What KVzip scoring's extra resident memory is made of, on this CPU: XLA's buffer for the program, what the CPU
runtime allocates in each call outside it, and what glibc's allocator keeps.

    python studies/scoring_memory/scoring_memory.py [--tokens 8192] [--chunks 2048 1024]

Qwen2.5-Coder-0.5B-Instruct float32 over a cache of random keys and values (no prefill: the memory of scoring does
not depend on what the cache holds), each (chunk, allocator) in a fresh process; the compiled `kvzip.score` is
called twice. Per run: XLA's temp allocation for the program (memory_analysis), the resident set's peak during
each call minus before it (sampled every 2 ms), and what the first call left resident. Allocators:
  - glibc: the default (per-thread arenas; freed blocks stay in the process for reuse);
  - returning: glibc told to give freed memory back (bench/long_context.py's RETURNING: MALLOC_ARENA_MAX=1,
    MALLOC_MMAP_THRESHOLD_=65536, MALLOC_TRIM_THRESHOLD_=0), so each call's peak is what that call needs.
Writes studies/scoring_memory/results/scoring-memory.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "bench"))  # bench/long_context.py's allocator settings and samplers
from long_context import RETURNING, peak_resident, resident  # noqa: E402

MiB = 1 << 20


def measure(tokens: int, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvzip_jax import cache as kv
    from kvzip_jax import kvzip
    from kvzip_jax.kvzip.scoring import reread_inputs
    from kvzip_jax.weights import registry

    model = registry.load(registry.QWEN, dtype="float32")
    cfg, params = model.cfg, model.params
    prefix, context = 32, tokens - 32
    empty = kv.init_cache(cfg, 1, tokens + 128)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 2 * cfg.num_layers))
    cache = kv.KVCache(
        layers=tuple(
            dataclasses.replace(
                layer,
                k=jax.random.normal(next(keys), layer.k.shape),
                v=jax.random.normal(next(keys), layer.v.shape),
                lengths=jnp.full(layer.lengths.shape, tokens, jnp.int32),
            )
            for layer in empty.layers
        ),
        next_position=jnp.full((1,), tokens, jnp.int32),
    )
    context_ids = np.random.default_rng(0).integers(0, 1000, context)
    reread = reread_inputs(model.tokenizer, [prefix], [context_ids], chunk)  # the real reread prompt around each chunk
    jax.block_until_ready(cache)
    compiled = jax.jit(kvzip.score).lower(params, cfg, cache, reread).compile()
    out = dict(
        tokens=tokens,
        chunk=chunk,
        cache_bytes=kv.nbytes(cache),
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        calls=[],
    )
    for _ in range(2):
        _, seconds, before, peak = peak_resident(lambda: jax.block_until_ready(compiled(params, cfg, cache, reread)))
        out["calls"].append(
            dict(
                seconds=seconds,
                extra_bytes=peak["total"] - before["total"],
                left_bytes=resident()["total"] - before["total"],
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 1024])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one chunk size, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.tokens, args.one)), flush=True)
        return
    rows = []
    for chunk in args.chunks:
        for allocator, env in (("glibc", {}), ("returning", RETURNING)):
            child = subprocess.run(
                [sys.executable, __file__, "--tokens", str(args.tokens), "--one", str(chunk)],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
            )
            if child.returncode:
                sys.exit(f"chunk {chunk} ({allocator}) failed:\n{child.stderr[-3000:]}")
            rows.append(dict(json.loads(child.stdout.strip().splitlines()[-1]), allocator=allocator))
            print(rows[-1], flush=True)
    lines = [
        f"Qwen2.5-Coder-0.5B-Instruct float32, this CPU, kvzip.score over a random cache of {args.tokens:,} "
        "tokens, called twice per process",
        "| chunk | allocator | cache MiB | XLA temp MiB | 1st call extra MiB (% of cache) | left after it MiB | "
        "2nd call extra MiB | 1st call s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        first, second = r["calls"]
        share = 100 * first["extra_bytes"] / r["cache_bytes"]
        lines.append(
            f"| {r['chunk']:,} | {r['allocator']} | {r['cache_bytes'] / MiB:.0f} | "
            f"{r['temp_bytes'] / MiB:.1f} | {first['extra_bytes'] / MiB:.1f} ({share:.0f}%) | "
            f"{first['left_bytes'] / MiB:.1f} | {second['extra_bytes'] / MiB:.1f} | {first['seconds']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = HERE / "results" / "scoring-memory.txt"
    out.write_text(text + "\n" + "\n".join(map(json.dumps, rows)) + "\n")


if __name__ == "__main__":
    main()
