"""Attention Matching at extreme ratios against the number of self-study queries it is fitted to (issue 38 item 4).

    python studies/self_study_scale/self_study_scale.py --model qwen2.5-coder-1.5b-instruct [--counts 0,1024,4096,16384]
        [--samples 6] [--tokens 192] [--tasks passkey,niah,multi_needle,variable_tracking] [--jsonl FILE]
        [--contexts 1] [--questions-per-context 3] [--ratios 1,0.05,0.02] [--out runs/self-study-scale]

One `kvzip-jax eval --self-study` sweep: per context the model writes `--samples` turns to each of the three
self-study prompts (matching.self_study.PROMPTS, up to `--tokens` tokens each, all turns in one batch under one
jitted decode loop), and one reference pass captures KVzip's reread and those turns, up to the largest count of
self-study queries per KV head and layer (a query is one token row of one query head; the reread's rows are all
captured). Methods: kvzip, and for every count N of --counts am-hak-ssN and am-hak-kb-ssN, Attention Matching (HAK's
keys; budgets from the reference queries' attention, or KVzip's per-head budgets) fitted to the reread plus N
self-study queries evenly spaced among those captured (MatchingConfig.self_study_queries; N = 0 is the reread
alone, the product's am-hak / am-hak-kb). The self-study rows each context really had are written to
OUT/self_study_rows.json (turns that stop early give fewer than the largest count). The query-aware upper bound
runs beside it with studies/matching_ablation (`--fit-sources oracle`, the same contexts).

    python studies/self_study_scale/self_study_scale.py --curve --out DIR [--oracle ORACLE_DIR]

writes DIR/curve.md and DIR/curve.png from the sweep's results: per ratio, the normalised score (all tasks pooled,
95% bootstrap interval over contexts) and the mean KL of am-hak and am-hak-kb against the number of self-study
queries, KVzip's (and the oracle's, from ORACLE_DIR's am-hak-cap1 and am-hak-kb) beside them, and per task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvzip_jax import cli, methods
from kvzip_jax.eval import report, runner

SOURCES = ("repeat", "self-study")


def variants(counts: list[int]) -> dict[str, dict]:
    """Method name -> MatchingConfig choices: am-hak and am-hak-kb fitted to N self-study queries, per count N."""
    out = {}
    for n in counts:
        for name in ("am-hak", "am-hak-kb"):
            out[f"{name}-ss{n}"] = dict(methods.get(name).option_defaults(), sources=SOURCES, self_study_queries=n)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--counts", default="0,1024,4096,16384", help="self-study queries per KV head and layer")
    parser.add_argument("--samples", type=int, default=6, help="turns per self-study prompt and context")
    parser.add_argument("--tokens", type=int, default=192, help="most tokens of a self-study answer")
    parser.add_argument("--tasks", default="passkey,niah,multi_needle,variable_tracking")
    parser.add_argument("--jsonl", help="a JSONL task as well (bench/results/quality.jsonl: the 48 questions)")
    parser.add_argument("--contexts", default="1", help="generated contexts per task")
    parser.add_argument("--context-tokens", default="640")
    parser.add_argument("--questions-per-context", default="3")
    parser.add_argument("--ratios", default="1,0.05,0.02")
    parser.add_argument("--batch-size", default="1", help="contexts per batch")
    parser.add_argument("--seed", default="0")
    parser.add_argument("--out", default="runs/self-study-scale")
    parser.add_argument("--curve", action="store_true", help="run nothing: write curve.md and curve.png in --out")
    parser.add_argument("--oracle", help="with --curve: a matching_ablation --fit-sources oracle folder")
    args = parser.parse_args(argv)
    if args.curve:
        curve(Path(args.out), Path(args.oracle) if args.oracle else None)
        return 0
    counts = sorted({int(c) for c in args.counts.split(",")})
    if counts[0] < 0:
        parser.error("--counts are numbers of queries, >= 0")
    extra = variants(counts)
    for name, choices in extra.items():  # registered as the product's own methods
        methods.register(methods.compaction.attention_matching(name, "self_study_scale variant", **choices))
    _count_rows(Path(args.out) / "self_study_rows.json")
    names = ",".join(["kvzip"] + list(extra))
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
            "--questions-per-context",
            args.questions_per_context,
            "--batch-size",
            args.batch_size,
            "--methods",
            names,
            "--ratios",
            args.ratios,
            "--seed",
            args.seed,
            "--self-study",
            "--self-study-samples",
            str(args.samples),
            "--self-study-tokens",
            str(args.tokens),
            "--query-cap",
            str(2 * max(max(counts), 1)),
            "--out",
            args.out,
        ]
        + (["--jsonl", args.jsonl] if args.jsonl else [])
    )


ORACLE = {"am-hak-cap1": "oracle am-hak (no head cap)", "am-hak-kb": "oracle am-hak-kb"}


def curve(out: Path, oracle: Path | None = None) -> None:
    """curve.md and curve.png in out: score and KL against the self-study queries (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = report.read_records(out / "results.jsonl")
    if oracle is not None:  # its full-cache rows are the same computation; its methods renamed
        records += [
            dict(r, method=ORACLE[r["method"]])
            for r in report.read_records(oracle / "results.jsonl")
            if r["method"] in ORACLE
        ]
    pooled = report.summarize([dict(r, task="all tasks") for r in records])
    rows = report.summarize(records) + pooled
    counts = sorted({int(r["method"].rsplit("-ss", 1)[1]) for r in records if "-ss" in r["method"]})
    ratios = sorted({r["ratio"] for r in records if r["ratio"] < 1}, reverse=True)
    at = {(r["task"], r["method"], r["ratio"]): r for r in rows}
    flat = [m for m in ("kvzip",) + tuple(ORACLE.values()) if any(k[1] == m for k in at)]
    captured = json.loads((out / "self_study_rows.json").read_text()).values()
    label = {n: (f"{n} (all: {min(captured)}-{max(captured)})" if n > min(captured) else str(n)) for n in counts}
    lines = [
        "# Score and KL against the self-study queries per KV head\n",
        "Normalised score: % of the full cache's (95% bootstrap interval over contexts, pooled row); KL: mean "
        "next-token KL(full || compressed), teacher-forced. A count above what a context's turns gave takes "
        "all of them (self_study_rows.json).\n",
    ]
    for ratio in ratios:
        lines += [
            f"\n## ratio {ratio}\n",
            "| task | method | " + " | ".join(label[n] for n in counts) + " |",
            "|---|---|" + "---:|" * len(counts),
        ]
        tasks = sorted({k[0] for k in at if k[0] != "all tasks"}) + ["all tasks"]
        for task in tasks:
            for name in ("am-hak", "am-hak-kb"):
                cells = [at.get((task, f"{name}-ss{n}", ratio)) for n in counts]
                lines.append(f"| {task} | {name} | " + " | ".join(_cell(c) for c in cells) + " |")
            for m in flat:
                c = at.get((task, m, ratio))
                lines.append(f"| {task} | {m} | {_cell(c)} (any count) |" + " |" * (len(counts) - 1))
    (out / "curve.md").write_text("\n".join(lines) + "\n")

    fig, axes = plt.subplots(2, len(ratios), figsize=(5 * len(ratios), 7), squeeze=False)
    xs = np.arange(len(counts))
    for j, ratio in enumerate(ratios):
        for i, value in enumerate(("normalised", "kl")):
            ax = axes[i, j]
            for name in ("am-hak", "am-hak-kb"):
                got = [at.get(("all tasks", f"{name}-ss{n}", ratio)) for n in counts]
                ax.plot(xs, _values(got, value), marker="o", label=name)
                if value == "normalised":
                    ax.fill_between(xs, _values(got, "normalised_lo"), _values(got, "normalised_hi"), alpha=0.15)
            for m, style in zip(flat, ("--", ":", "-.")):
                g = at.get(("all tasks", m, ratio))
                if g is not None and g[value] is not None:
                    ax.axhline(g[value], linestyle=style, color="gray" if m == "kvzip" else "black", label=m)
            ax.set_xticks(xs, [label[n].replace(" (", "\n(") for n in counts], fontsize=7)
            ax.set_xlabel("self-study queries per KV head and layer")
            ax.set_ylabel("score / full cache's (%)" if value == "normalised" else "KL(full || compressed)")
            ax.set_title(f"ratio {ratio}, all tasks")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=110)
    plt.close(fig)


def _values(rows: list[dict | None], field: str) -> list[float]:
    return [np.nan if r is None or r[field] is None else r[field] for r in rows]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    lo, hi = row.get("normalised_lo"), row.get("normalised_hi")
    interval = f" [{lo:.0f}, {hi:.0f}]" if lo is not None else ""
    norm = "-" if row["normalised"] is None else f"{row['normalised']:.0f}"
    return f"{norm}{interval} / {row['kl']:.2f}"


def _count_rows(path: Path) -> None:
    """Makes the sweep record, per example, the valid self-study rows per KV head and layer its reference pass
    captured (path rewritten after every batch's pass)."""
    seen, batch_ids = (json.loads(path.read_text()) if path.exists() else {}), []
    run, queries = runner.Sweep.run, runner.SharedInputs._queries

    def running(self, batch, capacity):
        batch_ids[:] = [f"{ex.task}/{ex.id}" for ex in batch.examples]
        return run(self, batch, capacity)

    def counted(shared):
        got = queries(shared)
        studied = np.asarray(got.valid) & np.asarray(got.self_study)[None, :]  # [B, R]
        if batch_ids:
            seen.update({name: int(studied[b].sum()) for b, name in enumerate(batch_ids)})
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(seen, indent=1, sort_keys=True) + "\n")
            batch_ids.clear()
        return got

    runner.Sweep.run, runner.SharedInputs._queries = running, counted


if __name__ == "__main__":
    sys.exit(main())
