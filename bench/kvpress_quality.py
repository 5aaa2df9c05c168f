"""NVIDIA kvpress KVzipPress answer quality on bench/quality.py's contexts and questions: the peer's side of the
quality table (full cache vs KVzipPress at one ratio, every question asked of one compressed cache).

Run with the kvpress venv (bash bench/setup_kvpress_venv.sh), never with the project's venv:

    .venv-kvpress/bin/python bench/kvpress_quality.py --gguf checkpoints/_gguf/qwen2.5-coder-0.5b-instruct.gguf \\
        [--ratio 0.3] [--instruction kvzip|none|TEXT] [--max-new-tokens 32] [--contexts incident,museum]

Model: transformers float32 on CPU (sdpa), loaded as in kvpress_peer.py. For each bundled context
(kvzip_jax/data/quality/*.json) kvpress's "kv-press-text-generation" pipeline answers its six questions
("\\n\\n" + question, greedy, at most --max-new-tokens) from the full cache (press=None) and from one KVzipPress cache
(compression_ratio = 1 - ratio). The instruction (default KVzip's, as bench/quality.py uses) opens the context text:
the pipeline has no never-evicted prefix beyond its chat template, so KVzipPress may evict it, which is how a
kvpress user would pass it. Correct: the expected answer occurs in the answer (case-insensitive); equal: the same
text as the full cache's answer. One JSON line per answer on stdout, then the totals.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers
from kvpress import KVzipPress
from kvpress_peer import load, log  # sets the offline environment, imports torch, transformers and kvpress
from transformers import pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "kvzip_jax", "data")
# kvzip_jax.prompts.KVZIP_INSTRUCTION, restated: this venv has no kvzip_jax (see kvpress_peer.py).
KVZIP_INSTRUCTION = "Given the context, answer to the following question or request without explanation."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="GGUF file (transformers dequantizes it to float32)")
    src.add_argument("--model-path", help="HF model folder (config, weights, tokenizer)")
    p.add_argument("--ratio", type=float, default=0.3, help="fraction of KV pairs kept (compression_ratio = 1-ratio)")
    p.add_argument("--instruction", default="kvzip", help='"kvzip" (KVzip\'s task instruction), "none", or any text')
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", help="comma-separated context names (default: all bundled)")
    args = p.parse_args()
    paths = {os.path.splitext(os.path.basename(x))[0]: x for x in glob.glob(os.path.join(DATA, "quality", "*.json"))}
    wanted = sorted(paths) if not args.contexts else [c.strip() for c in args.contexts.split(",")]
    unknown = sorted(set(wanted) - set(paths))
    if unknown:
        p.error(f"unknown context(s) {', '.join(unknown)}; bundled: {', '.join(sorted(paths))}")
    if not 0 < args.ratio <= 1:
        p.error(f"--ratio must lie in (0, 1], got {args.ratio}")
    instruction = {"kvzip": KVZIP_INSTRUCTION, "none": None}.get(args.instruction, args.instruction)

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tmp = tempfile.mkdtemp(prefix="kvpress_quality_tok_")
    atexit.register(shutil.rmtree, tmp, True)
    args.context = os.path.join(DATA, "demo_document.txt")  # load() checks the tokenizer round trip on it
    model, tok = load(args, tmp)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    log(f"ratio {args.ratio}; instruction {instruction!r}")

    records = []
    for name in wanted:
        with open(paths[name], encoding="utf-8") as f:
            item = json.load(f)
        context = item["context"].strip() if instruction is None else instruction + "\n\n" + item["context"].strip()
        questions = ["\n\n" + q["question"] for q in item["questions"]]
        start = time.perf_counter()
        full = pipe(context, questions=questions, press=None, max_new_tokens=args.max_new_tokens)["answers"]
        press = KVzipPress(compression_ratio=1 - args.ratio)
        compressed = pipe(context, questions=questions, press=press, max_new_tokens=args.max_new_tokens)["answers"]
        for q, f_answer, c_answer in zip(item["questions"], full, compressed):
            expected = q["answer"].lower()
            record = dict(
                context=name,
                question=q["question"],
                expected=q["answer"],
                full=f_answer.strip(),
                compressed=c_answer.strip(),
                full_correct=expected in f_answer.lower(),
                correct=expected in c_answer.lower(),
                equal=f_answer.strip() == c_answer.strip(),
            )
            records.append(record)
            print(json.dumps(record, ensure_ascii=False), flush=True)
        log(f"{name}: {time.perf_counter() - start:.0f} s")
    n = len(records)
    print(
        f"kvpress {importlib.metadata.version('kvpress')} KVzipPress at ratio {args.ratio:g}: full cache "
        f"{sum(r['full_correct'] for r in records)}/{n} right; compressed {sum(r['correct'] for r in records)}/{n} "
        f"right, {sum(r['equal'] for r in records)}/{n} equal to the full cache's answers"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
