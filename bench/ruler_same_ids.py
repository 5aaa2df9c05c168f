"""Do we feed the model kvpress's token ids? Our layout of a kvpress-format file's samples against the ids kvpress's
own pipeline preprocessing produced for them (bench/kvpress_ruler.py --dump-ids).

    python bench/ruler_same_ids.py --dataset samples.jsonl --ids kvpress-ids.json \\
        --tokenizer checkpoints/qwen2.5-coder-0.5b-instruct/tokenizer [--instruction none]

For each sample in IDS (kvpress's first context of each task): ours = kvzip_jax.eval.batches.laid_out (the layout the
sweep feeds: [prefix | context] once, then each question's suffix), theirs = the pipeline's context_ids and
question_ids. Prints one line per sample (equal, or where the ids first differ) and exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvzip_jax import prompts
from kvzip_jax.eval.batches import laid_out
from kvzip_jax.eval.tasks import dataset
from kvzip_jax.weights.tokenizer import tokenizer_from_hf


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where two id lists differ (the shorter one's length if one opens the other); None if equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="the kvpress-format file both sides read")
    p.add_argument("--ids", required=True, help="bench/kvpress_ruler.py --dump-ids output")
    p.add_argument("--tokenizer", required=True, help="an HF tokenizer folder (a converted checkpoint's tokenizer/)")
    p.add_argument("--instruction", default="none", help='as kvzip-jax eval\'s (kvpress has none: "none")')
    args = p.parse_args(argv)
    tokenizer = tokenizer_from_hf(args.tokenizer)
    examples = {(ex.task, ex.id): ex for ex in dataset.read(args.dataset).examples}
    instruction = prompts.named_instruction(args.instruction)
    differ = 0
    for dumped in json.loads(open(args.ids, encoding="utf-8").read()):
        key = (dumped["task"], str(dumped["example"]))
        if key not in examples:
            print(f"{key}: not in {args.dataset}", file=sys.stderr)
            return 2
        context, suffixes = laid_out(tokenizer, examples[key], instruction)
        pairs = [("context", list(context.tokens), dumped["context_ids"])]
        pairs += [(f"question {i}", s.tolist(), t) for i, (s, t) in enumerate(zip(suffixes, dumped["question_ids"]))]
        report = []
        for what, ours, theirs in pairs:
            at = first_difference(ours, theirs)
            if at is not None:
                report.append(f"{what} differs at id {at} (ours {len(ours)} ids, kvpress {len(theirs)})")
        if len(suffixes) != len(dumped["question_ids"]):
            report.append(f"{len(suffixes)} questions, kvpress {len(dumped['question_ids'])}")
        differ += bool(report)
        counts = f"{len(context)} + {', '.join(str(len(s)) for s in suffixes)} ids"
        print(f"{key[0]} {key[1]}: {'; '.join(report) if report else 'equal'} ({counts})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
