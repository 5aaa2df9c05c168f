"""What several commands share: reading input files, progress bars, byte counts, loading a model or a saved cache,
compressing a prefilled cache, and answering a question from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Iterator

from kvzip_jax.cli import options
from kvzip_jax.errors import EmptyInputError, KvzipError


class InputFileError(KvzipError):
    """A context or questions file is missing, unreadable or malformed."""


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of a file; InputFileError naming `what` when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputFileError(f"cannot read the {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise InputFileError(f"the {what} file {path} is not UTF-8 text") from None


def read_context(path: str) -> str:
    """The context file's text; EmptyInputError when it holds only whitespace."""
    document = read_text(path, "context")
    if not document.strip():
        raise EmptyInputError(f"the context file {path} is empty")
    return document


def questions(args: argparse.Namespace) -> list[str] | None:
    """The questions given by --question and --questions FILE (None: none given, read them from stdin)."""
    found = list(args.question or [])
    if args.questions:
        try:
            items = json.loads(read_text(args.questions, "questions"))
            found += [item if isinstance(item, str) else item["question"] for item in items]
        except (ValueError, TypeError, KeyError):
            raise InputFileError(
                f'{args.questions} is not a JSON list of strings or of {{"question", "answer"}} objects'
            ) from None
    return found or None


def stdin_questions() -> Iterator[str]:
    """The non-empty lines of stdin, read as they come, after saying so."""
    print("questions from stdin, one per line (end with EOF):", flush=True)
    return (q for q in map(str.strip, sys.stdin) if q)


def progress(args: argparse.Namespace, what: str, unit: str = "tok", log_seconds: float | None = None):
    """(on_chunk(done, total) callback, close): a tqdm bar on stderr, off with --quiet. When stderr is not a terminal
    there is no bar; with log_seconds, a plain line `what: done/total unit` goes to stderr at most that often instead
    (long work run into a log)."""
    from tqdm import tqdm

    quiet = getattr(args, "quiet", False)
    if not quiet and not sys.stderr.isatty():
        last = -float("inf")

        def log_line(done: int, total: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= log_seconds or done == total:
                last = now
                print(f"{what}: {done}/{total} {unit}", file=sys.stderr, flush=True)

        return (log_line if log_seconds is not None else lambda done, total: None), lambda: None
    bar = tqdm(desc=what, unit=unit, disable=quiet, file=sys.stderr, leave=False)

    def on_chunk(done: int, total: int) -> None:
        bar.total = total
        bar.update(max(done - bar.n, 0))

    return on_chunk, bar.close


def cache_bytes(cache) -> str:
    """A cache's filled and allocated bytes, in bytes and MiB."""
    from kvzip_jax import cache as kv

    used, allocated = kv.used_bytes(cache), kv.nbytes(cache)
    return f"{used:,} filled / {allocated:,} allocated ({used / 2**20:.1f} / {allocated / 2**20:.1f} MiB)"


def load_model(args: argparse.Namespace):
    """The model of --model in --dtype, running attention with --attention-impl. A bundled model's first use says
    that it is converted (once) before the wait."""
    from kvzip_jax.weights import registry
    from kvzip_jax.weights.checkpoint import is_checkpoint

    if args.model in registry.BUNDLED and not is_checkpoint(registry.default_checkpoints_dir() / args.model):
        print(
            f"converting the bundled model {args.model} into {registry.default_checkpoints_dir() / args.model} "
            "(once; a minute or two)",
            file=sys.stderr,
            flush=True,
        )
    model = registry.load(args.model, dtype=args.dtype)
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, attention_impl=args.attention_impl))


def load_saved(args: argparse.Namespace):
    """(model, cache, manifest's meta) of --cache: the model is --model or the one the manifest names, in --dtype or
    the dtype the cache was saved in."""
    from kvzip_jax import cache_io

    manifest = cache_io.read_manifest(args.cache)
    meta = manifest.get("meta", {})
    args.model = args.model or meta.get("model_source")
    if not args.model:
        args.subparser.error(f"{args.cache} does not say which model made it; give --model")
    args.dtype = args.dtype or manifest["dtype"]
    model = load_model(args)
    cache, _ = cache_io.load(args.cache, model)
    return model, cache, meta


def quantized(args: argparse.Namespace, cache):
    """cache with its kept pairs quantized as --kv-bits says (unchanged for 16, or when it is quantized already as
    asked); a usage error for a saved quantized cache asked for another precision."""
    from kvzip_jax import cache as kv

    formats = options.kv_formats(args)
    saved = kv_bits(cache)
    if saved is not None:
        if args.kv_bits is not None and args.kv_bits != saved:
            args.subparser.error(
                f"the cache was saved with --kv-bits {saved}; it cannot be read as --kv-bits "
                f"{args.kv_bits} (compress it again)"
            )
        return cache
    if formats is None:
        return cache
    if args.kv_window < 1:
        args.subparser.error("--kv-window must be >= 1")
    try:
        for fmt in formats:
            fmt.group_for(cache.layers[0].k.shape[-1])
    except ValueError as e:
        args.subparser.error(f"--kv-group: {e}")
    keys, values = formats
    return kv.quantized(cache, keys, args.kv_window, args.kv_center, value_fmt=values)


def kv_bits(cache) -> int | str | None:
    """The --kv-bits of a quantized cache's kept pairs (8, 4, or "8/4": int8 keys, int4 values), or None (not
    quantized)."""
    from kvzip_jax import cache as kv

    layer = next((layer for layer in cache.layers if isinstance(layer, kv.QuantizedLayerCache)), None)
    if layer is None:
        return None
    k, v = layer.store.k.bits, layer.store.v.bits
    return k if k == v else f"{k}/{v}"


def asks_by_completion(model) -> bool:
    """Whether questions to the model take the completion layout (prompts: a base model, registry.BASE_MODELS);
    says so in one line when they do."""
    from kvzip_jax.weights import registry

    if model.name not in registry.BASE_MODELS:
        return False
    print(
        f"{model.name} is a base model (not instruction-tuned): questions are asked as a plain completion prompt; "
        "expect weak answers",
        flush=True,
    )
    return True


def evict(args: argparse.Namespace, model, cache, context, head_scores):
    """(compressed cache, how it was made, (the method's prepared state, its inputs) or None): --method's
    compression (methods registry) with --level given to its options, or KVzip's saved head scores for --level head
    (no scoring pass). A method that sees the question sees none here: it observes the context's end, as in
    kvpress."""
    import jax
    import jax.numpy as jnp

    from kvzip_jax import cache as kv
    from kvzip_jax import kvzip, matching, methods
    from kvzip_jax.kvzip.scoring import chunk_progress, evictable_layers
    from kvzip_jax.scorers import scorer

    prefix_len, context_len = context.context_start, len(context) - context.context_start
    if args.level == "head":
        keep = kvzip.head_keep(
            head_scores, [context_len], context_len, args.ratio, args.sink, args.recent, evictable_layers(model.cfg)
        )  # [L, 1, K, n]
        masked = kv.mask_context(cache, keep, jnp.array([prefix_len]), jnp.array([context_len]))
        return masked, "from saved head scores, no scoring pass", None
    method = methods.get(args.method)
    changes = {"level": args.level} if args.level else {}
    if getattr(args, "threshold", None) is not None:
        changes["threshold"] = args.threshold
    options = method.options_for(model.name, model.cfg, **changes)
    ratio = 1.0 if args.ratio is None else args.ratio  # a threshold sets what is kept
    row = context.ids()[context.context_slice]
    reread = kvzip.reread_inputs(model.tokenizer, [prefix_len], [row], args.chunk_size)
    available = dict(
        reread=lambda: reread,
        context_tokens=lambda: jnp.asarray([row], jnp.int32),
        key=lambda: jnp.stack([jax.random.key(0)]),
        scorer=lambda: scorer.load(model, options.kind, args.scorer),
        probes=lambda: (
            matching.self_study.probes(model.params, model.cfg, model.tokenizer, cache) if args.self_study else None
        ),
    )
    inputs = methods.Inputs(
        reread.prefix_len, reread.context_len, **{name: available[name]() for name in method.reads if name in available}
    )
    on_chunk, done = progress(args, f"{method.name}: scoring (reread chunks)", unit="chunk")
    with chunk_progress(on_chunk):
        state = method.jitted_prepare(model.params, model.cfg, cache, inputs, options)
        compressed = method.jitted_finish(model.params, model.cfg, cache, inputs, state, ratio, options)
        jax.block_until_ready(compressed)
    done()
    kept_all = ratio >= 1.0 and getattr(options, "threshold", None) is None
    how = "ratio 1 keeps the cache as it is" if kept_all else methods.FAMILIES[method.family]
    return compressed, how, (state, inputs)


def answer(model, cache, question: str, suffix, max_new_tokens: int, completion: bool):
    """Answers one question from the cache (appended, answered, dropped again); prints it. suffix: the question's
    ids (None: laid out here, as a completion prompt if completion). Returns the cache."""
    from kvzip_jax import generate as gen
    from kvzip_jax import prompts

    start = time.perf_counter()
    stops = prompts.stop_token_ids(model.tokenizer, completion)
    suffix = prompts.question_suffix(model.tokenizer, question, completion=completion) if suffix is None else suffix
    answer_ids, cache = gen.ask(model.params, model.cfg, cache, suffix, max_new_tokens, stop_tokens=stops)
    text = model.tokenizer.decode([t for t in answer_ids if t not in stops]).strip()
    seconds = time.perf_counter() - start
    print(f"Q: {question}\nA: {text}\n   [{len(answer_ids)} tokens in {seconds:.1f} s]", flush=True)
    return cache
