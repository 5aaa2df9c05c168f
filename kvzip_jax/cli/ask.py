"""kvzip-jax ask: answer questions from a cache saved by `compress --save`, in a new process (no prefill, no
scoring; the model is the one that made the cache, checked)."""

from __future__ import annotations

import argparse
import sys
import time

from kvzip_jax import kv_bits
from kvzip_jax.cli import common, options
from kvzip_jax.errors import KvzipError


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        args.subparser.error("--max-new-tokens must be >= 1")
    questions = common.questions(args)
    start = time.perf_counter()
    model, cache, meta = common.load_saved(args)
    cache = common.quantized(args, cache)
    what = f"{meta.get('method', '?')} at ratio {meta.get('ratio', '?')}" if meta else "a saved cache"
    bits = common.kv_bits(cache)  # as saved, or quantized on load (--kv-bits)
    what += f", {kv_bits.label(bits)}" if bits is not None else ""
    context = meta.get("context", {}).get("tokens", "?")
    print(
        f"model {model.name} and the cache of {args.cache} ({what}, {context} context tokens) loaded in "
        f"{time.perf_counter() - start:.1f} s, no prefill or scoring; KV cache bytes: {common.cache_bytes(cache)}"
    )
    completion = common.asks_by_completion(model)
    for question in questions if questions is not None else list(common.stdin_questions()):
        try:
            cache = common.answer(model, cache, question, None, args.max_new_tokens, completion)
        except KvzipError as e:  # a question too long for the room the cache was saved with
            print(f"kvzip-jax ask: error: {e}", file=sys.stderr)
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ask", help="answer questions from a cache saved by `compress --save` (no prefill, no scoring)"
    )
    parser.add_argument("--cache", required=True, metavar="DIR", help="a folder written by compress --save")
    options.add_model(parser, required=False, note="default: the one that made the cache")
    options.add_questions(parser)
    options.add_kv_bits(parser, saved=True)
    options.add_runtime(parser, saved_dtype_help="default: the dtype the cache was saved in")
    parser.set_defaults(handler=run, subparser=parser)
