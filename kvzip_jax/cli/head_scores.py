"""kvzip-jax head-scores: a model's per-(layer, KV head) scores for --level head, computed once and saved beside its
checkpoint."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvzip_jax.cli import common, options


def head_scores_path(model: str) -> Path:
    """Where a model's head scores live: <checkpoints>/<name>/head_scores.json for a bundled model, inside a
    checkpoint or HF folder, and <stem>.head_scores.json beside a GGUF file."""
    from kvzip_jax.kvzip.head_level import FILENAME
    from kvzip_jax.weights.registry import BUNDLED, default_checkpoints_dir

    if model in BUNDLED:
        return default_checkpoints_dir() / model / FILENAME
    path = Path(model)
    return path / FILENAME if path.is_dir() else path.with_name(f"{path.stem}.{FILENAME}")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kvzip_jax.kvzip import head_level

    if args.tokens < 1 or args.chunk_size < 1:
        args.subparser.error("--tokens and --chunk-size must be >= 1")
    target = head_scores_path(args.model)
    if target.exists() and not args.overwrite:
        raise common.InputFileError(f"{target} already exists; pass --overwrite to recompute it")
    text = common.read_text(args.text, "sample text") if args.text else head_level.sample_text()
    model = common.load_model(args)
    tokens, prefix_len = head_level.sample_tokens(model.tokenizer, text, args.tokens)
    start = time.perf_counter()
    scores = head_level.head_scores(model.params, model.cfg, model.tokenizer, text, args.tokens, args.chunk_size)
    seconds = time.perf_counter() - start
    used = len(tokens) - prefix_len
    meta = {
        "model": model.name,
        "sample": args.text or head_level.SAMPLE_DESCRIPTION,
        "tokens": used,
        "chunk_size": args.chunk_size,
    }
    path = head_level.save_head_scores(target, scores, meta)
    finite = scores[np.isfinite(scores)]
    fixed = int(np.isinf(scores).any(axis=1).sum())
    print(
        f"head scores {list(scores.shape)} (layers x KV heads) of {model.name} from {used} sample tokens in "
        f"{seconds:.1f} s (including compilation): min {finite.min():.3f}, median {np.median(finite):.3f}, "
        f"max {finite.max():.3f}" + (f"; {fixed} non-evicted layers stored as null" if fixed else "")
    )
    print(f"wrote {path}")
    return 0


def add_parser(subparsers) -> None:
    from kvzip_jax.kvzip.head_level import DEFAULT_TOKENS

    parser = subparsers.add_parser(
        "head-scores",
        help="compute a model's per-(layer, KV head) scores once, for --level head (saved beside the checkpoint)",
    )
    options.add_model(parser)
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="sample tokens to score")
    parser.add_argument("--text", metavar="FILE", help="sample text (default: standard-library module docstrings)")
    options.add_chunk_size(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace existing head scores")
    options.add_runtime(parser)
    parser.set_defaults(handler=run, subparser=parser)
