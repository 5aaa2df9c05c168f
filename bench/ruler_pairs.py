"""Our RULER answers beside kvpress's, paired per sample at the same ratio.

Prints, per method and ratio, each task's score on both sides, the paired difference ours - kvpress with its 95%
bootstrap interval and the full caches' agreement, as a markdown table. Throughput is not here: the records' seconds
of the two sides time different things (ours leave out the batch's prefill and scoring); bench/ruler_throughput.py
times both sides' whole runs on the same samples.

    python bench/ruler_pairs.py OURS [OURS ...] --kvpress KVPRESS.jsonl [--map press=method,...] [--out FILE]

OURS: `kvzip-jax eval` results files (results.jsonl or results.jsonl.gz; quantized caches named as the report names
them, statistics.labelled). KVPRESS: one JSON object a line, {"task", "example" (our example id), "question" (int),
"press" ("none" for the full cache), "compression_ratio", "prediction", "references"}. A kvpress line pairs with our
record of the same (task, example, question), of the method its press maps to (--map), at ratio 1 - compression_ratio
(in --mode, reuse by default: kvpress's presses see no question; the full cache in mode full).

kvpress's predictions are scored here with our metric of the paired record (kvzip_jax.eval.metrics.score, which ours
were scored with: a blank prediction scores 0; string_match_all first cleans the prediction as RULER does, stripped,
each control character \\x00-\\x1f made a newline, stripped again, where kvpress deletes control characters; a
reference never holds one, so a match differs only where a control character splits a reference's letters).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from kvzip_jax.eval import metrics, statistics
from kvzip_jax.eval.leaderboard import paired_difference
from kvzip_jax.eval.report import read_records

PRESSES = {"none": "full", "kvzip": "kvzip", "snapkv": "snapkv", "streaming_llm": "streamingllm"}
KVPRESS_FIELDS = ("task", "example", "question", "press", "compression_ratio", "prediction", "references")
AVERAGE = "average"


def press_map(overrides: str | None) -> dict[str, str]:
    """PRESSES updated by "press=method,press=method" pairs."""
    mapping = dict(PRESSES)
    for item in filter(None, (overrides or "").split(",")):
        press, sep, method = item.partition("=")
        if not sep or not press.strip() or not method.strip():
            raise ValueError(f"--map takes press=method pairs, got {item!r}")
        mapping[press.strip()] = method.strip()
    return mapping


def _sample(item: Mapping) -> tuple[str, str, int]:
    """(task, example, question) of a record or a kvpress line."""
    return item["task"], str(item["example"]), int(item["question"])


def our_records(records: Sequence[dict]) -> dict[tuple, dict]:
    """(method, mode, ratio, task, example, question) -> record, after statistics.labelled; raises on a key twice."""
    statistics.check_records(records)
    keyed = {}
    for r in map(statistics.labelled, records):
        key = (r["method"], r["mode"], round(float(r["ratio"]), 6), *_sample(r))
        if key in keyed:
            raise ValueError(f"our records hold {key} twice")
        keyed[key] = r
    return keyed


def pair(
    ours: Mapping[tuple, dict], theirs: Iterable[dict], presses: Mapping[str, str], mode: str = "reuse"
) -> tuple[dict[tuple, list], collections.Counter]:
    """Pairs kvpress lines with our records (module docstring). Returns (pairs, unpaired): pairs maps (method, ratio)
    to [(our record, kvpress line, kvpress score 0..1)]; unpaired counts kvpress lines by reason."""
    pairs, unpaired, seen = collections.defaultdict(list), collections.Counter(), set()
    for i, line in enumerate(theirs):
        missing = [f for f in KVPRESS_FIELDS if f not in line]
        if missing:
            raise ValueError(f"kvpress line {i + 1} lacks {missing}")
        if line["press"] not in presses:
            unpaired[f"press {line['press']!r} not mapped"] += 1
            continue
        method = presses[line["press"]]
        ratio = round(1.0 - float(line["compression_ratio"]), 6)
        sample = _sample(line)
        if (method, ratio, sample) in seen:
            raise ValueError(f"kvpress lines hold {(line['press'], line['compression_ratio'], sample)} twice")
        seen.add((method, ratio, sample))
        record = ours.get((method, "full" if method == "full" else mode, ratio, *sample))
        if record is None:
            unpaired[f"no record of ours for {method} at {ratio:g}"] += 1
            continue
        score = metrics.score(record["metric"], str(line["prediction"]), list(line["references"]))
        pairs[method, ratio].append((record, line, score))
    return dict(pairs), unpaired


def compare(pairs: Mapping[tuple, list], seed: int = 0) -> list[dict]:
    """Rows per (method, ratio), full cache first, then method, descending ratio: one per task and one for the
    average over tasks (task AVERAGE): n, ours, theirs, difference, difference_lo, difference_hi (%,
    leaderboard.paired_difference), full_agree (% of the paired samples whose two full-cache predictions are equal
    after stripping whitespace; None where no sample has both)."""
    full = {_sample(r): (r["prediction"], line["prediction"]) for r, line, _ in pairs.get(("full", 1.0), [])}
    rows = []
    for method, ratio in sorted(pairs, key=lambda k: (k[0] != "full", k[0], -k[1])):
        by_task = collections.defaultdict(list)
        for item in pairs[method, ratio]:
            by_task[item[0]["task"]].append(item)
        per_task, average = paired_difference(
            {t: [float(r["score"]) for r, _, _ in items] for t, items in by_task.items()},
            {t: [score for _, _, score in items] for t, items in by_task.items()},
            seed,
        )
        for task, stats in [*per_task.items(), (AVERAGE, average)]:
            paired = pairs[method, ratio] if task == AVERAGE else by_task[task]
            both = [full[_sample(r)] for r, _, _ in paired if _sample(r) in full]
            rows.append(
                {
                    "method": method,
                    "ratio": ratio,
                    "task": task,
                    **stats,
                    "full_agree": 100 * sum(a.strip() == b.strip() for a, b in both) / len(both) if both else None,
                }
            )
    return rows


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(rows: Sequence[dict]) -> str:
    """The compare rows as a markdown table ("ruler_" stripped from task names; "-" marks None)."""
    lines = [
        "| method | ratio | compression_ratio | task | n | ours (%) | kvpress (%) | ours - kvpress [95%] "
        "| full caches agree (%) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        difference = f"{r['difference']:+.1f} [{r['difference_lo']:+.1f}, {r['difference_hi']:+.1f}]"
        cells = [r["method"], f"{r['ratio']:g}", f"{round(1 - r['ratio'], 6):g}", r["task"].removeprefix("ruler_")]
        cells += [str(r["n"]), _cell(r["ours"]), _cell(r["theirs"]), difference, _cell(r["full_agree"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ours", nargs="+", help="our results files (results.jsonl or results.jsonl.gz)")
    parser.add_argument("--kvpress", required=True, help="kvpress's answers, JSONL (module docstring)")
    parser.add_argument("--map", help=f"press=method pairs over the defaults {PRESSES}")
    parser.add_argument("--mode", default="reuse", help="our mode paired with the presses (default reuse)")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    ours = our_records([r for path in args.ours for r in read_records(path)])
    pairs, unpaired = pair(ours, read_records(args.kvpress), press_map(args.map), args.mode)
    for reason, count in sorted(unpaired.items()):
        print(f"unpaired: {count} kvpress lines: {reason}", file=sys.stderr)
    if not pairs:
        print("no kvpress line pairs with a record of ours", file=sys.stderr)
        return 1
    text = markdown(compare(pairs))
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
