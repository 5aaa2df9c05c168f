"""Options several commands take, each defined once: the model, the questions, the compression method, the reread
chunk, the task instruction, KV quantization (--kv-bits), a serving engine's pages (--export-paged), and the runtime
(--dtype, --attention-impl)."""

from __future__ import annotations

import argparse

from kvzip_jax import dtypes
from kvzip_jax.kv_bits import KV_BITS
from kvzip_jax.prompts import KVZIP_INSTRUCTION, named_instruction
from pallas_kernels.dispatch import IMPLS

MODEL_HELP = "bundled model name or a model path"
KVZIP_INSTRUCTION_QUOTED = f'KVzip\'s task instruction ("{KVZIP_INSTRUCTION}")'


def add_model(parser, required: bool = True, note: str | None = None) -> None:
    """--model NAME_OR_PATH; note: what the help adds in parentheses (a default, when it is not required)."""
    parser.add_argument("--model", required=required, help=MODEL_HELP + (f" ({note})" if note else ""))


def add_questions(parser) -> None:
    """--question (repeatable), --questions FILE and --max-new-tokens (64)."""
    parser.add_argument("--question", action="append", metavar="Q", help="a question (repeatable)")
    parser.add_argument("--questions", metavar="FILE", help='JSON list of strings or of {"question", "answer"}')
    add_max_new_tokens(parser, 64)


def add_max_new_tokens(parser, default: int) -> None:
    """--max-new-tokens: the most tokens an answer may have."""
    parser.add_argument("--max-new-tokens", type=int, default=default)


def add_method(parser) -> None:
    """--method: a method that sees no question (methods registry; default kvzip): the cache is compressed once,
    before any question."""
    from kvzip_jax import methods

    agnostic = [name for name in methods.names() if not methods.get(name).question_aware]
    parser.add_argument(
        "--method",
        choices=agnostic,
        default="kvzip",
        help="how the cache is compressed, once, "
        f"before any question: {', '.join(agnostic)} (default kvzip; kvzip-jax methods describes "
        "them)",
    )
    parser.add_argument(
        "--scorer",
        metavar="DIR",
        help="fast-kvzip, kvzap: the trained scorer (default <checkpoints>/MODEL/scorers/KIND, then the bundled one)",
    )


def budget(args) -> str:
    """How much a command keeps, in words: "ratio 0.3" or "threshold -4.0"."""
    return f"ratio {args.ratio}" if getattr(args, "threshold", None) is None else f"threshold {args.threshold}"


def add_chunk_size(parser, note: str = "") -> None:
    """--chunk-size, KVzip's reread chunk in tokens; note: what else the help says it sets."""
    from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK

    parser.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK,
        help=f"KVzip reread chunk (tokens{'; ' + note if note else ''})",
    )


def instruction(args) -> str | None:
    """The task instruction --instruction names (prompts.named_instruction); a usage error when it is blank."""
    if not args.instruction.strip():
        args.subparser.error('--instruction is empty; give a text, "kvzip" or "none"')
    return named_instruction(args.instruction)


KV_WINDOW = 128  # cache.WINDOW, likewise


def kv_bits(text: str) -> int | str:
    """A --kv-bits value: 16, 8 or 4 (ints), or "8/4" (int8 keys beside int4 values)."""
    bits = text.strip() if "/" in text else int(text) if text.strip().isdigit() else text
    if bits not in KV_BITS:
        raise argparse.ArgumentTypeError(f"must be one of 16, 8, 4, 8/4 (int8 keys, int4 values), got {text!r}")
    return bits


def add_kv_bits(parser, saved: bool = False) -> None:
    """--kv-bits, --kv-group, --kv-window: quantize the compressed cache's kept pairs. saved: for commands that
    answer from a saved cache (ask, chat --cache), where the default is the cache as saved."""
    note = "default: as the cache was saved; 8, 4 or 8/4 quantize an unquantized one now" if saved else "default 16"
    parser.add_argument(
        "--kv-bits",
        type=kv_bits,
        default=None if saved else 16,
        help=f"bits of the kept keys and values: 16 keeps the model's dtype, 8 and 4 quantize them "
        f"per token in groups, 8/4 keys in int8 beside values in int4, which keeps exact strings that int4 keys "
        f"can lose ({note})",
    )
    parser.add_argument(
        "--kv-group",
        type=int,
        default=None,
        help="--kv-bits 8 / 4 / 8/4: elements per scale and zero "
        "point (default 64 for int8, 16 for int4; the head dim when it is smaller)",
    )
    parser.add_argument(
        "--kv-window",
        type=int,
        default=KV_WINDOW,
        help="--kv-bits 8 / 4 / 8/4: recent tokens (the "
        "questions and answers) kept at full precision before they are quantized",
    )
    add_kv_center(parser)


def add_kv_center(parser) -> None:
    parser.add_argument(
        "--kv-center",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--kv-bits 8 / 4 / 8/4: "
        "centre each head's keys per channel before quantizing them (exact; default on: a channel "
        "far from 0 on every token would otherwise spend the levels of its group)",
    )


def kv_formats(args):
    """(keys' quant.QuantFormat, values') that --kv-bits and --kv-group name, or None for --kv-bits 16 (or
    absent)."""
    if args.kv_bits in (None, 16):
        return None
    from kvzip_jax.quant.groups import kv_formats

    try:
        return kv_formats(args.kv_bits, args.kv_group)
    except ValueError as e:
        args.subparser.error(f"--kv-group: {e}")


def add_runtime(parser, saved_dtype_help: str | None = None) -> None:
    """--dtype and --attention-impl. saved_dtype_help: for commands that answer from a saved cache (ask, chat), whose
    --dtype defaults to the cache's: its help, and the attention help speaks of decoding only."""
    if saved_dtype_help is None:
        parser.add_argument(
            "--dtype",
            choices=dtypes.CHOICES,
            default="auto",
            help="params and cache precision (auto: bfloat16 on GPU and TPU, float32 on CPU)",
        )
        impl_help = "decode attention and KVzip's score reduction (auto: Pallas on CUDA GPUs, else XLA)"
    else:
        parser.add_argument("--dtype", choices=dtypes.CHOICES, help=saved_dtype_help)
        impl_help = "decode attention (auto: Pallas on CUDA GPUs, else XLA)"
    parser.add_argument("--attention-impl", choices=IMPLS, default="auto", help=impl_help)


PAGED_LAYOUTS = ("tpu", "gpu")  # serving.LAYOUTS
DEFAULT_PAGE_SIZE = 16


def add_export_paged(parser) -> None:
    """--export-paged DIR, --page-size N, --paged-layout tpu|gpu."""
    parser.add_argument(
        "--export-paged",
        metavar="DIR",
        help="write the compressed cache to DIR in a serving engine's pages (the pages, page table, kept lengths, "
        "logical next positions and a manifest; docs/serving.md). The engine keeps one length per sequence: "
        "compress with --level pair-uniform",
    )
    parser.add_argument(
        "--page-size", type=int, metavar="N", help=f"--export-paged: slots per page (default {DEFAULT_PAGE_SIZE})"
    )
    parser.add_argument(
        "--paged-layout",
        choices=PAGED_LAYOUTS,
        help="--export-paged: tpu (tpu-inference, vLLM on TPU; default) or gpu (vLLM's FlashAttention blocks)",
    )


def check_export_paged(args) -> None:
    """Usage errors of --export-paged's flags; fills in their defaults."""
    if args.export_paged is None:
        if args.page_size is not None or args.paged_layout is not None:
            args.subparser.error("--page-size and --paged-layout go with --export-paged")
        return
    if args.kv_bits not in (None, 16) or getattr(args, "decode_budget", None) is not None:
        args.subparser.error(
            "--export-paged writes the kept pairs in the model's dtype: no --kv-bits, no --decode-budget"
        )
    args.page_size = DEFAULT_PAGE_SIZE if args.page_size is None else args.page_size
    args.paged_layout = args.paged_layout or "tpu"
    if args.page_size < 1:
        args.subparser.error(f"--page-size must be >= 1, got {args.page_size}")
