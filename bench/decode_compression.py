"""Compression while decoding on a long generation whose answers depend on what the model wrote earlier: the full
cache beside a cache cut back to a budget every 128 tokens by a trained scorer (kvzip_jax/scorers/decoding.py).

    python bench/decode_compression.py [--model qwen2.5-coder-0.5b-instruct] [--kind linear|gate] [--samples 4]
        [--items 40] [--max-new-tokens 800] [--budget 200] [--questions 6] [--out FILE]

Each sample asks the model to write a numbered list of --items fictional inventors with a four-digit invention
number each ("N. NAME from CITY, invention NNNN."), sampled (temperature 0.7, seed per sample). The same sample is
generated twice: with the whole cache, and with the cache cut to --budget pairs per (layer, KV head) on average
(default a quarter of --max-new-tokens; first 4 and last 128 tokens kept). Then, from each run's own final cache,
--questions questions ("What is the invention number of item K?", items spread over the list) are answered
greedily, and each answer is scored against the number that run itself wrote for item K (a run whose list lacks
item K does not score it). Printed per run: items written, questions scored, right, the cache's pairs at the end,
and each cut's pairs before and after with its bytes; then the score of the cut runs as a share of the full
runs'. --out writes the table (markdown).
"""

from __future__ import annotations

import argparse
import re

import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import prompts
from kvzip_jax.scorers import decoding, scorer
from kvzip_jax.weights import registry

LINE = re.compile(r"^\s*(\d+)\.\s.*?(\d{4,})\D*$", re.M)  # "N. ... NUMBER": the last number of 4+ digits
TASK = (
    "Write a numbered list of {items} fictional inventors. For each, give the name, the city and a four-digit "
    "invention number, exactly in the form: 'N. NAME from CITY, invention NNNN.' Write nothing else."
)


def written(text: str) -> dict[int, str]:
    """{item number: its invention number} of the list a run wrote: the last number of 4 or more digits on each
    numbered line, the first line of each item number (the model does not always keep the asked form)."""
    found = {}
    for number, code in LINE.findall(text):
        found.setdefault(int(number), code)
    return found


def ask(model, cache, item: int, max_new_tokens: int = 12):
    """(the greedy answer to one question appended to the cache, the cache as it was)."""
    tok = model.tokenizer
    suffix = prompts.question_suffix(tok, f"What is the invention number of item {item}? Answer with the number.")
    stops = prompts.stop_token_ids(tok)
    answer, cache = gen.ask(model.params, model.cfg, cache, suffix, max_new_tokens, stop_tokens=stops)
    return tok.decode(answer), cache


def run_one(model, sample: int, args, the_scorer, budget: int | None):
    """(text, cache, cuts) of one sample's generation, cut to budget (None: the whole cache)."""
    tok = model.tokenizer
    ids = np.asarray(prompts.build_prompt(tok, TASK.format(items=args.items)).tokens, np.int32)
    sampling = gen.Sampling.make(temperature=0.7, top_p=0.95, seed=sample)
    stops = prompts.stop_token_ids(tok)
    if budget is None:
        logits, cache = gen.prefill(model.params, model.cfg, [ids], reserve=args.max_new_tokens + 64)
        out, cache = gen.decode(
            model.params, model.cfg, logits, cache, args.max_new_tokens, stop_tokens=stops, sampling=sampling
        )
        return tok.decode([t for t in out[0] if t not in stops]), cache, []
    out, cache, cuts = decoding.generate(
        model.params,
        model.cfg,
        ids,
        args.max_new_tokens,
        scorer=the_scorer,
        budget=budget,
        stop_tokens=stops,
        sampling=sampling,
        reserve=64,
    )
    return tok.decode([t for t in out if t not in stops]), cache, cuts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--kind", default="linear", choices=("linear", "gate"))
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=800)
    parser.add_argument("--budget", type=int, help="pairs per (layer, KV head) on average (default max-new-tokens / 4)")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    model = registry.load(args.model)
    the_scorer = scorer.load(model, args.kind)
    budget = args.budget or args.max_new_tokens // 4
    lines = [
        f"{model.name}, {args.kind} scorer, budget {budget} pairs per head (first 4, last 128 kept, cut every 128)",
        "",
        "| sample | cache | items written | scored | right | pairs at the end | cuts (pairs before -> after, bytes) |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    totals = {"full": [0, 0], "cut": [0, 0]}
    for sample in range(args.samples):
        for name, limit in (("full", None), ("cut", budget)):
            text, cache, cuts = run_one(model, sample, args, the_scorer, limit)
            items = written(text)
            asked = [k for k in np.linspace(1, args.items, args.questions).round().astype(int) if k in items]
            right = 0
            for k in asked:
                answer, cache = ask(model, cache, int(k))
                right += items[k] in answer
            totals[name][0] += right
            totals[name][1] += len(asked)
            pairs = int(kv.kept_per_head(cache).sum())
            cut_text = "; ".join(f"{c.held} -> {c.kept} ({c.bytes:,} B)" for c in cuts) or "-"
            lines.append(f"| {sample} | {name} | {len(items)} | {len(asked)} | {right} | {pairs} | {cut_text} |")
            print(lines[-1], flush=True)
    full, cut = (totals[k][0] / max(totals[k][1], 1) for k in ("full", "cut"))
    lines += [
        "",
        f"right: full {totals['full'][0]}/{totals['full'][1]}, cut {totals['cut'][0]}/{totals['cut'][1]}"
        f" -> the cut runs keep {100 * cut / full if full else float('nan'):.0f}% of the full runs' score",
    ]
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
