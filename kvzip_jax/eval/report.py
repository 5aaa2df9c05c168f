"""Sweep report: a JSONL file of per-answer records -> markdown and CSV tables and plots of their summary.

The records and the summary rows (their fields, COLUMNS, and 95% intervals) are statistics.py's; this module reads
the records and presents the rows. Every file is written atomically.
"""

from __future__ import annotations

import collections
import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvzip_jax.eval import leaderboard, results
from kvzip_jax.eval.statistics import COLUMNS, summarize

# value -> (axis / heading label, cell format); "score" is shown in %.
VALUES = {
    "normalised": ("score / full-cache score (%)", "{:.1f}"),
    "score": ("score (%)", "{:.1f}"),
    "agree": ("answers equal to the full cache's (%)", "{:.1f}"),
    "kl": ("next-token KL(full || compressed)", "{:.4f}"),
    "flip": ("next-token argmax flip rate", "{:.3f}"),
    "bytes_share": ("bytes of the kept pairs (% of the full cache's)", "{:.1f}"),
}
LEADERBOARD_NOTE = (
    "Average: the unweighted mean over tasks of each task's mean score (%), with its 95% bootstrap interval over "
    "contexts in brackets; % of full: the average / the full cache's; compression_ratio: 1 - ratio (kvpress's); "
    "a dash in the average: a task the full cache answered is missing."
)


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL file; an invalid last line (an interrupted write) is dropped, any other raises."""
    lines = [(i + 1, line) for i, line in enumerate(results.read_bytes(path).split(b"\n")) if line.strip()]
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
    lines = [
        "| task | method | mode | " + " | ".join(str(x) for x in ratios) + " |",
        "|---|---|---|" + "---:|" * len(ratios),
    ]
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


def save_png(fig: Figure, path: Path, colors: int = 64) -> None:
    """The figure as a palette PNG of at most `colors` colours (a plot's flat colours survive; a quarter of the
    bytes of matplotlib's RGBA PNG), at 120 dpi, its encoding optimised."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
        palette.save(path, format="PNG", optimize=True)


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
                lines[r["method"], r["mode"]].append(
                    (r["ratio"], v, v if low is None else low, v if high is None else high)
                )
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
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    return write_atomic(path, lambda tmp: save_png(fig, tmp))


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
            pts = sorted(
                (r["bytes_share"], r[value])
                for r in points
                if (r["task"], r["method"], r["mode"]) == (task, method, mode)
            )
            if not pts:
                continue
            xs, ys = zip(*pts)
            base, _, bits = method.partition("+")
            style = {"": "-", "int8": "--", "int4": ":", "k8v4": "-."}[bits]
            ax.plot(
                xs,
                ys,
                marker="s" if method == "full" else "o",
                markersize=4,
                linestyle=style,
                color=palette[bases.index(base) % len(palette)],
                label=method if mode in ("reuse", "full") else f"{method} ({mode})",
            )
        ax.set_xscale("log")
        ax.set(title=task, xlabel="bytes of the kept pairs (% of the full cache's)", ylabel=VALUES[value][0])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small")
    for ax in axes[len(tasks) :]:
        ax.set_visible(False)
    return write_atomic(path, lambda tmp: save_png(fig, tmp))


def write_report(jsonl_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Path]:
    """summary.md (normalised score, agreement and KL tables; bytes where the records carry them), summary.csv and
    scores.png in out_dir, each written atomically, pareto.png (score against bytes) for a sweep that quantizes, and
    for records of more than one task a leaderboard (leaderboard.py: the average over tasks) as summary.md's first
    section and leaderboard.csv; returns their paths under the keys "markdown", "csv", "plot" (and "leaderboard",
    "pareto")."""
    records = read_records(jsonl_path)
    if not records:
        raise ValueError(f"{jsonl_path} holds no records")
    rows = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    note = (
        "Full-cache rows: the full cache's raw score (%). Brackets: 95% intervals (normalised scores: bootstrap "
        "over contexts; agreement: Wilson).\n\n"
    )
    sections = [f"# {records[0]['model']}: {len(records)} answers ({Path(jsonl_path).name})\n"]
    board = leaderboard.leaderboard(records) if len({r["task"] for r in records}) > 1 else None
    if board:
        sections.append(f"## Leaderboard: average over tasks\n\n{LEADERBOARD_NOTE}\n\n{leaderboard.markdown(board)}")
    for value, heading in (
        ("normalised", "Score normalised by the full cache's (%)"),
        ("agree", "Answers equal to the full cache's (%)"),
        ("kl", "Next-token KL(full || compressed), teacher-forced"),
        ("bytes_share", "Bytes of the kept pairs (% of the full cache's)"),
    ):
        if any(r[value] is not None for r in rows):
            sections.append(f"## {heading}\n\n{note}{markdown_table(rows, value)}")
    written = {
        "markdown": _write_text(out / "summary.md", "\n".join(sections)),
        "csv": write_csv(rows, out / "summary.csv"),
        "plot": plot(rows, out / "scores.png"),
    }
    if board:
        written["leaderboard"] = leaderboard.write_csv(board, out / "leaderboard.csv")
    if any(r.get("kv_bits", 16) != 16 for r in records):
        scored = any(r["normalised"] is not None for r in rows)  # else (no full-cache answer right) agreement
        written["pareto"] = pareto(rows, out / "pareto.png", "normalised" if scored else "agree")
    return written


def merge_report(folder: str | os.PathLike) -> dict[str, Path]:
    """Joins the results files of a sweep's processes into the folder's results.jsonl (results.merge) and writes its
    report there (write_report): what one process sweeping the same contexts writes."""
    return write_report(results.merge(folder), folder)
