"""Which part of the Attention Matching fit costs KL at extreme ratios: the same sweep as `kvzip-jax eval`, with
variants of the fit registered as extra methods beside KVzip and am-hak.

    python bench/matching_ablation.py [--tasks multi_needle] [--ratios 1,0.1,0.05] [--contexts 6]
                                      [--context-tokens 640] [--out runs/am-ablation]

Variants (MatchingConfig choices): am-hak-r1 (values shrunk towards the kept ones, value_ridge 1), am-hak-r1e4
(value_ridge 1e4: the kept values themselves, only beta fitted), kvzip-am-r1 (KVzip's selection, value_ridge 1),
am-hak-nb and kvzip-am-nb (fit_bias off: beta = 0, only the values fitted), am-hak-cap20 and kvzip-am-cap20 (a
head may keep up to 20x the uniform count, instead of 4x: at 0.05 no cap, as KVzip's own global top-k). kvzip-am (KVzip's selection with
the full fit) is one of the product's methods. The report is the sweep's (summary.md, scores.png in --out).
"""

from __future__ import annotations

import argparse
import sys

from kvzip_jax import cli, matching
from kvzip_jax.eval import sweep

VARIANTS = {
    "am-hak-r1": dict(selector="hak", value_ridge=1.0),
    "am-hak-r1e4": dict(selector="hak", value_ridge=1e4),
    "kvzip-am-r1": dict(selector="kvzip", value_ridge=1.0),
    "am-hak-nb": dict(selector="hak", fit_bias=False),
    "kvzip-am-nb": dict(selector="kvzip", fit_bias=False),
    "am-hak-cap20": dict(selector="hak", head_cap=20.0),
    "kvzip-am-cap20": dict(selector="kvzip", head_cap=20.0),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tasks", default="multi_needle")
    parser.add_argument("--methods", default="kvzip,am-hak,kvzip-am," + ",".join(VARIANTS))
    parser.add_argument("--ratios", default="1,0.1,0.05")
    parser.add_argument("--contexts", default="6")
    parser.add_argument("--context-tokens", default="640")
    parser.add_argument("--out", default="runs/am-ablation")
    args = parser.parse_args()
    matching.METHODS.update(VARIANTS)  # method name -> MatchingConfig choices, as the product's own methods
    sweep.METHODS = sweep.METHODS + tuple(VARIANTS)
    return cli.main(["eval", "--model", args.model, "--tasks", args.tasks, "--contexts", args.contexts,
                     "--context-tokens", args.context_tokens, "--batch-size", "8", "--methods", args.methods,
                     "--ratios", args.ratios, "--no-progress", "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
