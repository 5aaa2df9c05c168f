"""Answers per minute on the same RULER samples: kvzip-jax's sweep and kvpress's pipeline, one after the other in
one run on this machine, each a fresh process timed from start to exit (loading, compiling, tokenizing included).

    .venv/bin/python bench/ruler_throughput.py --model qwen2.5-coder-0.5b-instruct \\
        --gguf checkpoints/_gguf/qwen2.5-coder-0.5b-instruct.gguf \\
        --dataset bench/results/ruler-4096-qwen2.5-coder-0.5b/samples.jsonl \\
        --tasks ruler_niah_single_1 --contexts 5 --ratio 0.3 --out DIR

DIR (which must not exist: a timing is never resumed) gets samples.jsonl, the first --contexts contexts of each
--tasks task of --dataset (kvpress's format, with our ids), then:
  ours     kvzip-jax eval --dataset DIR/samples.jsonl --methods kvzip,snapkv --ratios R --instruction none
           --batch-size --contexts --out DIR/ours: one prefill and one scoring per context serve every cache, the
           contexts batched;
  kvpress  .venv-kvpress/bin/python bench/kvpress_ruler.py --dataset DIR/samples.jsonl --presses none,kvzip,snapkv
           --compression-ratios 1-R --out DIR/kvpress.jsonl: one context and one press at a time, each call
           prefilling again, as kvpress's evaluation runs.
Both answer every question from the full cache, KVzip and SnapKV at R kept (three answers per question; the run
fails if the counts differ). The table (answers, seconds, answers per minute, ours over kvpress) is printed and kept
in DIR/throughput.md; the answers themselves pair with bench/ruler_pairs.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OURS = ("kvzip", "snapkv")  # besides the full cache, which the sweep always answers
PRESSES = ("none", "kvzip", "snapkv")


def subset(rows: list[dict], tasks: list[str], contexts: int) -> list[dict]:
    """The rows of the first `contexts` contexts (by id, in file order) of each task, in file order."""
    missing = sorted(set(tasks) - {r["task"] for r in rows})
    if missing:
        raise SystemExit(f"ruler_throughput: no rows of {missing} in the dataset")
    kept: dict[str, list[str]] = {t: [] for t in tasks}
    for r in rows:
        ids = kept.get(r["task"])
        if ids is not None and r["id"] not in ids and len(ids) < contexts:
            ids.append(r["id"])
    return [r for r in rows if r["id"] in kept.get(r["task"], ())]


def timed(command: list[str]) -> float:
    """Runs command (its output passed through), returns its wall seconds; a failure stops the bench."""
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"ruler_throughput: the command above exited with {done.returncode}")
    return seconds


def count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def table(rows: list[tuple[str, int, float]]) -> str:
    """Markdown: each side's answers, seconds and answers per minute, then ours over kvpress."""
    lines = ["| side | answers | seconds | answers / min |", "|---|---:|---:|---:|"]
    rates = {}
    for side, answers, seconds in rows:
        rates[side] = 60 * answers / seconds
        lines.append(f"| {side} | {answers} | {seconds:.0f} | {rates[side]:.2f} |")
    ours, theirs = rates["kvzip-jax"], rates["kvpress"]
    lines.append(f"\nThroughput, ours over kvpress: **{ours / theirs:.2f}x**")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="our converted model (kvzip-jax eval --model)")
    parser.add_argument("--gguf", required=True, help="the same model's GGUF for kvpress (kvpress_ruler.py --gguf)")
    parser.add_argument("--dataset", required=True, help="kvpress-format JSONL with ids (eval --write-dataset)")
    parser.add_argument("--tasks", required=True, help="comma-separated tasks of the dataset")
    parser.add_argument("--contexts", type=int, default=5, help="contexts per task (one batch on our side)")
    parser.add_argument("--ratio", type=float, default=0.3, help="fraction kept (kvpress: 1 - it removed)")
    parser.add_argument("--out", required=True, help="a new folder")
    parser.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.error(f"{out} exists: a timing is never resumed; give a new folder")
    if not 0 < args.ratio < 1:
        parser.error(f"--ratio must be in (0, 1), got {args.ratio}")
    if not Path(args.kvpress_python).is_file():
        parser.error(f"no {args.kvpress_python}: make kvpress's venv with bash bench/setup_kvpress_venv.sh")
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    rows = subset(rows, [t.strip() for t in args.tasks.split(",") if t.strip()], args.contexts)
    out.mkdir(parents=True)
    samples = out / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = len(rows)

    ours = [sys.executable, "-m", "kvzip_jax.cli", "eval", "--model", args.model, "--dataset", str(samples)]
    ours += ["--methods", ",".join(OURS), "--ratios", str(args.ratio), "--instruction", "none"]
    ours += ["--batch-size", str(args.contexts), "--out", str(out / "ours"), "--no-progress"]
    kvpress = [args.kvpress_python, str(HERE / "kvpress_ruler.py"), "--gguf", args.gguf, "--dataset", str(samples)]
    kvpress += ["--presses", ",".join(PRESSES), "--compression-ratios", f"{1 - args.ratio:g}"]
    kvpress += ["--out", str(out / "kvpress.jsonl")]
    seconds = {"kvzip-jax": timed(ours), "kvpress": timed(kvpress)}
    answers = {"kvzip-jax": count_lines(out / "ours" / "results.jsonl"), "kvpress": count_lines(out / "kvpress.jsonl")}
    expected = questions * (1 + len(OURS))
    if set(answers.values()) != {expected}:
        raise SystemExit(f"ruler_throughput: answers {answers}, expected {expected} on each side")
    text = (
        f"{questions} questions ({args.tasks}, {args.contexts} contexts each), full cache + KVzip + SnapKV at "
        f"{args.ratio:g} kept: {expected} answers a side; wall time of each process, start to exit.\n\n"
        + table([(side, answers[side], seconds[side]) for side in seconds])
    )
    (out / "throughput.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
