"""kvzip-jax eval: a sweep of methods x ratios x tasks, resumable, summarised as a table and a plot; shared out over
processes, merged, or run as one replica over every process's devices (--distributed)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from pathlib import Path

from kvzip_jax.cli import common, eval_options, options


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def task_names(text: str | None, given_files: bool) -> list[str]:
    """--tasks as task names, "ruler" standing for RULER's 11 offline tasks; default (None or ""): the package's own
    tasks, or none when --jsonl or --dataset gives examples. Unknown names are left for the caller to refuse."""
    from kvzip_jax.eval import tasks

    if not text:
        return [] if given_files else list(tasks.TASKS)
    return [name for item in _csv(text) for name in (tasks.ruler.OFFLINE if item == eval_options.RULER else [item])]


def run(args: argparse.Namespace) -> int:
    from kvzip_jax.eval import report, results, tasks
    from kvzip_jax.eval.shares import ProcessShareError, process_share
    from kvzip_jax.eval.sweep import SweepConfig, run_sweep
    from kvzip_jax.eval.tasks import dataset

    if args.merge:
        return _merge(args)
    if args.model is None and not args.write_dataset:
        args.subparser.error("--model is required (unless --merge or --write-dataset)")
    if args.write_dataset and args.distributed:
        args.subparser.error("--write-dataset runs no sweep: no --distributed")
    coordinates = (args.coordinator, args.num_processes, args.process_id)
    if any(c is not None for c in coordinates) and (not args.distributed or None in coordinates):
        args.subparser.error("--coordinator, --num-processes and --process-id go together, with --distributed")
    if args.distributed and (args.process_index is not None or args.process_count is not None):
        args.subparser.error(
            "--distributed runs one replica over every process's devices: no --process-index or --process-count"
        )
    try:
        ratios = tuple(float(r) for r in _csv(args.ratios))
    except ValueError:
        args.subparser.error(f"--ratios must be comma-separated numbers, got {args.ratios!r}")
    try:
        kv_bits = tuple(options.kv_bits(b) for b in _csv(args.kv_bits))
    except argparse.ArgumentTypeError:
        args.subparser.error(f"--kv-bits must be comma-separated among 16, 8, 4, 8/4; got {args.kv_bits!r}")
    if args.contexts < 1 or args.context_tokens < 1:
        args.subparser.error("--contexts and --context-tokens must be >= 1")
    instruction = options.instruction(args)
    try:
        config = SweepConfig(
            methods=tuple(_csv(args.methods)),
            ratios=ratios,
            modes=tuple(_csv(args.modes)),
            batch_size=args.batch_size,
            chunk_size=args.chunk_size,
            seed=eval_options.OWN_SEED if args.seed is None else args.seed,
            instruction=instruction,
            self_study=args.self_study,
            self_study_samples=args.self_study_samples,
            self_study_tokens=args.self_study_tokens,
            kv_bits=kv_bits,
            kv_group=args.kv_group,
            kv_window=args.kv_window,
            kv_center=args.kv_center,
            scorers=args.scorers,
            **({} if args.query_cap is None else {"query_cap": args.query_cap}),
        )
    except ValueError as e:
        args.subparser.error(str(e))
    names = task_names(args.tasks, bool(args.jsonl or args.dataset))
    unknown = sorted(set(names) - set(tasks.TASKS) - set(tasks.ruler.TASKS))
    if unknown:
        args.subparser.error(
            f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(tasks.TASKS)}, "
            f"{eval_options.RULER} (all of {', '.join(tasks.ruler.OFFLINE)}), {', '.join(tasks.ruler.QA_TASKS)}"
        )
    tasks.ruler.check_data(names)  # the QA tasks' data sets, before the model loads (RulerDataMissingError)
    if args.seed is not None and args.seed < 0:
        args.subparser.error("--seed must be >= 0")
    if args.questions_per_context is not None and args.questions_per_context < 1:
        args.subparser.error("--questions-per-context must be >= 1")
    mesh, writes, share = None, True, ""
    if args.distributed:
        mesh, writes = _start_distributed(args)
        index, count = 0, 1
        share = f" (one replica over {mesh.size} devices of every process{'' if writes else '; process 0 writes'})"
    else:
        try:
            index, count = process_share(args.process_index, args.process_count)
        except ProcessShareError as e:
            args.subparser.error(str(e))
        if count > 1:
            share = f" (process {index} of {count}: batches {index}, {index + count}, ... of them)"

    datasets = [dataset.read(source) for source in args.dataset or []]  # files refused before the model loads
    examples = [ex for path in args.jsonl or [] for ex in tasks.load_jsonl(path)]
    examples += [ex for data in datasets for ex in data.examples]
    own_seed = eval_options.OWN_SEED if args.seed is None else args.seed
    examples += [
        ex
        for name in names
        if name not in tasks.ruler.TASKS
        for ex in tasks.generate(name, args.contexts, own_seed, args.context_tokens)
    ]
    twice = sorted(key for key, n in collections.Counter((ex.task, ex.id) for ex in examples).items() if n > 1)
    if twice:
        args.subparser.error(f"two examples share a task and id, e.g. {twice[0]}: give each file its own task names")
    ruler_names = [name for name in names if name in tasks.ruler.TASKS]
    if args.write_dataset:
        return _write_dataset(args, examples, ruler_names)

    model = common.load_model(args)
    for data in datasets:
        dataset.check_fits(data, model.tokenizer, model.cfg.max_position, instruction)
    examples = _first_questions(args, examples + _ruler_examples(args, ruler_names, model))
    out = Path(args.out or Path("runs") / model.name)
    path = out / results.results_name(index, count)
    print(
        f"sweep: {len(examples)} contexts{share}, {sum(len(ex.questions) for ex in examples)} questions, methods "
        f"{','.join(config.methods)}, modes {','.join(config.modes)}, ratios {','.join(map(str, ratios))} "
        f"-> {path}",
        flush=True,
    )
    start = time.perf_counter()
    run_sweep(
        model,
        examples,
        config,
        path,
        progress=writes and not args.no_progress,
        mesh=mesh,
        share=(index, count),
        write=writes,
    )
    if not writes:
        print(f"done in {time.perf_counter() - start:.0f} s; process 0 wrote the results and the summary")
        return 0
    if count > 1:
        print(
            f"done in {time.perf_counter() - start:.0f} s; once every process has finished: kvzip-jax eval "
            f"--merge --out {out}"
        )
        return 0
    written = report.write_report(path, out)
    print(f"done in {time.perf_counter() - start:.0f} s; " + ", ".join(str(p) for p in written.values()))
    print((out / "summary.md").read_text())
    return 0


def _first_questions(args: argparse.Namespace, examples: list) -> list:
    """The examples asking only their first --questions-per-context questions (all without it)."""
    if (keep := args.questions_per_context) is None:
        return examples
    return [dataclasses.replace(ex, questions=ex.questions[:keep], answers=ex.answers[:keep]) for ex in examples]


def _write_dataset(args: argparse.Namespace, examples: list, ruler_names: list[str]) -> int:
    """--write-dataset PATH: the examples, RULER's generated in --model's tokens (the model is loaded only for
    them), written in kvpress's format (dataset.write); no sweep."""
    from kvzip_jax.eval.tasks import dataset

    if ruler_names:
        if args.model is None:
            args.subparser.error("--write-dataset with RULER's tasks needs --model: their lengths are in its tokens")
        examples = examples + _ruler_examples(args, ruler_names, common.load_model(args))
    examples = _first_questions(args, examples)
    path = dataset.write(examples, args.write_dataset)
    rows, names = sum(len(ex.questions) for ex in examples), sorted({ex.task for ex in examples})
    print(f"wrote {path}: {rows} rows, {len(examples)} contexts, {len(names)} tasks ({', '.join(names)}); no sweep")
    return 0


def _ruler_examples(args: argparse.Namespace, names: list[str], model) -> list:
    """--contexts samples of each RULER task, seeded with --seed (default RULER's), each prompt plus its max new
    tokens within --context-tokens as the model's tokenizer counts them (RULER's max_seq_length)."""
    from kvzip_jax.eval import tasks

    if names and args.context_tokens > model.cfg.max_position:
        args.subparser.error(
            f"--context-tokens {args.context_tokens} passes {model.name}'s maximum position {model.cfg.max_position}"
        )
    seed = tasks.ruler.SEED if args.seed is None else args.seed
    examples = []
    for name in names:
        try:
            examples += tasks.generate(name, args.contexts, seed, args.context_tokens, model.tokenizer)
        except ValueError as e:  # a length below the task's smallest haystack
            args.subparser.error(f"--tasks {name} at --context-tokens {args.context_tokens}: {e}")
    return examples


def _start_distributed(args: argparse.Namespace):
    """--distributed, before any computation: jax.distributed.initialize (auto-detected on TPU pods, Slurm and
    Open MPI, else from --coordinator, --num-processes, --process-id; skipped when already initialised). -> (the
    sweep's mesh, (n, 1, 1) over every process's devices; whether this process writes: process 0)."""
    import jax

    from kvzip_jax import sharding

    explicit = () if args.coordinator is None else (args.coordinator, args.num_processes, args.process_id)
    try:
        if not jax.distributed.is_initialized():
            jax.distributed.initialize(*explicit)
    except (ValueError, RuntimeError) as e:
        args.subparser.error(
            f"--distributed: jax.distributed.initialize failed ({e}); outside a TPU pod, Slurm or "
            f"Open MPI job give --coordinator HOST:PORT --num-processes N --process-id I"
        )
    return sharding.make_mesh(data=jax.device_count()), jax.process_index() == 0


def _merge(args: argparse.Namespace) -> int:
    """--merge: the results files of a sweep's processes joined, and the one summary written."""
    from kvzip_jax.eval import report

    if not args.out:
        args.subparser.error("--merge needs --out DIR, the sweep's folder")
    written = report.merge_report(args.out)
    print("merged: " + ", ".join(str(p) for p in written.values()))
    print(written["markdown"].read_text())
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="sweep methods x ratios x tasks; resumable; table and plot")
    eval_options.add_arguments(parser)
    parser.set_defaults(handler=run, subparser=parser)
