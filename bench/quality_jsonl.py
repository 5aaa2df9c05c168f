"""The 48 bundled questions (kvzip_jax/data/quality/*.json: 8 contexts x 6 questions) as a JSONL task file for
`kvzip-jax eval --jsonl`, scored by inclusion (the expected answer occurs in the answer, case-insensitive), as
bench/quality.py scores them.

    python bench/quality_jsonl.py [--out bench/results/quality.jsonl]
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path


def records() -> list[dict]:
    """One record per bundled context, in name order."""
    folder = resources.files("kvzip_jax") / "data" / "quality"
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        item = json.loads(entry.read_text())
        out.append(
            {
                "id": Path(entry.name).stem,
                "task": "quality",
                "context": item["context"],
                "queries": [q["question"] for q in item["questions"]],
                "answers": [q["answer"] for q in item["questions"]],
                "metric": "inclusion",
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/quality.jsonl")
    args = parser.parse_args(argv)
    rows = records()
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} contexts, {sum(len(r['queries']) for r in rows)} questions -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
