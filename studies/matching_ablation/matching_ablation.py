"""Which part of the Attention Matching fit costs KL at extreme ratios: the same sweep as `kvzip-jax eval`, with
variants of the fit registered as extra methods beside KVzip and am-hak.

    python studies/matching_ablation/matching_ablation.py [--tasks multi_needle] [--ratios 1,0.1,0.05] [--contexts 6]
                                                          [--context-tokens 640] [--out runs/am-ablation]

Variants (MatchingConfig choices). Of the fit: am-hak-r1 (values shrunk towards the kept ones, value_ridge 1),
am-hak-r1e4 (value_ridge 1e4: the kept values themselves, only beta fitted), kvzip-am-r1 (KVzip's selection,
value_ridge 1), am-hak-nb and kvzip-am-nb (fit_bias off: beta = 0, only the values fitted). Of the budgets:
am-hak-kb-cap0.75 (HAK's keys, budgets ranked by KVzip's scores instead of the reference queries' attention),
am-hak-kb-cap0.4 and am-hak-kb-cap0.2 (the same, a head keeping at most 0.4 or 0.2 of its keys instead of 0.75),
kvzip-am-cap1 (KVzip's own top-k with no head cap: KVzip's kept pairs, the AM fit), am-hak-cap1 (the default
budgets, ranked by the reference queries' attention, with no head cap). The product's methods am-hak, kvzip-am and
am-hak-kb (HAK's keys in KVzip's uncapped budgets) run beside them. Not run by default, the earlier default caps
(4x a head's uniform count) as fractions: kvzip-am-op-cap0.4 / -cap0.2 / -cap0.08 (for ratios 0.1 / 0.05 / 0.02),
kvzip-am-cap0.08 and am-hak-op-cap0.08; and KVzip's own kept pairs (kvzip-am-cap1's) under parts of the fit:
kvzip-am-cap1-r1e-2 / -r1e-1 / -r1 / -r10 / -r1e4 (value_ridge 0.01 to 1e4: from the least-squares values to the kept
ones), kvzip-am-cap1-nb (beta = 0, values fitted) and kvzip-am-cap1-nb-r1e4 (beta = 0, the kept values: KVzip's
eviction, less the pairs a bias' bytes would pay for); am-hak-cap1-nb-r1e4 likewise evicts by am-hak-cap1's keys
and budgets. --fit-sources self-study (or context, ...) fits every AM method to the queries of those sources
(matching.queries) in place of the reread's (KVzip's scores, so KVzip's own keys and budgets, still come from the
reread); --fit-sources oracle takes instead each question followed by the full cache's answer, teacher-forced on top
of the cache: a query-aware upper bound for key selection, budgets and fit, not a method. The report is the sweep's
(summary.md, scores.png in --out).

Results folders (studies/matching_ablation/results/), each run by the code of the commit that added it:
am-fit-ablation-640 (the fit variants, when budgets were ranked by KVzip's scores and a head capped at 4x its uniform
count), am-head-cap-640 (that 4x cap against none: its am-hak-cap20 / kvzip-am-cap20), am-budgets-640 (ratios 0.1 and
0.05: its am-hak is am-hak-kb-cap0.75 here, its am-hak-attn today's am-hak, its am-hak-cap0.4 / -cap0.2 the -kb-cap
variants), am-quality-cap (the 48 questions at 0.3: `--tasks '' --jsonl bench/results/quality.jsonl --methods
kvzip,kvzip-am-cap1,am-hak-kb,am-hak-cap1 --ratios 1,0.3`; its am-hak-kb-cap1 is today's am-hak-kb), am-op-seed0
(kvzip-am-op re-measured on the seed-0 contexts: `--tasks multi_needle`, then `--tasks passkey,niah`, `--methods
kvzip,kvzip-am-op-cap0.08 --ratios 1,0.02`; `--tasks multi_needle,passkey,niah --methods kvzip-am-op-cap0.2 --ratios
1,0.05`; `--methods kvzip-am-op-cap0.4 --ratios 1,0.1`; `--contexts 2 --methods kvzip-am,kvzip-am-op --ratios
1,0.3,0.1`), am-cap0.08-seed1 (`--seed 1 --tasks multi_needle,passkey,niah --methods
kvzip,kvzip-am-op-cap0.08,kvzip-am-cap0.08,am-hak-op-cap0.08 --ratios 1,0.02`, stopped during passkey), am-fit-002-seed1
(`--seed 1 --tasks multi_needle,passkey,niah --methods
kvzip,kvzip-am-cap1,kvzip-am-cap1-r1e4,kvzip-am-cap1-nb,kvzip-am-cap1-nb-r1e4 --ratios 1,0.02`, then `--methods
kvzip,kvzip-am-cap1-r1e-2,kvzip-am-cap1-r1e-1,kvzip-am-cap1-r1,kvzip-am-cap1-r10`, the same flags otherwise),
am-fit-seed0 (`--tasks multi_needle,passkey,niah --methods kvzip,kvzip-am-cap1,kvzip-am-cap1-r1,kvzip-am-cap1-r1e4
--ratios 1,0.05,0.02`), am-ss-fit-002-seed1 (`--seed 1 --tasks multi_needle,passkey,niah --methods
kvzip,kvzip-am-cap1,kvzip-am-cap1-r1 --ratios 1,0.02 --fit-sources self-study`; run as --fit-self-study-only, the same
code before it took other sources), am-ctx-fit-002-seed1 (the same with `--fit-sources context`), am-oracle-002-seed1
(`--seed 1 --tasks multi_needle,passkey,niah --methods kvzip,kvzip-am-cap1,kvzip-am-cap1-r1,am-hak-cap1,am-hak-kb
--ratios 1,0.02 --fit-sources oracle`), am-hak-ss-002-seed1 (`--methods kvzip,am-hak-cap1,am-hak,am-hak-kb --fit-sources
self-study`, the flags otherwise as am-oracle-002-seed1's: HAK's keys, budgets and fit from the self-study turns alone),
am-oracle-evict-002-seed1 (`--methods kvzip,am-hak-cap1-nb-r1e4 --fit-sources oracle`: the oracle's HAK keys and
budgets, evicting).
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from kvzip_jax import cli, matching, methods
from kvzip_jax.eval import runner


def _choices(name: str) -> dict:
    """A registered Attention Matching method's MatchingConfig choices (methods registry)."""
    return methods.get(name).option_defaults()


HAK_KVZIP_BUDGETS = dict(selector="hak", budget_scores="kvzip")
VARIANTS = {
    "am-hak-r1": dict(selector="hak", value_ridge=1.0),
    "am-hak-r1e4": dict(selector="hak", value_ridge=1e4),
    "kvzip-am-r1": dict(_choices("kvzip-am"), value_ridge=1.0),
    "am-hak-nb": dict(selector="hak", fit_bias=False),
    "kvzip-am-nb": dict(_choices("kvzip-am"), fit_bias=False),
    "am-hak-kb-cap0.75": HAK_KVZIP_BUDGETS,
    "am-hak-kb-cap0.4": dict(HAK_KVZIP_BUDGETS, head_cap=0.4),
    "am-hak-kb-cap0.2": dict(HAK_KVZIP_BUDGETS, head_cap=0.2),
    "kvzip-am-cap1": dict(_choices("kvzip-am"), head_cap=1.0),
    "am-hak-cap1": dict(selector="hak", head_cap=1.0),
}
KVZIP_PAIRS_FIT = {  # KVzip's own kept pairs (its keys, its uncapped budgets) under parts of the fit, for 0.02
    **{
        f"kvzip-am-cap1-r{r}": dict(VARIANTS["kvzip-am-cap1"], value_ridge=float(r))
        for r in ("1e-2", "1e-1", "1", "10", "1e4")
    },
    "kvzip-am-cap1-nb": dict(VARIANTS["kvzip-am-cap1"], fit_bias=False),
    "kvzip-am-cap1-nb-r1e4": dict(VARIANTS["kvzip-am-cap1"], fit_bias=False, value_ridge=1e4),
}
HAK_PAIRS_KEPT = {  # am-hak-cap1's keys and budgets, kept values, no bias: eviction by HAK (for --fit-sources oracle)
    "am-hak-cap1-nb-r1e4": dict(VARIANTS["am-hak-cap1"], fit_bias=False, value_ridge=1e4),
}
CAP_4X = {  # the earlier default, a head capped at 4x its uniform count, as a fraction at ratios 0.1, 0.05, 0.02
    "kvzip-am-op-cap0.4": dict(_choices("kvzip-am-op"), head_cap=0.4),
    "kvzip-am-op-cap0.2": dict(_choices("kvzip-am-op"), head_cap=0.2),
    "kvzip-am-op-cap0.08": dict(_choices("kvzip-am-op"), head_cap=0.08),
    "kvzip-am-cap0.08": dict(_choices("kvzip-am"), head_cap=0.08),
    "am-hak-op-cap0.08": dict(_choices("am-hak-op"), head_cap=0.08),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tasks", default="multi_needle")
    parser.add_argument("--methods", default="kvzip,am-hak,kvzip-am," + ",".join(VARIANTS))
    parser.add_argument("--ratios", default="1,0.1,0.05")
    parser.add_argument("--contexts", default="6")
    parser.add_argument("--context-tokens", default="640")
    parser.add_argument("--seed", default="0", help="the generated tasks' seed (1: the held-out contexts)")
    parser.add_argument("--batch-size", default="8", help="contexts per batch")
    parser.add_argument("--questions-per-context", help="ask only the first N questions of each context")
    parser.add_argument("--out", default="runs/am-ablation")
    parser.add_argument("--jsonl", help="a JSONL task as well (--tasks '' for it alone)")
    parser.add_argument(
        "--fit-sources",
        help="the reference query sources the fit takes (comma-separated, among "
        f"{matching.SOURCES}; KVzip's scores still from the reread; HAK selects on them too), or "
        "oracle alone: the questions and the full cache's answers, teacher-forced on top of the "
        "cache, a query-aware upper bound",
    )
    args = parser.parse_args()
    fit_sources = tuple(args.fit_sources.split(",")) if args.fit_sources else None
    oracle = fit_sources == ("oracle",)
    if oracle:  # an upper bound: the fit (and HAK) sees the questions and the full answers
        runner.Sweep._full_answers = _keeping_oracle_probes(runner.Sweep._full_answers)
    elif fit_sources and set(fit_sources) - set(matching.SOURCES):
        parser.error(f"--fit-sources must be among {matching.SOURCES}, or oracle alone; got {args.fit_sources}")
    if fit_sources:  # the oracle probes go on top of the cache as self-study turns do
        sources = ("self-study",) if oracle else fit_sources
        runner.SharedInputs._queries = functools.partialmethod(_fit_queries, sources, oracle)
    extra = {**VARIANTS, **CAP_4X, **KVZIP_PAIRS_FIT, **HAK_PAIRS_KEPT}
    for name, choices in extra.items():  # method name -> MatchingConfig choices, registered as the product's own
        methods.register(methods.compaction.attention_matching(name, "matching_ablation variant", **choices))
    return cli.main(
        [
            "eval",
            "--model",
            args.model,
            "--tasks",
            args.tasks,
            "--contexts",
            args.contexts,
            "--context-tokens",
            args.context_tokens,
            "--batch-size",
            args.batch_size,
            "--methods",
            args.methods,
            "--ratios",
            args.ratios,
            "--seed",
            args.seed,
            "--no-progress",
            "--out",
            args.out,
        ]
        + (["--jsonl", args.jsonl] if args.jsonl else [])
        + (["--questions-per-context", args.questions_per_context] if args.questions_per_context else [])
        + (["--self-study"] if fit_sources and "self-study" in fit_sources else [])
    )


def _keeping_oracle_probes(full_answers):
    """Sweep._full_answers that also keeps, on the sweep, the batch's questions each followed by the full cache's
    answer as matching.Probes (one per question), for an oracle fit: query-aware, an upper bound, not a method."""

    def wrapped(self, batch, cache):
        full = full_answers(self, batch, cache)
        self.oracle_probes = matching.self_study.probes_from_rows(
            [
                [
                    np.concatenate([q, np.asarray(full[i]["draft"][b], np.int32)])
                    for b, q in enumerate(batch.question_rows(i))
                ]
                for i in sorted(full)
            ]
        )  # [P][B] token rows
        return full

    return wrapped


def _fit_queries(shared, sources: tuple[str, ...], oracle: bool = False) -> matching.ReferenceQueries:
    """The sweep's shared reference queries with the rows of `sources` only, and KVzip's scores from the reread (in
    place of runner.SharedInputs._queries, computed once per batch). oracle: the self-study rows are the oracle
    probes' (this pass only: the methods' inputs carry no probes, so an on-policy method's passes stay the reread's)."""
    cap = matching.MatchingConfig().query_cap
    inputs = (shared._sweep.params, shared._sweep.model.cfg, shared._cache, shared._field("reread"))
    scores = runner._reference_queries(*inputs, ("repeat",), cap, with_scores=True).kvzip_scores
    probes = shared._sweep.oracle_probes if oracle else shared._field("probes")
    rows = runner._reference_queries(*inputs, sources, cap, probes=probes)
    return matching.ReferenceQueries(q=rows.q, valid=rows.valid, kvzip_scores=scores, self_study=rows.self_study)


if __name__ == "__main__":
    sys.exit(main())
