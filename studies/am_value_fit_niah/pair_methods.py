"""Paired difference of two of our methods at one ratio on the same samples of a sweep's results file (reuse mode):
per task and the average over tasks, with the 95% paired bootstrap interval of eval.leaderboard.paired_difference.

    python studies/am_value_fit_niah/pair_methods.py RESULTS METHOD_A METHOD_B RATIO
"""

import collections
import json
import sys

from kvzip_jax.eval import leaderboard, results, statistics


def scores(records, method, ratio):
    """task -> (example, question) -> score (0..1) of one method at one ratio."""
    out = collections.defaultdict(dict)
    for r in records:
        if r["method"] == method and r["mode"] == "reuse" and abs(float(r["ratio"]) - ratio) < 1e-6:
            out[r["task"]][(r["example"], r["question"])] = float(r["score"])
    return out


def main(path, a, b, ratio):
    records = [statistics.labelled(json.loads(line)) for line in results.read_bytes(path).decode().splitlines() if line]
    ours, theirs = scores(records, a, float(ratio)), scores(records, b, float(ratio))
    if not ours or sorted(ours) != sorted(theirs) or any(set(ours[t]) != set(theirs[t]) for t in ours):
        sys.exit(f"{a} and {b} at {ratio} do not answer the same samples in {path}")
    per_task, average = leaderboard.paired_difference(
        {t: [ours[t][k] for k in sorted(ours[t])] for t in ours},
        {t: [theirs[t][k] for k in sorted(ours[t])] for t in ours},
    )
    print(f"| task | n | {a} | {b} | difference [95%] |\n|---|---:|---:|---:|---:|")
    for task, s in [*per_task.items(), ("average", average)]:
        interval = f"{s['difference']:+.1f} [{s['difference_lo']:+.1f}, {s['difference_hi']:+.1f}]"
        print(f"| {task} | {s['n']} | {s['ours']:.1f} | {s['theirs']:.1f} | {interval} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
