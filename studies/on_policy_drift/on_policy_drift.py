"""How far on-policy Attention Matching drifts from the off-policy fit, layer by layer, on one generated context.

    python studies/on_policy_drift/on_policy_drift.py [--task multi_needle] [--ratio 0.3] [--seed 0]

Compacts one context (Qwen2.5-Coder-0.5B, the task's first context of ~640 tokens) with kvzip-am and its on-policy
twin kvzip-am-op (same budgets), then prints per layer the share of cache slots whose keep flag differs, and how much
one compacted layer (layer 1, off-policy fit) moves the reread's layer-1 update: relative L2 over the reread's rows,
the rows the fit was made for. Layer 0 must agree exactly (nothing precedes it).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

import kvzip_jax
from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, matching, methods, prompts
from kvzip_jax.eval import batches, tasks
from kvzip_jax.matching.queries import reference_passes
from kvzip_jax.models.transformer import apply_block, embed_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="multi_needle")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = kvzip_jax.load(args.model)
    cfg, params = model.cfg, model.params
    items = batches.prepare(model.tokenizer, tasks.generate(args.task, 1, args.seed, 640), prompts.KVZIP_INSTRUCTION)
    batch = batches.padded(items, 1)
    cache = kv.init_cache(cfg, 1, batches.capacity_for(items), jnp.float32)
    _, cache = gen.prefill(params, cfg, [c.ids() for c in batch.contexts], cache)
    prefix_len = np.array([c.context_start for c in batch.contexts], np.int32)
    reread = kvzip.reread_inputs(model.tokenizer, prefix_len, [c.ids()[c.context_slice] for c in batch.contexts])
    on = dataclasses.replace(methods.get("kvzip-am-op").options_for(), ratio=args.ratio)
    off = dataclasses.replace(on, on_policy=False)
    queries = matching.reference_queries(params, cfg, cache, reread, on.sources, on.query_cap, True)
    on_cache, on_counts = matching.compact(params, cfg, cache, reread, on, queries=queries)
    off_cache, off_counts = matching.compact(params, cfg, cache, reread, off, queries=queries)
    print(f"{args.task} seed {args.seed}, ratio {args.ratio}: budgets equal: {bool((on_counts == off_counts).all())}")
    print("layer  slots whose keep flag differs (on- vs off-policy)")
    for i in range(cfg.num_layers):
        differ = float(jnp.mean(on_cache.layers[i].keep != off_cache.layers[i].keep))
        print(f"{i:5d}  {differ:.1%}")

    repeat = reference_passes(cfg, cache, reread, ("repeat",), on.query_cap)[0]
    x = embed_tokens(params["embed"], repeat.tokens, cfg)  # [1, W, D]
    x = apply_block(params, cfg, 0, x, repeat.positions, cache.layers[0], repeat.num_valid)[0]
    full = apply_block(params, cfg, 1, x, repeat.positions, cache.layers[1], repeat.num_valid)[0]
    compacted = apply_block(params, cfg, 1, x, repeat.positions, off_cache.layers[1], repeat.num_valid)[0]
    rows = int(repeat.num_valid[0])
    norm = lambda a: float(jnp.linalg.norm(a[0, :rows]))
    print(
        f"layer 1's update to the reread ({rows} rows), compacted vs full: relative L2 "
        f"{norm(compacted - full) / norm(full - x):.1%}"
    )


if __name__ == "__main__":
    main()
