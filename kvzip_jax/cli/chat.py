"""kvzip-jax chat: a terminal chat over a compressed document. Answers are streamed; earlier turns stay in the cache
after the compressed context (never evicted); /bytes, /reset, Ctrl-D exits."""

from __future__ import annotations

import argparse
import sys

from kvzip_jax.cli import common, options
from kvzip_jax.errors import KvzipError

CHAT_HELP = "commands: /bytes (cache bytes), /reset (forget the conversation, keep the document), /help; Ctrl-D exits"
STREAM_STEP = 4  # tokens decoded between two prints of a streamed answer


def _compressed_document(args: argparse.Namespace):
    """(model, cache, whether it is asked by completion): --cache loaded as saved, or --context prefilled and
    compressed now with room for --room tokens of conversation."""
    import jax

    from kvzip_jax import cache as kv
    from kvzip_jax import generate as gen
    from kvzip_jax import prompts

    if args.cache is not None:
        model, cache, _ = common.load_saved(args)
        print(f"loaded the cache of {args.cache}: no prefill, no scoring")
        return model, common.quantized(args, cache), common.asks_by_completion(model)
    if args.ratio is None:
        args.subparser.error("--context needs --ratio")
    document = common.read_context(args.context)
    args.dtype = args.dtype or "auto"
    model = common.load_model(args)
    completion = common.asks_by_completion(model)
    context, _ = prompts.split_for_reuse(model.tokenizer, document, [], completion=completion)
    on_chunk, done = common.progress(args, "prefill")
    _, full = gen.prefill(model.params, model.cfg, [context.ids()], on_chunk=on_chunk)
    done()
    args.level, args.chunk_size, args.self_study = None, 512, False
    masked, how, _ = common.evict(args, model, full, context, None)
    cache = common.quantized(args, kv.pack(masked, args.room))
    jax.block_until_ready(cache)
    print(f"{len(context)} tokens prefilled; {args.method} at ratio {args.ratio}: {how}")
    return model, cache, completion


def run(args: argparse.Namespace) -> int:
    from kvzip_jax import cache as kv
    from kvzip_jax import prompts

    if (args.context is None) == (args.cache is None):
        args.subparser.error("give --context FILE (compressed now) or --cache DIR (saved by compress --save)")
    if args.max_new_tokens < 1 or args.room < 1:
        args.subparser.error("--max-new-tokens and --room must be >= 1")
    model, cache, completion = _compressed_document(args)
    print(f"KV cache bytes: {common.cache_bytes(cache)}\n{CHAT_HELP}", flush=True)
    stops = prompts.stop_token_ids(model.tokenizer, completion)
    start, turns = kv.mark(cache), 0
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print("\nbye")
            return 0
        if not line:
            continue
        if line in ("/bye", "/exit", "/quit"):
            print("bye")
            return 0
        if line == "/bytes":
            print(
                f"KV cache bytes: {common.cache_bytes(cache)}; "
                f"{int(cache.next_position[0]) - int(start.next_position[0])} tokens of conversation after the "
                "document",
                flush=True,
            )
            continue
        if line == "/reset":
            cache, turns = kv.rewind(cache, start), 0
            print("conversation reset; the compressed document stays", flush=True)
            continue
        if line.startswith("/"):
            print(CHAT_HELP, flush=True)
            continue
        turn = prompts.question_suffix if turns == 0 else prompts.follow_up
        before = kv.mark(cache)
        try:
            ids = turn(model.tokenizer, line, completion=completion)
            cache = _stream_answer(model, cache, ids, args.max_new_tokens, stops)
            turns += 1
        except KvzipError as e:  # the turn does not fit the room left
            cache = kv.rewind(cache, before)
            print(f"kvzip-jax chat: error: {e}; /reset to start the conversation again", file=sys.stderr, flush=True)


def _stream_answer(model, cache, ids, max_new_tokens: int, stops):
    """Appends a turn's ids, decodes the answer STREAM_STEP tokens at a time, printing the text as it grows; the
    turn and the answer stay in the cache (multi-turn). Returns the cache."""
    from kvzip_jax import generate as gen

    logits, cache = gen.prefill(model.params, model.cfg, [ids], cache)
    answer, printed = [], ""
    while len(answer) < max_new_tokens:
        new, cache, logits = gen.decode(
            model.params,
            model.cfg,
            logits,
            cache,
            min(STREAM_STEP, max_new_tokens - len(answer)),
            stop_tokens=stops,
            return_logits=True,
        )
        answer += new[0]
        text = model.tokenizer.decode([t for t in answer if t not in stops])
        print(text[len(printed) :], end="", flush=True)
        printed = text
        if not new[0] or new[0][-1] in stops or int(cache.room()[0]) <= 0:
            break
    print(flush=True)
    return cache


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="talk to a compressed document in the terminal (multi-turn, streamed)")
    options.add_model(parser, required=False, note="with --cache: default the one that made it")
    parser.add_argument("--context", metavar="FILE", help="the document, compressed once at start")
    parser.add_argument("--cache", metavar="DIR", help="a cache saved by compress --save (no prefill, no scoring)")
    parser.add_argument("--ratio", type=float, help="with --context: fraction of context KV pairs kept")
    options.add_method(parser)
    parser.add_argument(
        "--room",
        type=int,
        default=1024,
        help="with --context: tokens of conversation the compressed cache has room for",
    )
    options.add_max_new_tokens(parser, 256)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    options.add_kv_bits(parser, saved=True)
    options.add_runtime(parser, saved_dtype_help="default: auto, or the dtype of a saved cache")
    parser.set_defaults(handler=run, subparser=parser)
