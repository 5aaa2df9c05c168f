"""A leaderboard over tasks (the shape of NVIDIA kvpress's RULER leaderboard): per-answer records -> one row per
(method, mode, ratio) with each task's mean score and their unweighted average, and paired differences between two
systems' scores of the same samples.

The records are statistics.py's (quantized caches renamed by statistics.labelled). Intervals are 95% percentile
bootstraps (statistics.RESAMPLES resamples, seed 0, so a table is reproducible) that resample each task
independently: the leaderboard resamples a task's contexts (examples, with their questions), paired_difference a
task's paired samples.
"""

from __future__ import annotations

import collections
import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from kvzip_jax.eval import results, statistics

FIELDS = (
    "method",
    "mode",
    "ratio",
    "compression_ratio",
    "n_contexts",
    "average",
    "average_lo",
    "average_hi",
    "of_full",
)
PREFIX = "ruler_"  # stripped from task names in the markdown table's headings


def _task_means(groups: Sequence[np.ndarray]) -> list[float]:
    """Each task's mean from its units' [E, 2] (sum of scores, count of scores)."""
    return [float(g[:, 0].sum() / g[:, 1].sum()) for g in groups]


def bootstrap_average(groups: Sequence[np.ndarray], seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the unweighted mean over tasks of each task's mean, each task's units resampled
    independently with replacement. groups: per task an [E, 2] array of its units' (sum of scores, count of scores);
    a task's resampled mean is the sum of its drawn sums over the sum of its drawn counts. In the groups' units."""
    rng = np.random.default_rng(seed)
    per_task = []
    for g in groups:
        picks = rng.integers(0, len(g), (statistics.RESAMPLES, len(g)))  # [R, E]
        per_task.append(g[picks, 0].sum(axis=1) / g[picks, 1].sum(axis=1))  # [R]
    low, high = np.percentile(np.mean(per_task, axis=0), [2.5, 97.5])
    return float(low), float(high)


def _row_order(row: dict) -> tuple:
    return row["method"] != "full", row["method"], statistics.MODES.index(row["mode"]), -row["ratio"]


def tasks_of(rows: Sequence[dict]) -> list[str]:
    """The task columns of leaderboard rows, in their order."""
    return [k for k in rows[0] if k not in FIELDS] if rows else []


def leaderboard(records: Sequence[dict]) -> list[dict]:
    """One row per (method, mode, ratio) after statistics.labelled, sorted as statistics sorts (full cache first,
    then method, mode, descending ratio).

    Row fields: FIELDS, then one per task (every task of the records, sorted by name): that task's mean score in %
    (None where the row has no answer of it). compression_ratio = 1 - ratio (kvpress's convention; 0 for the full
    cache); n_contexts: the (task, example) pairs answered; average: the unweighted mean over the full cache's tasks
    of each task's mean score, in % (as RULER averages its tasks), with average_lo / average_hi its 95% bootstrap
    interval (module docstring); of_full: 100 x average / the full cache's average. A row lacking a task that the full
    cache has (every task of the records when there is no full cache) has average, its interval and of_full None,
    never an average over fewer tasks; of_full is None too without a full row or when its average is 0.
    Records of several models raise ValueError.
    """
    statistics.check_records(records)
    records = [statistics.labelled(r) for r in sorted(records, key=results.record_order)]
    tasks = sorted({r["task"] for r in records})
    full_tasks = {r["task"] for r in records if r["method"] == "full"} or set(tasks)
    units = collections.defaultdict(lambda: [0.0, 0])  # (method, mode, ratio, task, example) -> [sum of scores, count]
    for r in records:
        unit = units[r["method"], r["mode"], round(float(r["ratio"]), 6), r["task"], r["example"]]
        unit[0] += float(r["score"])
        unit[1] += 1
    groups = collections.defaultdict(lambda: collections.defaultdict(list))  # (method, mode, ratio) -> task -> units
    for (method, mode, ratio, task, _), unit in units.items():
        groups[method, mode, ratio][task].append(unit)
    rows = []
    for (method, mode, ratio), by_task in groups.items():
        arrays = {task: np.asarray(task_units, np.float64) for task, task_units in by_task.items()}
        means = dict(zip(arrays, _task_means(list(arrays.values()))))
        complete = full_tasks <= set(arrays)
        counted = [arrays[t] for t in sorted(full_tasks)] if complete else []
        interval = bootstrap_average(counted) if complete else None
        rows.append(
            {
                "method": method,
                "mode": mode,
                "ratio": ratio,
                "compression_ratio": round(1.0 - ratio, 6),
                "n_contexts": sum(len(a) for a in arrays.values()),
                "average": 100 * float(np.mean(_task_means(counted))) if complete else None,
                "average_lo": 100 * interval[0] if interval else None,
                "average_hi": 100 * interval[1] if interval else None,
                "of_full": None,
                **{t: 100 * means[t] if t in means else None for t in tasks},
            }
        )
    full = next((r["average"] for r in rows if r["method"] == "full"), None)
    for r in rows:
        if full and r["average"] is not None:
            r["of_full"] = 100 * r["average"] / full
    return sorted(rows, key=_row_order)


def _cell(value: float | None, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def markdown(rows: Sequence[dict], tasks: Sequence[str] | None = None) -> str:
    """A markdown table of leaderboard rows: method (mode in brackets where not reuse), ratio, compression_ratio,
    average [lo, hi], % of full, then one column per task (tasks_of(rows) by default; "ruler_" stripped from the
    headings); "-" marks None."""
    if not rows:
        raise ValueError("no rows to tabulate")
    tasks = tasks_of(rows) if tasks is None else list(tasks)
    short = [t.removeprefix(PREFIX) for t in tasks]
    lines = [
        "| method | ratio | compression_ratio | average [lo, hi] | % of full | " + " | ".join(short) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(tasks),
    ]
    for r in rows:
        method = r["method"] if r["mode"] in ("full", "reuse") else f"{r['method']} ({r['mode']})"
        average = _cell(r["average"])
        if r["average_lo"] is not None:
            average += f" [{r['average_lo']:.1f}, {r['average_hi']:.1f}]"
        cells = [method, f"{r['ratio']:g}", f"{r['compression_ratio']:g}", average, _cell(r["of_full"])]
        lines.append("| " + " | ".join(cells + [_cell(r.get(t)) for t in tasks]) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict], path: str | os.PathLike, tasks: Sequence[str] | None = None) -> Path:
    """The leaderboard rows as CSV (FIELDS, then the task columns, tasks_of(rows) by default; None as an empty
    cell), written atomically."""
    columns = [*FIELDS, *(tasks_of(rows) if tasks is None else tasks)]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: "" if r.get(k) is None else r[k] for k in columns} for r in rows)
    path = Path(path)
    results.write_atomically(path, text.getvalue())
    return path


def paired_difference(
    ours: Mapping[str, Sequence[float]], theirs: Mapping[str, Sequence[float]], seed: int = 0
) -> tuple[dict[str, dict], dict]:
    """Paired comparison of two systems' scores (0..1) of the same samples: ours[task][i] and theirs[task][i] score
    sample i of the task. Returns (per task, average over tasks), each a dict of n (pairs), ours, theirs (mean
    scores, %), difference (ours - theirs, %) and difference_lo / difference_hi: its 95% paired bootstrap interval
    (a task's pairs resampled; the average, the unweighted mean over tasks, resamples each task's pairs
    independently). Tasks in sorted order; a task must have as many scores on each side, at least one."""
    tasks = sorted(ours)
    if sorted(theirs) != tasks or not tasks:
        raise ValueError(f"both sides need the same tasks, at least one: {sorted(ours)} against {sorted(theirs)}")
    pairs = {}
    for task in tasks:
        a, b = np.asarray(ours[task], np.float64), np.asarray(theirs[task], np.float64)
        if a.shape != b.shape or a.ndim != 1 or not a.size:
            raise ValueError(f"task {task!r}: need as many scores on each side (>= 1), got {a.shape} and {b.shape}")
        pairs[task] = (a, b)

    def summary(names: Sequence[str]) -> dict:
        diffs = [np.stack([pairs[t][0] - pairs[t][1], np.ones_like(pairs[t][0])], axis=1) for t in names]
        low, high = bootstrap_average(diffs, seed)
        return {
            "n": sum(len(pairs[t][0]) for t in names),
            "ours": 100 * float(np.mean([pairs[t][0].mean() for t in names])),
            "theirs": 100 * float(np.mean([pairs[t][1].mean() for t in names])),
            "difference": 100 * float(np.mean(_task_means(diffs))),
            "difference_lo": 100 * low,
            "difference_hi": 100 * high,
        }

    return {task: summary([task]) for task in tasks}, summary(tasks)
