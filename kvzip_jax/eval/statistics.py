"""Sweep statistics: per-answer records -> one summary row per (task, method, mode, ratio), with 95% intervals.

A record (one JSON object per line, one per answered question) holds: model, task, example (id), question (index
within the example), method ("full" for the uncompressed cache, else "kvzip", "snapkv", ...), mode ("full" for the
full cache, else "reuse" / "first" / "oracle"), ratio (1.0 for full), prediction, references, metric, score (0..1),
agree (prediction equals the full cache's), kl, flip (kvzip_jax.eval.metrics.next_token_divergence), seconds;
and, from sweeps that quantize, kv_bits (16 when absent: the model's dtype) and bytes (the answering cache's kept pairs
for that context). A quantized cache is reported as its own method: "kvzip+int4", and "int8" / "int4" for the full
cache quantized (quantization alone); "k8v4" names int8 keys beside int4 values (kv_bits "8/4"). Normalised scores
stay relative to the unquantized full cache.

Every normalised score and agreement comes with a 95% interval, since a sweep's n is small:
  agreement   Wilson score interval over the n answers;
  normalised  percentile bootstrap over the contexts (2,000 resamples of whole examples with their questions, which
              are not independent of each other; seed 0, so a report is reproducible): 100 x sum of scores / sum of
              full-cache scores of each resample.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

import numpy as np

from kvzip_jax import kv_bits
from kvzip_jax.eval import results

MODES = ("full", "reuse", "first", "oracle")
SUMMARIZED = ("model", "task", "example", "question", "method", "mode", "ratio", "score", "agree", "kl", "flip")
COLUMNS = (
    "task",
    "method",
    "mode",
    "ratio",
    "n",
    "score",
    "normalised",
    "normalised_lo",
    "normalised_hi",
    "agree",
    "agree_lo",
    "agree_hi",
    "kl",
    "flip",
    "bytes",
    "bytes_share",
)
Z95 = 1.959964  # two-sided 95% normal quantile
RESAMPLES = 2000


def check_records(records: Sequence[dict]) -> None:
    """Raises ValueError on a record lacking a SUMMARIZED field, an unknown mode, a full cache not named method
    "full", mode "full", ratio 1.0, or records of several models."""
    for i, r in enumerate(records):
        missing = [f for f in SUMMARIZED if f not in r]
        if missing:
            raise ValueError(f"record {i} lacks {missing}")
        if r["mode"] not in MODES:
            raise ValueError(f"record {i}: mode must be one of {MODES}, got {r['mode']!r}")
        if (r["method"] == "full") != (r["mode"] == "full") or (r["method"] == "full" and r["ratio"] != 1.0):
            raise ValueError(
                f"record {i}: the full cache is method 'full', mode 'full', ratio 1.0; got "
                f"{r['method']!r}, {r['mode']!r}, {r['ratio']!r}"
            )
    models = sorted({r["model"] for r in records})
    if len(models) > 1:
        raise ValueError(f"records of several models {models}; summarize one model at a time")


def labelled(record: dict) -> dict:
    """The record as the report shows it: a quantized cache as its own method (module docstring)."""
    bits = record.get("kv_bits", 16)
    if bits == 16:
        return record
    label = kv_bits.label(bits)
    if record["method"] == "full":
        return {**record, "method": label, "mode": "reuse"}
    return {**record, "method": f"{record['method']}+{label}"}


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
    (they are taken in results.record_order), so the shares of a sweep merged give a one-process sweep's.
    """
    check_records(records)
    records = [labelled(r) for r in sorted(records, key=results.record_order)]
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
        rows.append(
            {
                "task": task,
                "method": method,
                "mode": mode,
                "ratio": ratio,
                "n": len(group),
                "score": _mean(float(r["score"]) for r in group),
                "normalised": normalised,
                "normalised_lo": interval[0] if interval else None,
                "normalised_hi": interval[1] if interval else None,
                "agree": 100 * agreed / len(group),
                **dict(zip(("agree_lo", "agree_hi"), wilson(agreed, len(group)))),
                "kl": _mean(float(r["kl"]) for r in group),
                "flip": _mean(float(r["flip"]) for r in group),
                **_bytes(group, full_bytes),
            }
        )
    return sorted(rows, key=_row_order)


def _bytes(group: Sequence[dict], full_bytes: dict) -> dict:
    """bytes: the mean kept-pair bytes per answer's context; bytes_share: 100 x their mean share of the full cache's
    (None without bytes in every record)."""
    if not all("bytes" in r and (r["task"], r["example"]) in full_bytes for r in group):
        return {"bytes": None, "bytes_share": None}
    return {
        "bytes": _mean(r["bytes"] for r in group),
        "bytes_share": 100 * _mean(r["bytes"] / full_bytes[r["task"], r["example"]] for r in group),
    }
