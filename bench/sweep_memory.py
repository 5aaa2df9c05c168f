"""Sweep peak memory against the number of tasks: the same sweep over 1 task and over N tasks of the same shape,
each in a fresh process, peak RSS side by side (it should stay flat: nothing a batch leaves behind may pile up).

    python bench/sweep_memory.py [--model smollm2-135m-instruct] [--tasks niah,passkey,multi_needle,variable_tracking]
                                 [--contexts 8] [--context-tokens 640] [--methods kvzip,snapkv] [--ratios 1,0.3]

Each run is `kvzip-jax eval` in a child process (its peak resident set from wait4), into a fresh folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def peak_rss(command: list[str]) -> tuple[float, float]:
    """(peak resident set in GiB, wall seconds) of a child process; raises if it fails."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed with exit code {child.returncode}")
    return usage.ru_maxrss / 2**20, time.perf_counter() - start  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", default="niah,passkey,multi_needle,variable_tracking")
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--context-tokens", type=int, default=640)
    parser.add_argument("--methods", default="kvzip,snapkv")
    parser.add_argument("--ratios", default="1,0.3")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    rows = []
    for count in sorted({1, len(tasks)}):
        with tempfile.TemporaryDirectory() as out:
            command = [
                sys.executable,
                "-m",
                "kvzip_jax.cli",
                "eval",
                "--model",
                args.model,
                "--tasks",
                ",".join(tasks[:count]),
                "--contexts",
                str(args.contexts),
                "--context-tokens",
                str(args.context_tokens),
                "--batch-size",
                str(args.contexts),
                "--methods",
                args.methods,
                "--ratios",
                args.ratios,
                "--questions-per-context",
                "3",
                "--out",
                out,
                "--no-progress",
            ]
            gib, seconds = peak_rss(command)
        rows.append((count, gib, seconds))
        print(f"{count} task(s): peak RSS {gib:.2f} GiB, {seconds:.0f} s", flush=True)
    print(
        f"\n{args.model}; {args.contexts} contexts x ~{args.context_tokens} tokens per task; methods {args.methods}; "
        f"ratios {args.ratios}\n"
    )
    print("| tasks | peak RSS (GiB) | seconds |\n|---|---|---|")
    for count, gib, seconds in rows:
        print(f"| {count} ({','.join(tasks[:count])}) | {gib:.2f} | {seconds:.0f} |")
    if len(rows) == 2:
        print(f"\npeak RSS {len(tasks)} tasks / 1 task: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
