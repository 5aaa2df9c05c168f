"""kvzip-jax compress: prefill a context once, compress its cache (any method of the registry: KVzip by default),
then answer questions from the compressed cache, or save it for `ask` and `chat`, or in a serving engine's pages."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvzip_jax import dtypes
from kvzip_jax.cli import common, options
from kvzip_jax.cli.head_scores import head_scores_path
from kvzip_jax.errors import KvzipError

INTERACTIVE_QUESTION_ROOM = 256  # tokens reserved for a question read from stdin


def _check_choices(args: argparse.Namespace) -> None:
    """Usage errors for flags that do not go together, before anything is loaded."""
    from kvzip_jax import methods

    if args.max_new_tokens < 1 or args.chunk_size < 1 or (args.room is not None and args.room < 1):
        args.subparser.error("--max-new-tokens, --chunk-size and --room must be >= 1")
    method = methods.get(args.method)
    defaults = method.option_defaults()
    if args.level is not None and "level" not in defaults:
        args.subparser.error(f"--level is an option of kvzip; --method {args.method} has none")
    args.level = args.level or defaults.get("level")
    if args.self_study and "probes" not in method.reads:
        args.subparser.error(
            f"--self-study adds reference queries; --method {args.method} reads none (an am-* or kvzip-am method does)"
        )
    if (args.sink or args.recent) and args.level != "head":
        args.subparser.error("--sink and --recent apply to --level head only")
    if (args.ratio is None) == (args.threshold is None):
        args.subparser.error("give --ratio, or --threshold for a method with one (fast-kvzip, kvzap)")
    if args.threshold is not None and "threshold" not in defaults:
        args.subparser.error(f"--threshold is an option of fast-kvzip and kvzap; --method {args.method} has none")
    _check_decode_budget(args, method)
    options.check_export_paged(args)


def _check_decode_budget(args, method) -> None:
    """Usage errors of --decode-budget."""
    if args.decode_budget is None:
        return
    if "scorer" not in method.reads:
        args.subparser.error(f"--decode-budget scores with a trained scorer (fast-kvzip, kvzap), not {args.method}")
    if args.save or args.kv_bits not in (None, 16):
        args.subparser.error("--decode-budget answers now from a dense cache: no --save, no --kv-bits")
    if args.decode_budget < 1:
        args.subparser.error(f"--decode-budget must be >= 1, got {args.decode_budget}")


def run(args: argparse.Namespace) -> int:
    import jax

    from kvzip_jax import cache as kv
    from kvzip_jax import generate as gen
    from kvzip_jax import memory_plan, methods, prompts
    from kvzip_jax.kvzip.budget import check_ratio
    from kvzip_jax.kvzip.head_level import HeadScoresError, load_head_scores
    from kvzip_jax.sharding import memory

    _check_choices(args)
    options.kv_formats(args)  # a bad --kv-group, before the model loads
    instruction = options.instruction(args)
    if args.ratio is not None:
        check_ratio(args.ratio)
    document = common.read_context(args.context)
    questions = common.questions(args)
    if args.level == "head" and not head_scores_path(args.model).is_file():
        raise HeadScoresError(
            f"--level head needs the model's head scores, none at {head_scores_path(args.model)}; "
            f"compute them once with: kvzip-jax head-scores --model {args.model}"
        )

    start = time.perf_counter()
    model = common.load_model(args)
    print(f"model {model.name}: {model.cfg.num_layers} layers, loaded in {time.perf_counter() - start:.1f} s")
    completion = common.asks_by_completion(model)
    head_scores = load_head_scores(head_scores_path(args.model), model.cfg) if args.level == "head" else None
    method = methods.get(args.method)
    method.options_for(model.name, model.cfg)  # a missing budget profile or a misfit named before the prefill
    context, suffixes = prompts.split_for_reuse(
        model.tokenizer, document, questions or [], instruction=instruction, completion=completion
    )
    # What the cache, the scores and a chunk's work need beside the loaded params: MemoryPlanError before allocating.
    memory.check(memory_plan.plan(model.cfg, dtypes.of_params(model.params), len(context), with_params=False))

    start = time.perf_counter()
    on_chunk, done = common.progress(args, "prefill")
    logits, cache = gen.prefill(model.params, model.cfg, [context.ids()], on_chunk=on_chunk)
    jax.block_until_ready(logits)
    done()
    print(
        f"prefill: {len(context)} tokens ({context.context_start} prefix + {len(context) - context.context_start} "
        f"context) in {time.perf_counter() - start:.1f} s (including compilation)"
    )

    start = time.perf_counter()
    masked, how, prepared = common.evict(args, model, cache, context, head_scores)
    budgeted = None if args.decode_budget is None else _decoding_start(args, model, masked, prepared, context)
    room = (max(map(len, suffixes)) if suffixes else INTERACTIVE_QUESTION_ROOM) + args.max_new_tokens
    if args.save or args.export_paged:  # questions asked later: room for any question of the interactive size
        room = max(room, INTERACTIVE_QUESTION_ROOM + args.max_new_tokens)
    room = args.room or room
    paged = _paged(args, masked, room) if args.export_paged else None  # NonUniformCacheError before any write
    compressed = common.quantized(args, kv.pack(masked, room))
    jax.block_until_ready(compressed)
    level = f", {args.level} level" if args.level else ""
    print(
        f"{args.method} ({method.paper}{level}) at {options.budget(args)}: {how} in "
        f"{time.perf_counter() - start:.1f} s (including compilation)"
    )
    _report_kept(model.cfg, masked, context)
    if args.plot or args.html:
        _pictures(args, model, masked, context)
    print(f"KV cache bytes: full {common.cache_bytes(cache)}")
    formats = options.kv_formats(args)
    bits = "" if formats is None else ", " + _kv_layout(*formats, model.cfg.head_dim)
    print(
        f"KV cache bytes: compressed {common.cache_bytes(compressed)} (ragged{bits}, room for "
        f"{int(compressed.room().min())} more tokens)"
    )
    del cache, masked
    if paged is not None:
        _write_paged(args, model, paged, context)
    if args.save:
        _save(args, model, compressed, context)
    if (args.save or paged is not None) and questions is None:  # saved for later: no questions read now
        return 0

    pending = zip(questions, suffixes) if questions is not None else ((q, None) for q in common.stdin_questions())
    for question, suffix in pending:
        try:
            if budgeted is not None:
                _answer_within_budget(args, model, budgeted, question, suffix, completion)
                continue
            compressed = common.answer(model, compressed, question, suffix, args.max_new_tokens, completion)
        except KvzipError as e:  # a question too long for the room left: report it, take the next one
            if questions is not None:
                raise
            print(f"kvzip-jax compress: error: {e}", file=sys.stderr)
    return 0


def _decoding_start(args: argparse.Namespace, model, masked, prepared, context):
    """(dense cache, its slots' scores, the scorer) to answer from with --decode-budget: the masked cache
    defragmented with room for a block and a question, the context's pairs scored as the method scored them, the
    prefix kept."""
    import jax.numpy as jnp

    from kvzip_jax import cache as kv
    from kvzip_jax.scorers import decoding

    state, inputs = prepared  # state: the method's [L, 1, K, n] context scores
    L, _, K, n = state.shape
    C = masked.layers[0].capacity
    prefix, tail = jnp.full((L, 1, K, context.context_start), jnp.inf), jnp.full((L, 1, K, C), -jnp.inf)
    scores = jnp.concatenate([prefix, state, tail], axis=-1)[..., :C]
    dense, scores = decoding.start_from(masked, scores)
    extra = decoding.INTERVAL + INTERACTIVE_QUESTION_ROOM
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, extra)), constant_values=-jnp.inf)
    return kv.grown(dense, extra), scores, inputs.scorer


def _answer_within_budget(args: argparse.Namespace, model, budgeted, question: str, suffix, completion: bool) -> None:
    """One answer generated with the cache cut back to --decode-budget every 128 tokens (scorers.decoding), from a
    copy of the compressed context's cache; prints it with its cuts."""
    import jax
    import jax.numpy as jnp

    from kvzip_jax import prompts
    from kvzip_jax.scorers import decoding

    cache, scores, scorer = budgeted
    tok = model.tokenizer
    stops = prompts.stop_token_ids(tok, completion)
    suffix = prompts.question_suffix(tok, question, completion=completion) if suffix is None else suffix
    start = time.perf_counter()
    tokens, _, cuts = decoding.generate(
        model.params,
        model.cfg,
        suffix,
        args.max_new_tokens,
        scorer=scorer,
        budget=args.decode_budget,
        stop_tokens=stops,
        cache=jax.tree.map(jnp.copy, cache),
        scores=scores,
    )
    text = tok.decode([t for t in tokens if t not in stops]).strip()
    cut_text = ", ".join(f"{c.held} -> {c.kept} pairs after {c.generated} tokens" for c in cuts) or "no cut"
    print(
        f"Q: {question}\nA: {text}\n   [{len(tokens)} tokens in {time.perf_counter() - start:.1f} s; {cut_text}]",
        flush=True,
    )


def _report_kept(cfg, masked, context) -> None:
    from kvzip_jax import cache as kv

    prefix_len, context_len = context.context_start, len(context) - context.context_start
    units = cfg.num_layers * cfg.num_kv_heads
    kept = int(kv.kept_per_head(masked).sum()) - units * prefix_len
    print(
        f"tokens kept: {kept} of {units * context_len} context pairs ({kept / (units * context_len):.3f}; "
        f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {context_len} tokens); the {prefix_len} prefix "
        "tokens and everything after the context are always kept"
    )


def _pictures(args: argparse.Namespace, model, masked, context) -> None:
    """--plot and --html: what was kept (eval.kept), each file written whole or not at all."""
    from kvzip_jax.eval import kept, report

    share = kept.fractions(masked, context.context_start, len(context) - context.context_start)
    title = f"{model.name}: {args.method} at {options.budget(args)}"
    if args.plot:
        print(f"wrote {kept.plot(share, Path(args.plot).absolute(), title)}")
    if args.html:
        page = kept.html(model.tokenizer, context.ids()[context.context_slice], share.per_token, title)
        target = Path(args.html).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"wrote {report.write_atomic(target, lambda tmp: tmp.write_text(page, encoding='utf-8'))}")


def _kv_layout(keys, values, head_dim: int) -> str:
    """ "int4 in groups of 16", or "int8 keys in groups of 64, int4 values in groups of 16"."""

    def described(fmt, what: str = "") -> str:
        return f"int{fmt.bits} {what}in groups of {min(fmt.group, head_dim)}"

    if keys == values:
        return described(keys)
    return f"{described(keys, 'keys ')}, {described(values, 'values ')}"


def _meta(args: argparse.Namespace, context) -> dict:
    """What a saved cache or export records of how it was made (the model, the method, the context)."""
    from kvzip_jax import cache_io

    ids = context.ids()
    return {
        "model_source": str(args.model),
        "method": args.method,
        "level": args.level,
        "ratio": args.ratio,
        "threshold": args.threshold,
        "instruction": args.instruction,
        "max_new_tokens": args.max_new_tokens,
        "kv_bits": args.kv_bits,
        "prefix": {"tokens": context.context_start, "sha256": cache_io.token_hash(ids[: context.context_start])},
        "context": {
            "tokens": len(ids) - context.context_start,
            "sha256": cache_io.token_hash(ids[context.context_start :]),
            "file": str(Path(args.context).absolute()),
        },
    }


def _save(args: argparse.Namespace, model, compressed, context) -> None:
    """Writes the compressed cache to --save with what `ask --cache` needs (model, how it was made, the context)."""
    from kvzip_jax import cache as kv
    from kvzip_jax import cache_io

    start = time.perf_counter()
    path = cache_io.save(args.save, compressed, model, _meta(args, context), overwrite=args.overwrite)
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(
        f"saved to {path}/ in {time.perf_counter() - start:.1f} s: {on_disk:,} bytes on disk, "
        f"{kv.nbytes(compressed):,} bytes in memory ({kv.used_bytes(compressed):,} filled)"
    )


def _paged(args: argparse.Namespace, masked, room: int):
    """--export-paged: the compressed cache in the engine's pages (kvzip_jax.serving) with `room` free slots per
    sequence; a cache whose (layer, KV head)s keep unequal counts is a NonUniformCacheError here."""
    from kvzip_jax import serving

    packing = serving.dtype_packing(masked.layers[0].k.dtype)
    if args.paged_layout == "tpu" and args.page_size % packing:
        args.subparser.error(f"--page-size must be a multiple of {packing} for the tpu layout in this dtype")
    export = serving.export_tpu if args.paged_layout == "tpu" else serving.export_gpu
    return export(masked, args.page_size, room=room)


def _write_paged(args: argparse.Namespace, model, export, context) -> None:
    """Writes the export to --export-paged (serving.export_io: atomically, manifest last) and says what it holds."""
    from kvzip_jax.serving import export_io

    start = time.perf_counter()
    path = export_io.save(args.export_paged, export, model, _meta(args, context), overwrite=args.overwrite)
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(
        f"exported to {path}/ in {time.perf_counter() - start:.1f} s: {export.layout} pages of {export.page_size} "
        f"slots, {export.pages_per_seq} per sequence, kv_len {int(export.kv_lens[0])}, next position "
        f"{int(export.positions[0])}; {on_disk:,} bytes on disk"
    )


def add_parser(subparsers) -> None:
    from kvzip_jax.kvzip.eviction import LEVELS

    parser = subparsers.add_parser(
        "compress",
        help="compress a context's KV cache once (KVzip, or any method of "
        "kvzip-jax methods), then answer questions from it",
    )
    options.add_model(parser)
    parser.add_argument("--context", required=True, metavar="FILE", help="text file to use as the context")
    parser.add_argument(
        "--ratio",
        type=float,
        help="fraction of context KV pairs kept, in (0, 1] (kvpress's compression_ratio is 1 - it)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        metavar="T",
        help="instead of --ratio, fast-kvzip and kvzap: evict the pairs their scorer scores below T outside the "
        "recent window (each head keeps what passes; the share kept is printed)",
    )
    options.add_method(parser)
    parser.add_argument(
        "--decode-budget",
        type=int,
        metavar="N",
        help="fast-kvzip, kvzap: while answering, cut the cache back to N pairs per (layer, KV head) on average every "
        "128 generated tokens (first 4 and last 128 tokens kept; docs/scorers.md)",
    )
    parser.add_argument(
        "--self-study",
        action="store_true",
        help="Attention Matching: add reference queries from "
        "turns the model writes about the context (a summary, its facts, questions and answers)",
    )
    parser.add_argument(
        "--level",
        choices=LEVELS,
        help="--method kvzip: its eviction level (default pair; head: run head-scores first; then no scoring pass)",
    )
    options.add_questions(parser)
    parser.add_argument(
        "--instruction",
        default="none",
        help="text that opens the user message before the "
        'context, kept with the never-evicted prefix: "kvzip" for '
        f'{options.KVZIP_INSTRUCTION_QUOTED}, or "none"',
    )
    options.add_chunk_size(parser, note="also Attention Matching's reference queries")
    parser.add_argument(
        "--sink",
        type=int,
        default=0,
        help="--level head: first context tokens every dropped head keeps (on top of the ratio)",
    )
    parser.add_argument(
        "--recent",
        type=int,
        default=0,
        help="--level head: last context tokens every dropped head keeps (on top of the ratio)",
    )
    parser.add_argument(
        "--save",
        metavar="DIR",
        help="write the compressed cache to DIR (atomically, with a "
        "manifest); answer from it later with: kvzip-jax ask --cache DIR",
    )
    options.add_export_paged(parser)
    parser.add_argument("--overwrite", action="store_true", help="--save, --export-paged: replace an existing DIR")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)"
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="write a figure of the kept share per (layer, KV head) and along the context"
    )
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="write the context as HTML, each token shaded by the share of (layer, KV head) pairs that kept it",
    )
    parser.add_argument(
        "--room",
        type=int,
        help="tokens of room after the compressed context (questions, answers, "
        "a chat over a saved cache; default: the longest question + --max-new-tokens, at least "
        f"{INTERACTIVE_QUESTION_ROOM} + --max-new-tokens when questions come later)",
    )
    options.add_kv_bits(parser)
    options.add_runtime(parser)
    parser.set_defaults(handler=run, subparser=parser)
