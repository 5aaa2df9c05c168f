"""Sweep throughput: contexts per second, batched vs one by one, measured side by side in one run.

    python bench/sweep.py [--model smollm2-135m-instruct] [--task passkey] [--contexts 8] [--context-tokens 1000]
                          [--batch-size 8] [--methods kvzip,snapkv] [--ratios 0.3] [--random-weights]

The same examples run through the full sweep (prefill, scoring per method, every question answered from every
compressed cache, teacher-forced KL) once with --batch-size contexts per jitted call and once with one. Each
setting runs twice into a fresh results file and the second run is timed, so compilation is excluded.
--random-weights keeps the checkpoint's config and tokenizer but draws random params: a timing-only run for
machines without the converted weights (answers then run to their full length, the slowest case).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax

from kvzip_jax import sharding
from kvzip_jax.eval import tasks
from kvzip_jax.eval.sweep import SweepConfig, run_sweep
from kvzip_jax.weights import registry


def timed_sweep(model, examples, config) -> float:
    """Seconds of the second of two identical sweeps (the first compiles)."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            run_sweep(model, examples, config, Path(tmp) / "results.jsonl", progress=False)
            seconds = time.perf_counter() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=registry.SMOLLM2)
    parser.add_argument("--task", default="passkey", choices=sorted(tasks.TASKS))
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--methods", default="kvzip,snapkv")
    parser.add_argument("--ratios", default="0.3")
    parser.add_argument("--random-weights", action="store_true")
    args = parser.parse_args()

    model = registry.load_random(args.model) if args.random_weights else registry.load(args.model)
    examples = tasks.generate(args.task, args.contexts, 0, args.context_tokens)
    common = dict(methods=tuple(args.methods.split(",")), ratios=tuple(float(r) for r in args.ratios.split(",")))
    print(
        f"{model.name} on {jax.devices()[0].platform} x{len(jax.devices())} ({sharding.data_mesh().size} "
        f"in the mesh); {args.contexts} {args.task} contexts of ~{args.context_tokens} tokens, "
        f"{sum(len(e.questions) for e in examples)} questions; methods {args.methods}; ratios {args.ratios}"
        + ("; random weights" if args.random_weights else "")
    )
    batched = timed_sweep(model, examples, SweepConfig(batch_size=args.batch_size, **common))
    single = timed_sweep(model, examples, SweepConfig(batch_size=1, **common))
    print("| setting | seconds | contexts/s |\n|---|---|---|")
    print(f"| batch of {args.batch_size} | {batched:.1f} | {args.contexts / batched:.3f} |")
    print(f"| one by one | {single:.1f} | {args.contexts / single:.3f} |")
    print(f"batched speed-up: {single / batched:.2f}x")


if __name__ == "__main__":
    main()
