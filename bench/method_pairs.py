"""Two methods of `kvzip-jax eval` results, paired per sample at each ratio they share.

Prints, per ratio and task, how many samples both methods answered, each one's score and the paired difference
B - A with its 95% bootstrap interval (kvzip_jax.eval.leaderboard.paired_difference; the average row is the
unweighted mean over tasks), as a markdown table. The records may come from several results files (say a sweep of
the 55 RULER samples and another of a subset), as long as neither method's (mode, ratio, sample) is recorded twice.

    python bench/method_pairs.py RESULTS [RESULTS ...] --a kvzip --b kvzip:level=pair-uniform [--mode reuse]
        [--out FILE]

A and B are method names as the records hold them (a method with options: its spec, NAME:OPTION=VALUE).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvzip_jax.eval.leaderboard import paired_difference
from kvzip_jax.eval.report import read_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ruler_pairs import AVERAGE, _cell, our_records  # noqa: E402 (bench/ is not a package)


def pair(records: Sequence[dict], a: str, b: str, mode: str) -> dict[float, list[tuple[dict, dict]]]:
    """ratio -> [(A's record, B's record)] of the samples both answered at that ratio in `mode`, ratios descending
    (records of other methods and modes ignored; ValueError on a record of A or B twice)."""
    keyed = our_records([r for r in records if r["method"] in (a, b) and r["mode"] == mode])
    pairs = collections.defaultdict(list)
    for (method, _, ratio, *sample), record in keyed.items():
        other = keyed.get((b, mode, ratio, *sample))
        if method == a and other is not None:
            pairs[ratio].append((record, other))
    return dict(sorted(pairs.items(), key=lambda item: -item[0]))


def compare(pairs: Mapping[float, list], seed: int = 0) -> list[dict]:
    """Rows per ratio (descending), one per task and one for the average over tasks (task AVERAGE): ratio, task,
    n, a, b (mean scores, %), difference (B - A, %), difference_lo, difference_hi."""
    rows = []
    for ratio, items in pairs.items():
        by_task = collections.defaultdict(list)
        for ra, rb in items:
            by_task[ra["task"]].append((float(ra["score"]), float(rb["score"])))
        per_task, average = paired_difference(
            {t: [sb for _, sb in scores] for t, scores in by_task.items()},
            {t: [sa for sa, _ in scores] for t, scores in by_task.items()},
            seed,
        )
        for task, stats in [*per_task.items(), (AVERAGE, average)]:
            rows.append(
                {"ratio": ratio, "task": task, "n": stats["n"], "a": stats["theirs"], "b": stats["ours"]}
                | {k: stats[k] for k in ("difference", "difference_lo", "difference_hi")}
            )
    return rows


def markdown(rows: Sequence[dict], a: str, b: str) -> str:
    """The compare rows as a markdown table ("ruler_" stripped from task names)."""
    lines = [f"| ratio | task | n | {a} (%) | {b} (%) | B - A [95%] |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        difference = f"{r['difference']:+.1f} [{r['difference_lo']:+.1f}, {r['difference_hi']:+.1f}]"
        task = r["task"].removeprefix("ruler_")
        lines.append(f"| {r['ratio']:g} | {task} | {r['n']} | {_cell(r['a'])} | {_cell(r['b'])} | {difference} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="`kvzip-jax eval` results files (.jsonl or .jsonl.gz)")
    parser.add_argument("--a", required=True, help="the method compared against (B - A)")
    parser.add_argument("--b", required=True, help="the method compared")
    parser.add_argument("--mode", default="reuse", help="the protocol both are read in (default reuse)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    pairs = pair([r for path in args.results for r in read_records(path)], args.a, args.b, args.mode)
    if not pairs:
        print(f"no sample answered by both {args.a} and {args.b} in mode {args.mode}", file=sys.stderr)
        return 1
    table = markdown(compare(pairs), args.a, args.b)
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
