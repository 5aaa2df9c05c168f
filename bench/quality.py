"""KVzip answer quality: many questions asked of one compressed cache, per ratio, against the full cache.

    python bench/quality.py [--model qwen2.5-coder-0.5b-instruct] [--ratios 1.0,0.9,0.7,0.5,0.3,0.2,0.1]
                            [--level pair[,layer,...]] [--max-new-tokens 32] [--contexts incident,museum]
                            [--chunk-size N] [--json-out FILE] [--instruction kvzip|none|TEXT]
                            [--variant softmax|logits] [--kvzip-plus] [--oracle] [--resume]

Each bundled context (kvzip_jax/data/quality/*.json: ~1,500 tokens of prose carrying codes, names, places and
numbers, six questions each) is prefilled once, after KVzip's task instruction ("Given the context, answer to the
following question or request without explanation.", part of the never-evicted prefix as in KVzip's own
evaluation), and scored once by KVzip. For every level and ratio, the scores give a keep mask, the masked cache
serves all questions of the context (greedy answers), and each answer is recorded: correct (the expected answer
occurs in it, case-insensitive) and equal to the full-cache answer (same text). Prints a Markdown table per ratio
(accuracy, full-cache accuracy, answers equal to the full-cache ones) and one per context. Ratio is the fraction of
context KV pairs kept.

--oracle adds two question-aware upper bounds, each evicting per question (so no cache is shared between questions):
the same max-attention score as KVzip's, with pair-level eviction, but observed while the model reads the question
("oracle-q", a SnapKV-like choice without pooling) or the question followed by the full cache's own answer,
teacher-forced ("oracle-qa": the pairs the model attends to most while it gives the full-cache answer). They
indicate how close attention-based eviction at a ratio can come to the full cache's answers on this model.

With --json-out the records are written after each context; --resume reads that file back and skips the contexts
it already holds in full (every level and ratio of this run), so a long run (a 1.5B model on CPU) continues where it
stopped. The file does not record the model or settings: resume only a run made with the same arguments.

Run it with kvzip-jax installed (`make test` does) or with PYTHONPATH set to the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import dtypes, kvzip, prompts
from kvzip_jax import generate as gen
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.kvzip.scoring import evictable_layers
from kvzip_jax.weights import registry

RATIOS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1)
FULL = "full"  # the level label of answers from the uncompressed cache
ORACLES = {"oracle-q": False, "oracle-qa": True}  # level label -> whether the full-cache answer is observed too


@dataclasses.dataclass(frozen=True)
class Record:
    """One answer. ratio None and level "full": the uncompressed cache."""

    context: str
    question: str
    expected: str
    level: str
    ratio: float | None
    answer: str
    correct: bool
    equal_to_full: bool
    tokens: int
    seconds: float


def load_contexts(names: list[str] | None = None) -> dict[str, dict]:
    """The bundled quality contexts by file stem: {"title", "context", "questions": [{"question", "answer"}]}."""
    folder = resources.files("kvzip_jax").joinpath("data", "quality")
    found = {Path(entry.name).stem: entry for entry in folder.iterdir() if entry.name.endswith(".json")}
    unknown = sorted(set(names or ()) - set(found))
    if unknown:
        raise SystemExit(f"unknown context(s) {', '.join(unknown)}; bundled: {', '.join(sorted(found))}")
    return {name: json.loads(found[name].read_text()) for name in sorted(names or found)}


def _progress(total: int):
    """A tqdm bar when tqdm is installed, else a no-op with the same update/close calls."""
    try:
        from tqdm import tqdm
    except ImportError:

        class Silent:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return Silent()
    return tqdm(total=total, unit="answer", file=sys.stderr, dynamic_ncols=True)


def observed_span_inputs(tokens, prefix_len: int, context_len: int) -> kvzip.RereadInputs:
    """Scoring inputs that observe one span of tokens [T] in place of the reread, with the whole context as one
    chunk: kvzip.score then gives every context pair the max attention it receives from that span."""
    tokens = np.asarray(tokens, np.int32)
    width = -(-len(tokens) // 64) * 64
    padded = np.zeros((1, 1, width), np.int32)
    padded[0, 0, : len(tokens)] = tokens
    one = lambda x: jnp.asarray([x], jnp.int32)
    return kvzip.RereadInputs(
        tokens=jnp.asarray(padded),
        num_valid=one([len(tokens)]),
        chunk_start=one([prefix_len]),
        chunk_len=one([context_len]),
        prefix_len=one(prefix_len),
        context_len=one(context_len),
        chunk_size=-(-context_len // 64) * 64,
    )


def run_context(
    model,
    name: str,
    item: dict,
    ratios=RATIOS,
    levels=("pair",),
    max_new_tokens: int = 32,
    progress=None,
    chunk_size: int | None = None,
    instruction: str | None = prompts.KVZIP_INSTRUCTION,
    scoring: kvzip.KVzipConfig = kvzip.KVzipConfig(),
    oracle: bool = False,
) -> tuple[list[Record], dict]:
    """Prefills one context once (after KVzip's task instruction, in the never-evicted prefix; None: none), scores
    it once (reread chunks of chunk_size tokens; None: the library's default; score variant and KVzip+ from
    `scoring`), and answers all its questions from the full cache and from the masked cache of every (level, ratio).
    oracle: also the question-aware upper bounds of ORACLES (module docstring). Returns (records, timings in s)."""
    tok, cfg, params = model.tokenizer, model.cfg, model.params
    questions = item["questions"]
    context, suffixes = prompts.split_for_reuse(
        tok, item["context"], [q["question"] for q in questions], instruction=instruction
    )
    stops = prompts.stop_token_ids(tok)
    timings = {"context_tokens": len(context) - context.context_start}

    start = time.perf_counter()
    logits, cache = gen.prefill(params, cfg, [context.ids()])
    jax.block_until_ready(logits)
    timings["prefill_s"] = time.perf_counter() - start

    start = time.perf_counter()
    chunking = {} if chunk_size is None else {"chunk_size": chunk_size}
    reread = kvzip.reread_inputs(tok, [context.context_start], [context.ids()[context.context_slice]], **chunking)
    masked, scores = jax.jit(kvzip.score_and_evict)(params, cfg, cache, reread, 1.0, scoring)
    jax.block_until_ready(scores)
    del masked
    timings["score_s"] = time.perf_counter() - start
    evictable = evictable_layers(cfg)

    def answer(work, i, level, ratio, full_answers):
        """Answers question i from `work` (donated); returns (record, answer tokens, the cache back)."""
        qa = questions[i]
        t0 = time.perf_counter()
        tokens, work = gen.ask(params, cfg, work, suffixes[i], max_new_tokens, stop_tokens=stops)
        seconds = time.perf_counter() - t0
        text = tok.decode([t for t in tokens if t not in stops]).strip()
        if progress is not None:
            progress.update(1)
        record = Record(
            name,
            qa["question"],
            qa["answer"],
            level,
            ratio,
            text,
            qa["answer"].lower() in text.lower(),
            full_answers is None or text == full_answers[i],
            len(tokens),
            seconds,
        )
        return record, tokens, work

    def answer_all(one_cache, level, ratio, full_answers):
        # gen.ask donates its cache: work on a copy so that `cache` (shared by every masked view) survives.
        work = jax.tree.map(jnp.copy, one_cache)
        out, tokens = [], []
        for i in range(len(questions)):
            record, answer_tokens, work = answer(work, i, level, ratio, full_answers)
            out.append(record)
            tokens.append(answer_tokens)
        return out, tokens

    start = time.perf_counter()
    records, full_tokens = answer_all(cache, FULL, None, None)
    full_answers = [r.answer for r in records]
    for level in levels:
        for ratio in ratios:
            if progress is not None:
                progress.set_postfix_str(f"{name} {level} {ratio}")
            keep = kvzip.keep_mask(scores, reread.context_len, ratio, level, evictable)
            view = kv.mask_context(cache, keep, reread.prefix_len, reread.context_len)
            records += answer_all(view, level, ratio, full_answers)[0]
    timings["answers_s"] = time.perf_counter() - start
    if oracle:
        start = time.perf_counter()
        observe = jax.jit(kvzip.score, static_argnums=1)
        for label, with_answer in ORACLES.items():
            if progress is not None:
                progress.set_postfix_str(f"{name} {label}")
            for i, suffix in enumerate(suffixes):
                span = np.concatenate([suffix, np.asarray(full_tokens[i], np.int32)]) if with_answer else suffix
                seen = observed_span_inputs(span, context.context_start, timings["context_tokens"])
                span_scores = observe(params, cfg, cache, seen)
                for ratio in ratios:
                    keep = kvzip.keep_mask(span_scores, seen.context_len, ratio, "pair", evictable)
                    view = kv.mask_context(cache, keep, seen.prefix_len, seen.context_len)
                    records.append(answer(jax.tree.map(jnp.copy, view), i, label, ratio, full_answers)[0])
        timings["oracle_s"] = time.perf_counter() - start
    return records, timings


def _frac(hits: int, total: int) -> str:
    return f"{hits}/{total} ({100 * hits / total:.0f}%)" if total else "-"


def tables(records: list[Record], ratios, levels) -> str:
    """Markdown: per (level, ratio) accuracy, full-cache accuracy, answers equal to full; then per context."""
    full = [r for r in records if r.level == FULL]
    full_right = sum(r.correct for r in full)
    many = len(levels) > 1
    head = ("| level " if many else "") + "| ratio | accuracy | full-cache accuracy | answers equal to full |"
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for level in levels:
        for ratio in ratios:
            rows = [r for r in records if r.level == level and r.ratio == ratio]
            right, equal = sum(r.correct for r in rows), sum(r.equal_to_full for r in rows)
            lines.append(
                (f"| {level} " if many else "") + f"| {ratio:g} | {_frac(right, len(rows))} "
                f"| {_frac(full_right, len(full))} | {_frac(equal, len(rows))} |"
            )
    names = sorted({r.context for r in records})
    lines += [
        "",
        "Per context: correct / equal to full (of " + str(len(full) // max(len(names), 1)) + " questions)",
        "",
        "| level | ratio | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    per = lambda rows, name: [r for r in rows if r.context == name]
    lines.append("| full | - | " + " | ".join(f"{sum(r.correct for r in per(full, n))}" for n in names) + " |")
    for level in levels:
        for ratio in ratios:
            rows = [r for r in records if r.level == level and r.ratio == ratio]
            cells = [
                f"{sum(r.correct for r in per(rows, n))} / {sum(r.equal_to_full for r in per(rows, n))}" for n in names
            ]
            lines.append(f"| {level} | {ratio:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _write_json_atomically(path: str, payload) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".quality-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, ensure_ascii=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resumed(path: str, names, ratios, levels) -> dict[str, list[Record]]:
    """The records of `path` (a --json-out file) per context, for the contexts among `names` whose rows cover every
    question at every (level, ratio) of this run and the full cache; nothing if the file does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [Record(**r) for r in json.load(f)]
    wanted = {(FULL, None)} | {(level, ratio) for level in levels for ratio in ratios}
    done = {}
    for name in names:
        rows = [r for r in records if r.context == name and (r.level, r.ratio) in wanted]
        cells = {(r.level, r.ratio) for r in rows}
        if cells == wanted and len(rows) % len(wanted) == 0 and len(rows) > 0:
            done[name] = rows
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=registry.QWEN, help="bundled model name or a model path")
    parser.add_argument(
        "--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="comma-separated fractions of context pairs kept"
    )
    parser.add_argument("--level", default="pair", help=f"comma-separated eviction levels of {kvzip.LEVELS}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, help="reread chunk length in tokens (default: the library's)")
    parser.add_argument("--contexts", help="comma-separated context names (default: all bundled)")
    parser.add_argument("--json-out", help="write every answer as a JSON record to this file")
    parser.add_argument(
        "--instruction",
        default="kvzip",
        help='the task instruction before each context: "kvzip" (KVzip\'s: "'
        f'{prompts.KVZIP_INSTRUCTION}"), "none", or any text',
    )
    parser.add_argument(
        "--variant",
        default="softmax",
        choices=kvzip.VARIANTS,
        help="score variant: softmax (KVzip) or logits (the paper's softmax-free variant)",
    )
    parser.add_argument("--kvzip-plus", action="store_true", help="KVzip+ normalisation of the scores")
    parser.add_argument(
        "--dtype",
        choices=dtypes.CHOICES,
        default="auto",
        help="params and cache precision (auto: bfloat16 on GPU and TPU, float32 on CPU)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="also the question-aware upper bounds oracle-q and oracle-qa (pair level, one eviction "
        "per question; see above)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip the contexts --json-out already holds in full (a run with the same arguments)",
    )
    args = parser.parse_args(argv)
    if args.resume and not args.json_out:
        parser.error("--resume needs --json-out (the file to continue)")
    if args.resume and args.oracle:
        parser.error("--resume does not cover --oracle's rows; run --oracle in one go")
    instruction = prompts.named_instruction(args.instruction)
    scoring = kvzip.KVzipConfig(variant=args.variant, kvzip_plus=args.kvzip_plus)

    ratios = tuple(float(r) for r in args.ratios.split(","))
    levels = tuple(level.strip() for level in args.level.split(","))
    for level in levels:
        if level not in kvzip.LEVELS:
            parser.error(f"--level must be among {kvzip.LEVELS}, got {level!r}")
    for ratio in ratios:
        check_ratio(ratio)
    contexts = load_contexts(args.contexts.split(",") if args.contexts else None)

    wall = time.perf_counter()
    model = registry.load(args.model, dtype=args.dtype)
    print(
        f"model {model.name} ({model.dtype}) loaded in {time.perf_counter() - wall:.1f} s (jax {jax.__version__}, "
        f"{jax.default_backend()}); {len(contexts)} contexts; levels {', '.join(levels)}; "
        f"ratios {', '.join(f'{r:g}' for r in ratios)}; max {args.max_new_tokens} new tokens; reread chunk "
        f"{args.chunk_size or 'default'}; instruction {instruction!r}; scores {args.variant}"
        f"{' with KVzip+' if args.kvzip_plus else ''}",
        flush=True,
    )
    rows_per_question = 1 + (len(levels) + (len(ORACLES) if args.oracle else 0)) * len(ratios)
    total = sum(len(item["questions"]) for item in contexts.values()) * rows_per_question
    done = resumed(args.json_out, contexts, ratios, levels) if args.resume else {}
    if done:
        print(f"resumed from {args.json_out}: {', '.join(done)} ({sum(map(len, done.values()))} answers)")
    progress = _progress(total)
    progress.update(sum(map(len, done.values())))
    records = [r for rows in done.values() for r in rows]
    for name, item in contexts.items():
        if name in done:
            continue
        rows, t = run_context(
            model,
            name,
            item,
            ratios,
            levels,
            args.max_new_tokens,
            progress,
            args.chunk_size,
            instruction,
            scoring,
            args.oracle,
        )
        records += rows
        if args.json_out:
            _write_json_atomically(args.json_out, [dataclasses.asdict(r) for r in records])
        full = [r for r in rows if r.level == FULL]
        seconds = t["answers_s"] + t.get("oracle_s", 0)
        print(
            f"\n{name}: {t['context_tokens']} context tokens; prefill {t['prefill_s']:.1f} s, KVzip scoring "
            f"{t['score_s']:.1f} s (both including any compilation), {len(rows)} answers in {seconds:.1f} s; "
            f"full cache {sum(r.correct for r in full)}/{len(full)} right",
            flush=True,
        )
    progress.close()

    print()
    print(tables(records, ratios, levels + (tuple(ORACLES) if args.oracle else ())))
    print(f"\nwall time {time.perf_counter() - wall:.0f} s")
    if args.json_out:
        _write_json_atomically(args.json_out, [dataclasses.asdict(r) for r in records])
        print(f"records written to {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
