"""What scoring without a reread costs, side by side in one run: a plain prefill; the same prefill with a trained
scorer on every layer (generate.prefill_observed: KVzap's linear regressor, Fast KVzip's gate); and KVzip's
prefill + reread scoring, on the same contexts.

    python bench/scorer_speed.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 2048 4096] [--repeats 2]

The scorers' weights are random of the trained shapes (the time does not depend on their values). Contexts: the
bundled demo document cut to exactly N tokens (bench/kvzip.py's context_text), batch 1, the model's dtype on this
backend. Compilation is excluded (every pass runs once before); the repeats go round the passes, each round
starting one pass later. Prints, per length, each pass's best and median seconds and their multiples of the plain
prefill's (the target: a scorer's at most 1.05x), and, for the prefill with and without each scorer, the
floating-point operations XLA counts in one 512-token chunk step over that context's cache (compiled cost
analysis: no timing noise; XLA counts a loop's body once, so the plain step's blocked attention is undercounted while
the scorers, outside any loop, are counted whole: the multiples are upper bounds).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from kvzip import context_text  # bench/kvzip.py

from kvzip_jax import cache as kv
from kvzip_jax import dtypes, kvzip, prompts
from kvzip_jax import generate as gen
from kvzip_jax.scorers import gate
from kvzip_jax.scorers.features import ScorerObserver, prefill_scores
from kvzip_jax.scorers.scorer import Scorer
from kvzip_jax.weights import registry


def random_scorers(cfg) -> dict[str, Scorer]:
    """A linear scorer and a gate of the model's shapes, random."""
    L, D, K = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads
    rng = np.random.default_rng(0)
    linear = {"w": rng.normal(size=(L, D, K)).astype(np.float32), "b": np.zeros((L, K), np.float32)}
    config = gate.GateConfig(L, D, K, cfg.num_heads // K)
    return {
        "linear": Scorer(jax.tree.map(jax.numpy.asarray, linear), "linear"),
        "gate": Scorer(gate.init_gates(config, jax.random.key(0)), "gate", config),
    }


def chunk_flops(params, cfg, capacity: int, observer=None) -> float:
    """XLA's counted floating-point operations of one prefill chunk step (gen.DEFAULT_CHUNK tokens, batch 1) over a
    cache of `capacity` slots: generate.forward_step, or generate.observed_step with the observer."""
    cache = kv.init_cache(cfg, 1, capacity, dtypes.of_params(params))
    block = jax.numpy.zeros((1, gen.DEFAULT_CHUNK), jax.numpy.int32)  # [B, T]
    num_new = jax.numpy.full((1,), gen.DEFAULT_CHUNK, jax.numpy.int32)  # [B]
    if observer is None:
        lowered = gen.forward_step.lower(params, block, num_new, cache, cfg)
    else:
        lowered = gen.observed_step.lower(params, block, num_new, cache, cfg, observer)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list of one dict in older jax
    return float(cost["flops"])


def pass_times(passes: dict, repeats: int) -> dict[str, list[float]]:
    """{name: wall seconds of each of `repeats` calls} of {name: fn}, each called once first (compiling). Each round
    calls every pass once, starting one pass later than the round before, so neither a slow spell of the machine nor
    the pass that runs just before (KVzip's reread frees gigabytes) falls on one pass alone."""
    for fn in passes.values():
        jax.block_until_ready(fn())
    names = list(passes)
    seconds = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            jax.block_until_ready(passes[name]())
            seconds[name].append(time.perf_counter() - start)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    model = registry.load(args.model)
    tok, params, cfg = model.tokenizer, model.params, model.cfg
    scorers = random_scorers(cfg)
    score = jax.jit(kvzip.score)
    print(f"{model.name} on {jax.devices()[0].platform}, {model.dtype}, batch 1")
    for n in args.tokens:
        prompt, _ = prompts.split_for_reuse(tok, context_text(tok, n), [])
        ids = np.asarray(prompt.ids(), np.int32)
        row = ids[prompt.context_slice]
        reread = kvzip.reread_inputs(tok, [prompt.context_start], [row])

        def kvzip_pass():
            _, fresh = gen.prefill(params, cfg, [ids], reserve=0)
            return score(params, cfg, fresh, reread)

        passes = {"prefill": lambda: gen.prefill(params, cfg, [ids], reserve=0)}
        for kind, scorer in scorers.items():
            passes[f"prefill + {kind} scorer"] = lambda s=scorer: prefill_scores(params, cfg, [ids], s, reserve=0)
        passes["prefill + KVzip reread"] = kvzip_pass
        times = pass_times(passes, args.repeats)
        best = {name: min(t) for name, t in times.items()}
        median = {name: float(np.median(t)) for name, t in times.items()}
        print(f"\n{len(ids)} tokens ({len(row)} context): best and median of {args.repeats}")
        for name in times:
            print(
                f"  {name:<26} {best[name]:7.2f} s  {best[name] / best['prefill']:5.2f}x"
                f"   median {median[name]:7.2f} s  {median[name] / median['prefill']:5.2f}x"
            )
        capacity = gen.capacity_for(len(ids), cfg)
        flops = chunk_flops(params, cfg, capacity)
        print(f"  XLA-counted FLOPs of one {gen.DEFAULT_CHUNK}-token chunk step over {capacity} slots (a loop's body")
        print("  counted once, so the blocked attention is undercounted and each multiple is an upper bound):")
        print(f"  {'prefill':<26} {flops:10.4g}")
        for kind, scorer in scorers.items():
            counted = chunk_flops(params, cfg, capacity, ScorerObserver(scorer))
            print(f"  {'prefill + ' + kind + ' scorer':<26} {counted:10.4g}  at most {counted / flops:6.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
