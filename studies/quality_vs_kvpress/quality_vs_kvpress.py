"""Our KVzip against kvpress' KVzipPress on the 48 bundled questions at ratio 0.3: right answers of each and a 95%
interval on the difference, paired by question (Wald interval on the mean of per-question differences).

    python studies/quality_vs_kvpress/quality_vs_kvpress.py [--ours bench/results/quality.json]
        [--peer bench/results/kvpress-quality.txt] > studies/quality_vs_kvpress/results/quality-vs-kvpress.txt

Its inputs are two bench runs' outputs (bench/quality.py --json-out, bench/kvpress_quality.py); paths are relative
to the repository root; a FILE that is not there is read from FILE.gz (the committed bench/results/quality*.json.gz).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os


def _open(path: str):
    """path as text, or path.gz where only that exists."""
    return gzip.open(path + ".gz", "rt") if not os.path.exists(path) and os.path.exists(path + ".gz") else open(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", default="bench/results/quality.json", help="bench/quality.py --json-out")
    parser.add_argument("--peer", default="bench/results/kvpress-quality.txt", help="bench/kvpress_quality.py output")
    parser.add_argument("--ratio", type=float, default=0.3)
    args = parser.parse_args(argv)
    ours = {
        (r["context"], r["question"]): r["correct"]
        for r in json.load(_open(args.ours))
        if r["level"] == "pair" and r["ratio"] == args.ratio
    }
    peer = {}
    for line in _open(args.peer):
        if line.startswith("{"):
            r = json.loads(line)
            peer[(r["context"], r["question"])] = r["correct"]
    keys = sorted(set(ours) & set(peer))
    if len(keys) != len(ours) or len(keys) != len(peer):
        raise SystemExit(f"the two runs do not cover the same questions ({len(ours)} ours, {len(peer)} peer)")
    n = len(keys)
    diffs = [int(ours[k]) - int(peer[k]) for k in keys]
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    print(
        f"ratio {args.ratio}, {n} questions: ours {sum(ours[k] for k in keys)}/{n} right, kvpress KVzipPress "
        f"{sum(peer[k] for k in keys)}/{n}; difference {mean * n:+.0f} questions ({mean:+.3f}), 95% interval "
        f"[{(mean - half) * n:+.1f}, {(mean + half) * n:+.1f}] questions; discordant: ours only "
        f"{sum(d > 0 for d in diffs)}, kvpress only {sum(d < 0 for d in diffs)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
