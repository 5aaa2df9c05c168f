"""Compression while decoding on a long generation that depends on what the model wrote earlier: the same text held
by the full cache and by a cache cut back to a budget every 128 tokens by a trained scorer
(kvzip_jax/scorers/decoding.py), compared token by token.

    python bench/decode_compression.py [--model qwen2.5-coder-0.5b-instruct] [--kind linear|gate] [--samples 4]
        [--items 40] [--max-new-tokens 800] [--budget 200] [--questions 6] [--out FILE]

Each sample asks the model to write a numbered list of --items fictional inventors with a four-digit invention
number each, sampled (temperature 0.7, seed per sample) with the whole cache. That text is then fed to the cutting
loop (decoding.generate with forced=: the cache cut to --budget pairs per (layer, KV head) on average, default a
quarter of --max-new-tokens, first 4 and last 128 tokens kept, exactly as while generating), so both caches hold the
same text and differ only by what the cuts evicted. Measured per sample:
- agreement: at each position after the first cut, whether the cut cache's greedy next token equals the full
  cache's (1.0 = the cuts changed no prediction); the lists repeat names and number patterns, so later items depend
  on earlier ones;
- questions: --questions "What is the invention number of item K?" (items spread over the list) answered greedily
  from each cache; right against the number the text holds for item K, the cut cache's answer equal to the full
  cache's, and the log-probability each cache gives that number as the answer (teacher-forced, mean per question);
- the pairs held at the end and each cut's pairs before and after with its bytes.
--out writes the table (markdown).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
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


QUESTION = "What is the invention number of item {item}? Answer with the number."


def ask(model, cache, item: int, max_new_tokens: int = 12):
    """(the greedy answer to one question appended to the cache, the cache as it was)."""
    tok = model.tokenizer
    suffix = prompts.question_suffix(tok, QUESTION.format(item=item))
    stops = prompts.stop_token_ids(tok)
    answer, cache = gen.ask(model.params, model.cfg, cache, suffix, max_new_tokens, stop_tokens=stops)
    return tok.decode(answer), cache


def answer_logprob(model, cache, item: int, number: str):
    """(log-probability of the number the text holds as the answer to the question on item, teacher-forced; the
    cache as it was)."""
    tok = model.tokenizer
    suffix = prompts.question_suffix(tok, QUESTION.format(item=item))
    answer = np.asarray(tok.encode(number, add_special_tokens=False), np.int32)
    tokens = np.concatenate([suffix, answer])
    mark = kv.mark(cache)
    logits, cache = gen.forward_step(
        model.params, jnp.asarray(tokens[None]), jnp.full((1,), tokens.size), cache, model.cfg, logits="all"
    )
    logp = jax.nn.log_softmax(logits[0, suffix.size - 1 : -1], axis=-1)  # [A, V] each answer token's prediction
    return float(jnp.take_along_axis(logp, jnp.asarray(answer)[:, None], axis=-1).sum()), kv.rewind(cache, mark)


def full_run(model, sample: int, args):
    """(prompt ids [P], generated ids [N], the full cache holding both) of one sample, sampled with the whole cache."""
    tok = model.tokenizer
    ids = np.asarray(prompts.build_prompt(tok, TASK.format(items=args.items)).tokens, np.int32)
    sampling = gen.Sampling.make(temperature=0.7, top_p=0.95, seed=sample)
    stops = prompts.stop_token_ids(tok)
    logits, cache = gen.prefill(model.params, model.cfg, [ids], reserve=args.max_new_tokens + 64)
    out, cache = gen.decode(
        model.params, model.cfg, logits, cache, args.max_new_tokens, stop_tokens=stops, sampling=sampling
    )
    return ids, np.asarray([t for t in out[0] if t not in stops], np.int32), cache  # a stop token is not fed


def full_predictions(model, ids: np.ndarray, text: np.ndarray) -> np.ndarray:
    """[N] the full cache's greedy next token after each token of text, fed in blocks as the cutting loop feeds it."""
    _, cache = gen.prefill(model.params, model.cfg, [ids], reserve=text.size + 64)
    predicted = []
    for start in range(0, text.size, decoding.INTERVAL):
        block, cache = decoding.predictions(model.params, model.cfg, cache, text[start : start + decoding.INTERVAL])
        predicted += block
    return np.asarray(predicted)


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
        "| sample | tokens | items written | same next token after the first cut | questions | right (full) "
        "| right (cut) | cut answer = full answer | log p(right number) (full) | (cut) | pairs at the end (full) "
        "| (cut) | cuts (tokens written: pairs before -> after, bytes) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    sums = dict(same=0, positions=0, asked=0, right_full=0, right_cut=0, equal=0, logprob_full=0.0, logprob_cut=0.0)
    for sample in range(args.samples):
        ids, text, full = full_run(model, sample, args)
        items = written(model.tokenizer.decode(text.tolist()))
        reference = full_predictions(model, ids, text)
        predicted, cut, cuts = decoding.generate(
            model.params, model.cfg, ids, text.size, scorer=the_scorer, budget=budget, forced=text, reserve=64
        )
        after = cuts[0].generated if cuts else text.size  # positions after the first cut
        same = int((np.asarray(predicted)[after:] == reference[after:]).sum())
        asked = [int(k) for k in np.linspace(1, args.items, args.questions).round().astype(int) if k in items]
        right_full = right_cut = equal = 0
        logprob_full = logprob_cut = 0.0
        for k in asked:
            answer_full, full = ask(model, full, k)
            answer_cut, cut = ask(model, cut, k)
            right_full += items[k] in answer_full
            right_cut += items[k] in answer_cut
            equal += answer_cut == answer_full
            logp, full = answer_logprob(model, full, k, items[k])
            logprob_full += logp
            logp, cut = answer_logprob(model, cut, k, items[k])
            logprob_cut += logp
        row = dict(same=same, positions=text.size - after, asked=len(asked), right_full=right_full)
        row.update(right_cut=right_cut, equal=equal, logprob_full=logprob_full, logprob_cut=logprob_cut)
        for key, value in row.items():
            sums[key] += value
        pairs = [int(kv.kept_per_head(c).sum()) for c in (full, cut)]
        per = max(len(asked), 1)
        cut_text = "; ".join(f"{c.generated}: {c.held} -> {c.kept} ({c.bytes:,} B)" for c in cuts) or "-"
        lines.append(
            f"| {sample} | {text.size} | {len(items)} | {same}/{text.size - after} | {len(asked)} | {right_full} "
            f"| {right_cut} | {equal} | {logprob_full / per:.2f} | {logprob_cut / per:.2f} "
            f"| {pairs[0]} | {pairs[1]} | {cut_text} |"
        )
        print(lines[-1], flush=True)
    agreement = sums["same"] / max(sums["positions"], 1)
    n = max(sums["asked"], 1)
    lines += [
        "",
        f"agreement after the first cut: {sums['same']}/{sums['positions']} = {100 * agreement:.1f}% of the full "
        f"cache's next tokens; questions: right {sums['right_full']}/{sums['asked']} full, {sums['right_cut']}/"
        f"{sums['asked']} cut; the cut cache's answer equal to the full cache's on {sums['equal']}/{sums['asked']}; "
        f"mean log-probability of the right number {sums['logprob_full'] / n:.2f} full, "
        f"{sums['logprob_cut'] / n:.2f} cut",
    ]
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
