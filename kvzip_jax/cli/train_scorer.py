"""kvzip-jax train-scorer: a trained scorer (Fast KVzip's gate, KVzap's linear regressor) for a model, from texts the
model writes itself; every stage resumable in the data folder; the weights and a manifest saved with orbax."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvzip_jax.cli import common, options


def default_dirs(model: str, kind: str, prompt_set: str = "prose") -> tuple[Path, Path]:
    """(data folder, output folder) under <checkpoints>/<model>/scorers/: data/ (shared by both kinds) and <kind>/,
    where eval and compress look first (scorers.scorer.scorer_dirs); under scorers/mixed/ for the mixed prompts
    (`eval --scorers` and `compress --scorer` read them there)."""
    from kvzip_jax.weights.registry import default_checkpoints_dir

    root = default_checkpoints_dir() / Path(model).name / "scorers"
    root = root / "mixed" if prompt_set == "mixed" else root
    return root / "data", root / kind


def run(args: argparse.Namespace) -> int:
    from kvzip_jax.scorers import data, pipeline, store
    from kvzip_jax.weights.identity import model_identity

    if min(args.texts, args.tokens_per_text, args.max_new_tokens, args.batch, args.steps, args.train_batch) < 1:
        args.subparser.error("--texts, --tokens-per-text, --max-new-tokens, --batch, --steps, --train-batch: >= 1")
    if not 1 <= args.held_out < args.texts:
        args.subparser.error(f"--held-out must be in [1, --texts), got {args.held_out}")
    prompt_set = args.prompts or "prose"
    if args.texts_from:
        if not Path(args.texts_from).exists():
            args.subparser.error(f"--texts-from: no such folder or file: {args.texts_from}")
        prompt_set = data.prompt_set_of(data.folder_of(args.texts_from))
        if args.prompts not in (None, prompt_set):
            args.subparser.error(
                f"--prompts {args.prompts}: the texts of {args.texts_from} answer the {prompt_set} prompts"
            )
    data_dir, out = default_dirs(args.model, args.kind, prompt_set)
    data_dir, out = Path(args.data or data_dir), Path(args.out or out)
    if out.exists() and not args.overwrite:
        raise store.ScorerFileError(f"{out} already exists; pass --overwrite to replace it")
    model = common.load_model(args)
    seconds = {}
    if args.texts_from:
        pipeline.adopt_texts(data_dir, args.texts_from, args.texts)
    for stage, work in (
        (
            "texts",
            lambda bar: pipeline.ensure_texts(
                model, data_dir, args.texts, args.batch, args.max_new_tokens, args.seed, bar, prompt_set
            ),
        ),
        (
            "features",
            lambda bar: pipeline.ensure_features(model, data_dir, args.texts, args.tokens_per_text, args.seed, bar),
        ),
    ):
        start = time.perf_counter()
        bar, done = common.progress(args, f"{stage} ({data_dir})", unit="text", log_seconds=60)
        work(bar)
        done()
        seconds[stage] = time.perf_counter() - start
        print(f"{stage}: {args.texts} in {data_dir} ({seconds[stage]:.0f} s this run)", flush=True)
    train_indices, held = range(args.texts - args.held_out), range(args.texts - args.held_out, args.texts)
    bar, done = common.progress(args, f"fitting the {args.kind} scorer", unit="step", log_seconds=60)
    scorer, report = pipeline.fit(
        model, data_dir, args.kind, train_indices, args.steps, args.train_batch, args.seed, bar
    )
    done()
    start = time.perf_counter()
    report |= pipeline.held_out(model, data_dir, scorer, held)
    seconds["held_out"] = time.perf_counter() - start
    identity = model_identity(model.cfg, model.params)
    manifest = {
        "model": model.name,
        "model_config": identity["config"],
        "model_params": identity["params"],
        "data": str(data_dir),
        "texts": args.texts,
        "prompts": prompt_set,
        **({"texts_from": str(args.texts_from)} if args.texts_from else {}),
        "tokens_per_text": args.tokens_per_text,
        "seconds_this_run": seconds,
        **report,
    }
    store.save_scorer(out, args.kind, scorer.params, manifest, overwrite=args.overwrite, config=scorer.config)
    print(
        f"{args.kind} scorer of {model.name}: {report['train_tokens']} training tokens from {len(train_indices)} "
        f"texts, fitted in {report['fit_seconds']:.0f} s; held out ({len(held)} texts, "
        f"{report['held_out_tokens']} tokens): loss {report['held_out_loss']:.4f}, top-30% overlap with KVzip "
        f"{report['top30_overlap']:.3f}"
    )
    print(f"wrote {out}")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train-scorer",
        help="train a scorer that needs no reread (Fast KVzip's gate, KVzap's linear) on texts the model writes",
    )
    options.add_model(parser)
    parser.add_argument("--kind", required=True, choices=("gate", "linear"), help="gate: fast-kvzip; linear: kvzap")
    parser.add_argument("--out", metavar="DIR", help="where the scorer goes (default <checkpoints>/MODEL/scorers/KIND)")
    parser.add_argument("--data", metavar="DIR", help="texts and features (default <checkpoints>/MODEL/scorers/data)")
    parser.add_argument(
        "--texts-from",
        metavar="DIR",
        help="read the texts of another data folder (another model's) instead of writing new ones",
    )
    parser.add_argument(
        "--prompts",
        choices=("prose", "mixed"),
        help="what the model writes: prose (the default), or prose and records dense in identifiers and numbers "
        "taking turns (into <checkpoints>/MODEL/scorers/mixed/)",
    )
    parser.add_argument("--texts", type=int, default=64, help="texts the model writes (the last --held-out held out)")
    parser.add_argument("--held-out", type=int, default=8, help="texts kept out of the fit and measured on")
    parser.add_argument("--tokens-per-text", type=int, default=256, help="sampled training tokens per text")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="most tokens of a written text")
    parser.add_argument("--batch", type=int, default=4, help="texts written at once")
    parser.add_argument("--steps", type=int, default=5000, help="gate: SGD steps")
    parser.add_argument("--train-batch", type=int, default=1000, help="gate: tokens per step")
    parser.add_argument("--seed", type=int, default=0, help="sampling the texts, the tokens and the gate's start")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing scorer at --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    options.add_runtime(parser)
    parser.set_defaults(handler=run, subparser=parser)
