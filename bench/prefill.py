"""Prefill time of kvzip-jax vs transformers (sdpa) on SmolLM2, same process, same thread count.

    python bench/prefill.py [--lengths 1024 4096] [--repeats 3]

Prints, per context length: best-of-N wall time of each, their ratio (JAX / transformers; <= 1.0 means JAX is at
least as fast), and achieved GFLOP/s of each against a plain 2048^3 float32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from kvzip_jax import generate as gen
from kvzip_jax.models.flops import prefill_flops
from kvzip_jax.weights import registry
from kvzip_jax.weights.gguf import params_from_gguf


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (compilation for JAX)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak(repeats: int) -> tuple[float, float]:
    """GFLOP/s of a 2048^3 float32 matmul in JAX and in torch."""
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    jmm = jax.jit(lambda x: x @ x)
    t_jax = best_time(lambda: jmm(a).block_until_ready(), 3 * repeats)
    ta = torch.from_numpy(np.array(a))
    t_torch = best_time(lambda: ta @ ta, 3 * repeats)
    return 2 * n**3 / t_jax / 1e9, 2 * n**3 / t_torch / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=gen.DEFAULT_CHUNK)
    args = parser.parse_args()

    threads = os.cpu_count()
    torch.set_num_threads(threads)
    gguf = registry.bundled_gguf(registry.SMOLLM2)
    cfg, params = params_from_gguf(gguf)
    params = jax.tree.map(jnp.asarray, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()

    peak_jax, peak_torch = matmul_peak(args.repeats)
    print(
        f"SmolLM2-135M float32, {threads} threads (torch.set_num_threads and XLA's pool), jax {jax.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(f"2048^3 matmul: JAX {peak_jax:.0f} GFLOP/s, torch {peak_torch:.0f} GFLOP/s")
    print(
        f"{'tokens':>7} {'jax s':>7} {'torch s':>8} {'jax/torch':>10} {'jax GF/s':>9} {'torch GF/s':>11} "
        f"{'jax %peak':>10} {'torch %peak':>12}"
    )
    rng = np.random.default_rng(0)
    for n in args.lengths:
        tokens = rng.integers(0, cfg.vocab_size, (1, n)).astype(np.int32)
        capacity = gen.capacity_for(n, cfg)

        def run_jax():
            logits, _ = gen.prefill(params, cfg, tokens, capacity=capacity, chunk=args.chunk)
            logits.block_until_ready()

        def run_torch():
            with torch.no_grad():
                model(torch.from_numpy(tokens).long(), logits_to_keep=1)

        t_jax = best_time(run_jax, args.repeats)
        t_torch = best_time(run_torch, args.repeats)
        flops = prefill_flops(cfg, n)
        gf_jax, gf_torch = flops / t_jax / 1e9, flops / t_torch / 1e9
        print(
            f"{n:>7} {t_jax:>7.2f} {t_torch:>8.2f} {t_jax / t_torch:>10.2f} {gf_jax:>9.0f} {gf_torch:>11.0f} "
            f"{gf_jax / peak_jax:>10.0%} {gf_torch / peak_torch:>12.0%}"
        )


if __name__ == "__main__":
    main()
