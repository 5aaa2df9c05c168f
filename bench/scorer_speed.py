"""What scoring without a reread costs, side by side in one run: a plain prefill; the same prefill with a trained
scorer on every layer (generate.prefill_observed: KVzap's linear regressor, Fast KVzip's gate); and KVzip's
prefill + reread scoring, on the same contexts.

    python bench/scorer_speed.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 2048 4096] [--repeats 2]

The scorers' weights are random of the trained shapes (the time does not depend on their values). Contexts: the
bundled demo document cut to exactly N tokens (bench/kvzip.py's context_text), batch 1, the model's dtype on this
backend. Compilation is excluded (every pass runs once before); times are best of --repeats, taken round the
passes in turn. Prints, per length, each pass's seconds and its multiple of the plain prefill (the target: a
scorer's at most 1.05x).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from kvzip import context_text  # bench/kvzip.py

from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.scorers import gate
from kvzip_jax.scorers.features import prefill_scores
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


def best_times(passes: dict, repeats: int) -> dict[str, float]:
    """{name: best wall seconds of `repeats` calls} of {name: fn}, each called once first (compiling); the repeats
    go round the passes in turn, so a slow spell of the machine falls on every pass alike."""
    for fn in passes.values():
        jax.block_until_ready(fn())
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(repeats):
        for name, fn in passes.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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
    print(f"{model.name} on {jax.devices()[0].platform}, {model.dtype}, batch 1, best of {args.repeats}")
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
        times = best_times(passes, args.repeats)
        plain = times["prefill"]
        print(f"\n{len(ids)} tokens ({len(row)} context):")
        for name, seconds in times.items():
            print(f"  {name:<26} {seconds:7.2f} s  {seconds / plain:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
