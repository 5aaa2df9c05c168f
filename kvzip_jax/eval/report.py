"""Sweep report: per-answer JSONL records -> per-(task, method, mode, ratio) summary, markdown/CSV tables and a plot.

A record (one JSON object per line, one per answered question) holds: model, task, example (id), question (index
within the example), method ("full" for the uncompressed cache, else "kvzip", "snapkv", ...), mode ("full" for the
full cache, else "reuse" / "first" / "oracle"), ratio (1.0 for full), prediction, references, metric, score (0..1),
agree (prediction equals the full cache's), kl, flip (kvzip_jax.eval.metrics.next_token_divergence), seconds;
and, from sweeps that quantize, kv_bits (16 when absent: the model's dtype) and bytes (the answering cache's kept pairs
for that context). A quantized cache is reported as its own method: "kvzip+int4", and "int8" / "int4" for the full
cache quantized (quantization alone); normalised scores stay relative to the unquantized full cache.

Every normalised score and agreement comes with a 95% interval, since a sweep's n is small:
  agreement   Wilson score interval over the n answers;
  normalised  percentile bootstrap over the contexts (2,000 resamples of whole examples with their questions, which
              are not independent of each other; seed 0, so a report is reproducible): 100 x sum of scores / sum of
              full-cache scores of each resample.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvzip_jax.eval import results

MODES = ("full", "reuse", "first", "oracle")
SUMMARIZED = ("model", "task", "example", "question", "method", "mode", "ratio", "score", "agree", "kl", "flip")
COLUMNS = ("task", "method", "mode", "ratio", "n", "score", "normalised", "normalised_lo", "normalised_hi", "agree",
           "agree_lo", "agree_hi", "kl", "flip", "bytes", "bytes_share")
Z95 = 1.959964  # two-sided 95% normal quantile
RESAMPLES = 2000
# value -> (axis / heading label, cell format); "score" is shown in %.
VALUES = {
    "normalised": ("score / full-cache score (%)", "{:.1f}"),
    "score": ("score (%)", "{:.1f}"),
    "agree": ("answers equal to the full cache's (%)", "{:.1f}"),
    "kl": ("next-token KL(full || compressed)", "{:.4f}"),
    "flip": ("next-token argmax flip rate", "{:.3f}"),
    "bytes_share": ("bytes of the kept pairs (% of the full cache's)", "{:.1f}"),
}


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file; an invalid last line (an interrupted write) is dropped, any other raises."""
    lines = [(i + 1, line) for i, line in enumerate(Path(path).read_bytes().split(b"\n")) if line.strip()]
    records = []
    for k, (lineno, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if k == len(lines) - 1:
                break
            raise ValueError(f"{path}, line {lineno}: invalid record: {e}") from None
        records.append(record)
    return records


def _check(records: Sequence[dict]) -> None:
    for i, r in enumerate(records):
        missing = [f for f in SUMMARIZED if f not in r]
        if missing:
            raise ValueError(f"record {i} lacks {missing}")
        if r["mode"] not in MODES:
            raise ValueError(f"record {i}: mode must be one of {MODES}, got {r['mode']!r}")
        if (r["method"] == "full") != (r["mode"] == "full") or (r["method"] == "full" and r["ratio"] != 1.0):
            raise ValueError(f"record {i}: the full cache is method 'full', mode 'full', ratio 1.0; got "
                             f"{r['method']!r}, {r['mode']!r}, {r['ratio']!r}")
    models = sorted({r["model"] for r in records})
    if len(models) > 1:
        raise ValueError(f"records of several models {models}; summarize one model at a time")


def labelled(record: dict) -> dict:
    """The record as the report shows it: a quantized cache as its own method (module docstring)."""
    bits = record.get("kv_bits", 16)
    if bits == 16:
        return record
    if record["method"] == "full":
        return {**record, "method": f"int{bits}", "mode": "reuse"}
    return {**record, "method": f"{record['method']}+int{bits}"}


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def wilson(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion hits / n, in %."""
    p = hits / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return 100 * max(centre - half, 0.0), 100 * min(centre + half, 1.0)


def bootstrap_normalised(per_example: Sequence[tuple[float, float]], seed: int = 0) -> tuple[float, float] | None:
    """95% percentile interval of 100 x sum(score) / sum(full score) over resampled examples, from per-example
    (sum of scores, sum of full-cache scores); None when there is nothing to resample. Resamples whose full-cache
    sum is 0 are left out."""
    if not per_example:
        return None
    sums = np.asarray(per_example, np.float64)  # [E, 2]
    picks = np.random.default_rng(seed).integers(0, len(sums), (RESAMPLES, len(sums)))  # [R, E]
    got, full = sums[picks, 0].sum(axis=1), sums[picks, 1].sum(axis=1)
    ratios = 100 * got[full > 0] / full[full > 0]
    if not ratios.size:
        return None
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def _row_order(row: dict) -> tuple:
    return row["task"], row["method"] != "full", row["method"], MODES.index(row["mode"]), -row["ratio"]


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per (task, method, mode, ratio), the full cache included (method/mode "full", ratio 1.0), sorted.

    Row fields (COLUMNS): n; score (mean, 0..1); normalised = 100 * mean score / mean full-cache score over the
    questions (example, question) that have a full-cache record (None when there are none or the full mean is 0);
    agree (% of answers equal to the full cache's); kl and flip (means); normalised_lo/hi and agree_lo/hi: the 95%
    intervals of the module docstring (None where the value is). The rows do not depend on the records' order
    (they are taken in results.record_key order), so the shares of a sweep merged give a one-process sweep's.
    """
    _check(records)
    records = [labelled(r) for r in sorted(records, key=results.record_key)]
    full = {(r["task"], r["example"], r["question"]): float(r["score"]) for r in records if r["method"] == "full"}
    full_bytes = {(r["task"], r["example"]): r["bytes"] for r in records if r["method"] == "full" and "bytes" in r}
    groups = collections.defaultdict(list)
    for r in records:
        groups[r["task"], r["method"], r["mode"], round(float(r["ratio"]), 6)].append(r)
    rows = []
    for (task, method, mode, ratio), group in groups.items():
        per_example = collections.defaultdict(lambda: [0.0, 0.0])  # example -> [sum of scores, sum of full scores]
        for r in group:
            if (k := (task, r["example"], r["question"])) in full:
                per_example[r["example"]][0] += float(r["score"])
                per_example[r["example"]][1] += full[k]
        full_sum = sum(f for _, f in per_example.values())
        normalised = 100 * sum(s for s, _ in per_example.values()) / full_sum if full_sum else None
        interval = bootstrap_normalised(list(per_example.values())) if normalised is not None else None
        agreed = sum(bool(r["agree"]) for r in group)
        rows.append({
            "task": task, "method": method, "mode": mode, "ratio": ratio, "n": len(group),
            "score": _mean(float(r["score"]) for r in group),
            "normalised": normalised,
            "normalised_lo": interval[0] if interval else None, "normalised_hi": interval[1] if interval else None,
            "agree": 100 * agreed / len(group),
            **dict(zip(("agree_lo", "agree_hi"), wilson(agreed, len(group)))),
            "kl": _mean(float(r["kl"]) for r in group),
            "flip": _mean(float(r["flip"]) for r in group),
            **_bytes(group, full_bytes),
        })
    return sorted(rows, key=_row_order)


def _bytes(group: Sequence[dict], full_bytes: dict) -> dict:
    """bytes: the mean kept-pair bytes per answer's context; bytes_share: 100 x their mean share of the full cache's
    (None without bytes in every record)."""
    if not all("bytes" in r and (r["task"], r["example"]) in full_bytes for r in group):
        return {"bytes": None, "bytes_share": None}
    return {"bytes": _mean(r["bytes"] for r in group),
            "bytes_share": 100 * _mean(r["bytes"] / full_bytes[r["task"], r["example"]] for r in group)}


def _spec(value: str) -> tuple[str, str]:
    """(label, cell format) of a value name."""
    if value not in VALUES:
        raise ValueError(f"value must be one of {tuple(VALUES)}, got {value!r}")
    return VALUES[value]


def _shown(row: dict, value: str) -> float | None:
    """The row's value in display units (score in %)."""
    v = row[value]
    return None if v is None else 100 * v if value == "score" else v


def markdown_table(rows: Sequence[dict], value: str = "normalised") -> str:
    """A markdown table of one value: rows (task, method, mode), columns the ratios in descending order.

    Each task's full-cache row shows the full cache's raw score in % (under ratio 1.0) whatever the value;
    "-" marks a missing cell or a None value. Normalised scores and agreement carry their 95% interval in brackets.
    """
    if not rows:
        raise ValueError("no rows to tabulate")
    _spec(value)
    ratios = sorted({r["ratio"] for r in rows}, reverse=True)
    cells = collections.defaultdict(dict)  # (task, method, mode) -> ratio -> text
    for r in rows:
        shown = "score" if r["method"] == "full" and value != "bytes_share" else value
        v = _shown(r, shown)
        text = "-" if v is None else VALUES[shown][1].format(v)
        if v is not None and shown in ("normalised", "agree") and r.get(f"{shown}_lo") is not None:
            text += f" [{r[f'{shown}_lo']:.0f}, {r[f'{shown}_hi']:.0f}]"
        cells[r["task"], r["method"], r["mode"]][r["ratio"]] = text
    lines = ["| task | method | mode | " + " | ".join(str(x) for x in ratios) + " |",
             "|---|---|---|" + "---:|" * len(ratios)]
    for key, by_ratio in cells.items():
        lines.append("| " + " | ".join(key) + " | " + " | ".join(by_ratio.get(x, "-") for x in ratios) + " |")
    return "\n".join(lines) + "\n"


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """write(tmp) into a temporary file next to path, then os.replace it onto path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _write_text(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_csv(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """The summary rows as CSV (COLUMNS; None as an empty cell), written atomically."""
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows({k: "" if r[k] is None else r[k] for k in COLUMNS} for r in rows)
    return write_atomic(path, write)


def plot(rows: Sequence[dict], path: str | os.PathLike, value: str = "normalised") -> Path:
    """A PNG with one subplot per task: value against ratio (1.0 at the left, descending), one line per
    (method, mode) with its 95% interval shaded (normalised scores and agreement), the full cache as a dashed
    horizontal line (100 for normalised scores). Written atomically."""
    if not rows:
        raise ValueError("no rows to plot")
    label = _spec(value)[0]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lowest = min(r["ratio"] for r in rows)
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    series = list(dict.fromkeys((r["method"], r["mode"]) for r in rows if r["method"] != "full"))
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {key: palette[i % len(palette)] for i, key in enumerate(series)}  # one colour per line in every panel
    for ax, task in zip(axes, tasks):
        lines = collections.defaultdict(list)  # (method, mode) -> [(ratio, value, low, high)]
        for r in rows:
            v = _shown(r, value)
            if r["task"] != task or v is None:
                continue
            if r["method"] == "full":
                ax.axhline(v, color="black", linestyle="--", linewidth=1, label="full cache")
            else:
                low, high = r.get(f"{value}_lo"), r.get(f"{value}_hi")
                lines[r["method"], r["mode"]].append((r["ratio"], v, v if low is None else low,
                                                      v if high is None else high))
        for (method, mode), pts in lines.items():
            xs, ys, lows, highs = zip(*sorted(pts, reverse=True))
            color = colors[method, mode]
            ax.plot(xs, ys, marker="o", markersize=4, label=f"{method} ({mode})", color=color)
            ax.fill_between(xs, lows, highs, color=color, alpha=0.12, linewidth=0)
        ax.set_xlim(1.03, lowest - 0.03)  # descending: the full cache's 1.0 at the left
        ax.set(title=task, xlabel="KV cache ratio", ylabel=label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    return write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def pareto(rows: Sequence[dict], path: str | os.PathLike, value: str = "normalised") -> Path:
    """A PNG with one subplot per task: value (normalised score) against the bytes of the kept pairs (% of the full
    cache's, log scale), one line per method through its ratios (eviction alone, eviction + quantization,
    quantization alone as single points), the full cache at 100% of the bytes. Written atomically."""
    points = [r for r in rows if r["bytes_share"] is not None and r[value] is not None]
    if not points:
        raise ValueError("no rows with bytes to plot")
    tasks = list(dict.fromkeys(r["task"] for r in points))
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    series = list(dict.fromkeys((r["method"], r["mode"]) for r in points))
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    bases = list(dict.fromkeys(method.split("+")[0] for method, _ in series))
    for ax, task in zip(axes, tasks):
        for method, mode in series:
            pts = sorted((r["bytes_share"], r[value]) for r in points
                         if (r["task"], r["method"], r["mode"]) == (task, method, mode))
            if not pts:
                continue
            xs, ys = zip(*pts)
            base, _, bits = method.partition("+")
            style = {"": "-", "int8": "--", "int4": ":"}[bits]
            ax.plot(xs, ys, marker="s" if method == "full" else "o", markersize=4, linestyle=style,
                    color=palette[bases.index(base) % len(palette)],
                    label=method if mode in ("reuse", "full") else f"{method} ({mode})")
        ax.set_xscale("log")
        ax.set(title=task, xlabel="bytes of the kept pairs (% of the full cache's)", ylabel=VALUES[value][0])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small")
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    return write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def write_report(jsonl_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Path]:
    """summary.md (normalised score, agreement and KL tables; bytes where the records carry them), summary.csv and
    scores.png in out_dir, each written atomically, and pareto.png (score against bytes) for a sweep that quantizes;
    returns their paths under the keys "markdown", "csv", "plot" (and "pareto")."""
    records = read_records(jsonl_path)
    if not records:
        raise ValueError(f"{jsonl_path} holds no records")
    rows = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    note = ("Full-cache rows: the full cache's raw score (%). Brackets: 95% intervals (normalised scores: bootstrap "
            "over contexts; agreement: Wilson).\n\n")
    sections = [f"# {records[0]['model']}: {len(records)} answers ({Path(jsonl_path).name})\n"]
    for value, heading in (("normalised", "Score normalised by the full cache's (%)"),
                           ("agree", "Answers equal to the full cache's (%)"),
                           ("kl", "Next-token KL(full || compressed), teacher-forced"),
                           ("bytes_share", "Bytes of the kept pairs (% of the full cache's)")):
        if any(r[value] is not None for r in rows):
            sections.append(f"## {heading}\n\n{note}{markdown_table(rows, value)}")
    written = {
        "markdown": _write_text(out / "summary.md", "\n".join(sections)),
        "csv": write_csv(rows, out / "summary.csv"),
        "plot": plot(rows, out / "scores.png"),
    }
    if any(r.get("kv_bits", 16) != 16 for r in records):
        scored = any(r["normalised"] is not None for r in rows)  # else (no full-cache answer right) agreement
        written["pareto"] = pareto(rows, out / "pareto.png", "normalised" if scored else "agree")
    return written


def merge_report(folder: str | os.PathLike) -> dict[str, Path]:
    """Joins the results files of a sweep's processes into the folder's results.jsonl (results.merge) and writes its
    report there (write_report): what one process sweeping the same contexts writes."""
    return write_report(results.merge(folder), folder)
