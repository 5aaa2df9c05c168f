"""Offline per-head budgets for Attention Matching (reference/attention_matching.md §5.2), searched on contexts that
no evaluation uses, and written as the package's budget profile for the model (matching.budgets, budget "profile").

    python studies/budget_search/budget_search.py [--model qwen2.5-coder-0.5b-instruct] [--ratio 0.02] [--contexts 4]
                                                   [--grid 0,0.06,0.2,0.5] [--out kvzip_jax/data/head_budgets]
    python studies/budget_search/budget_search.py --curves kvzip_jax/data/head_budgets/MODEL.json  # no model run

The paper's search, made cheap enough for a CPU: every compacted (layer, KV head) in turn keeps a grid ratio of its
context keys (AM-HAK, off-policy) while every other head keeps the base ratio (--ratio, uniform), and the cost of
each is the mean next-token KL (full || compacted) on the full cache's own answers, teacher-forced, as the sweep
measures it. Off-policy compaction fits each layer to the full cache's reference queries, so one compaction per grid
ratio gives every head's variant (a head is swapped into the base cache). The curves, averaged over contexts, are
taken as additive across heads and the budgets that minimise their sum at the base ratio's total are found exactly
(dynamic programming over the grid, in units of 0.01 of a head's keys). The profile is each head's share of that
total: at another ratio the heads keep the same shares (capped at 0.75 of a head's keys, the excess shared out).

Contexts: the generated tasks (multi_needle, niah, passkey, variable_tracking) with --seed 0, the first question of
each; the held-out sweep judges on --seed 1. The 48 bundled questions are never used.

Outcome on Qwen2.5-Coder-0.5B (docs/attention_matching.md): the additive optimum gave all the budget to
11 of 48 heads; measured whole it lowered the KL at 0.02 by 0.26 on these contexts (0.64 predicted), was no better
than am-hak on the held-out ones, and collapsed at 0.1 and 0.05. The single-head curves do not add up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import matching
from kvzip_jax.eval import batches, sweep, tasks
from kvzip_jax.eval.runner import SharedInputs, Sweep
from kvzip_jax.kvzip.scoring import evictable_layers
from kvzip_jax.matching.budgets import PROFILE_DIR
from kvzip_jax.weights import registry

TASKS = ("multi_needle", "niah", "passkey", "variable_tracking")
PROFILE_UNIT = 0.01  # the searched budgets' step, as a fraction of a head's keys
_compacted = jax.jit(matching.compact_with)


def hybrid(base: kv.KVCache, other: kv.KVCache | None, layer: int, head: int, prefix_len, context_len) -> kv.KVCache:
    """base with one KV head of one layer taken from other (None: that head keeps none of its context keys)."""
    b = base.layers[layer]
    if other is None:
        slots = jnp.arange(b.keep.shape[-1])
        in_context = (slots >= prefix_len[:, None]) & (slots < (prefix_len + context_len)[:, None])  # [B, C]
        new = dataclasses.replace(b, keep=b.keep.at[:, head].set(b.keep[:, head] & ~in_context))
    else:
        o = other.layers[layer]
        new = dataclasses.replace(
            b,
            v=b.v.at[:, head].set(o.v[:, head]),
            keep=b.keep.at[:, head].set(o.keep[:, head]),
            bias=b.bias.at[:, head].set(o.bias[:, head]),
        )
    return dataclasses.replace(base, layers=base.layers[:layer] + (new,) + base.layers[layer + 1 :])


def allocate(cost: np.ndarray, grid_units: list[int], total: int) -> np.ndarray:
    """Per head, the grid units minimising the summed cost [heads, grid] with `total` units in all (DP): all of it,
    as a compaction spends its whole budget."""
    heads = cost.shape[0]
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((heads, total + 1), np.int64)
    for h in range(heads):
        nxt = np.full(total + 1, np.inf)
        for g, units in enumerate(grid_units):
            if units > total:
                continue
            shifted = np.full(total + 1, np.inf)
            shifted[units:] = best[: total + 1 - units] + cost[h, g]
            better = shifted < nxt
            nxt[better], choice[h, better] = shifted[better], g
        best = nxt
    if not np.isfinite(best[total]):
        raise ValueError(f"no choice of the grid's units {grid_units} sums to {total}")
    units_left = total
    picked = np.zeros(heads, np.int64)
    for h in reversed(range(heads)):
        g = choice[h, units_left]
        picked[h] = grid_units[g]
        units_left -= grid_units[g]
    return picked


def measure(args, grid: list[float]):
    """(model name, compacted layers, KV heads, per-task costs [tasks, heads, grid]): the mean next-token KL with one
    head at each grid ratio and the others at args.ratio."""
    model = registry.load(args.model, dtype="float32")
    cfg = model.cfg
    config = sweep.SweepConfig(methods=("am-hak",), ratios=(args.ratio,), batch_size=args.contexts)
    examples = [ex for name in TASKS for ex in tasks.generate(name, args.contexts, args.seed, args.context_tokens)]
    examples = [dataclasses.replace(ex, questions=ex.questions[:1], answers=ex.answers[:1]) for ex in examples]
    items = batches.prepare(model.tokenizer, examples, config.instruction)
    capacity = batches.capacity_for(items)
    runner = Sweep(model, config, results=None)
    layers = evictable_layers(cfg)
    heads = [(i, h) for i in layers for h in range(cfg.num_kv_heads)]
    cost = np.zeros((len(TASKS), len(heads), len(grid)))
    start = time.perf_counter()
    for t, group in enumerate(batches.groups_of(items, args.contexts)):
        batch = batches.padded(group, args.contexts)
        prefix_len = np.array([c.context_start for c in batch.contexts], np.int32)
        context_len = np.array([c.context_end - c.context_start for c in batch.contexts], np.int32)
        empty = kv.init_cache(cfg, batch.size, capacity, jnp.float32)
        _, cache = gen.prefill(runner.params, cfg, [c.ids() for c in batch.contexts], empty)
        full = runner._full_answers(batch, cache)
        shared = SharedInputs(runner, batch, cache)
        compacted = {
            r: _compacted(
                shared._field("queries"),
                cfg,
                cache,
                shared._field("reread"),
                matching.MatchingConfig(ratio=r, budget="uniform"),
            )[0]
            for r in grid
            if r > 0
        }
        base = compacted[args.ratio]

        def kl_of(c):
            got = runner._compressed_answers(batch, c, [0], full)[0]
            return float(np.mean(got["kl"][: len(batch.examples)]))

        base_kl = kl_of(base)
        for j, (i, h) in enumerate(heads):
            for g, r in enumerate(grid):
                cost[t, j, g] = (
                    base_kl
                    if r == args.ratio
                    else kl_of(hybrid(base, compacted.get(r), i, h, jnp.asarray(prefix_len), jnp.asarray(context_len)))
                )
            print(
                f"{batch.examples[0].task} L{i}H{h}: " + " ".join(f"{r}:{c:.3f}" for r, c in zip(grid, cost[t, j])),
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        print(f"{batch.examples[0].task}: base KL {base_kl:.3f}", flush=True)
    return model.name, list(layers), cfg.num_kv_heads, cost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--ratio", type=float, default=0.02, help="the base ratio every other head keeps")
    parser.add_argument("--grid", default="0,0.06,0.2,0.5", help="the ratios one head is tried at, beside the base")
    parser.add_argument("--contexts", type=int, default=4, help="contexts per task")
    parser.add_argument("--context-tokens", type=int, default=640)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--curves",
        metavar="JSON",
        help="allocate again from the curves of a profile written "
        "before (its model, ratio and grid), without measuring",
    )
    parser.add_argument("--out", default=str(PROFILE_DIR))
    args = parser.parse_args()
    if args.curves:
        saved = json.loads(Path(args.curves).read_text())
        name, layers, kv_heads, ratio, grid = (saved[k] for k in ("model", "layers", "kv_heads", "base_ratio", "grid"))
        delta = np.asarray(saved["delta_kl"], np.float64).reshape(len(layers) * kv_heads, len(grid))
        settings = {
            k: saved[k]
            for k in ("base_ratio", "grid", "tasks", "seed", "contexts_per_task", "context_tokens", "command")
        }
    else:
        grid = sorted({args.ratio, *(float(r) for r in args.grid.split(","))})
        ratio = args.ratio
        name, layers, kv_heads, cost = measure(args, grid)
        delta = (cost - cost[:, :, [grid.index(ratio)]]).mean(0)  # [heads, grid], averaged over tasks
        settings = {
            "base_ratio": ratio,
            "grid": grid,
            "tasks": list(TASKS),
            "seed": args.seed,
            "contexts_per_task": args.contexts,
            "context_tokens": args.context_tokens,
            "command": "python studies/budget_search/budget_search.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "curves")),
        }
    grid_units = [round(r / PROFILE_UNIT) for r in grid]
    picked = allocate(delta, grid_units, round(ratio * len(delta) / PROFILE_UNIT))
    shape = (len(layers), kv_heads)
    payload = {
        "model": name,
        **settings,
        "layers": layers,
        "kv_heads": kv_heads,
        "profile": (picked / picked.sum()).reshape(shape).round(6).tolist(),
        "kept_units": picked.reshape(shape).tolist(),
        "delta_kl": delta.reshape(shape + (len(grid),)).round(5).tolist(),
    }
    out = Path(args.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(out)
    predicted = sum(delta[j, grid_units.index(u)] for j, u in enumerate(picked))
    print(
        f"kept per head (units of {PROFILE_UNIT} of its keys): {picked.tolist()}; predicted KL change "
        f"{predicted:+.3f} against uniform {ratio}"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
