"""The `kvzip-jax` command, one module per subcommand (convert, head_scores, compress, ask, chat, eval, methods,
train_scorer), each with add_parser(subparsers) and run(args) -> exit code; options.py holds the options several
take, eval_options.py eval's own flags, common.py what they share.

  kvzip-jax convert --hf DIR | --gguf FILE --out checkpoints/NAME [--overwrite] [--dtype bfloat16] [--mesh D,S,T]
  kvzip-jax convert --bundled NAME [--out DIR]      (default out: $KVZIP_CHECKPOINTS or ./checkpoints, /NAME)
  kvzip-jax head-scores --model NAME_OR_PATH [--tokens N] [--text FILE] [--overwrite]
      once per model: per-(layer, KV head) scores for --level head, saved beside the checkpoint (head_scores.json)
  kvzip-jax methods [NAME]
      the compression methods (methods registry) as a markdown table, or one method's inputs and options
  kvzip-jax train-scorer --model NAME_OR_PATH --kind gate|linear [--texts N] [--held-out N] [--out DIR]
      a scorer that needs no reread (fast-kvzip's gate, kvzap's regressor) from texts the model writes; resumable
      (texts and features in <checkpoints>/MODEL/scorers/data); weights and manifest to <checkpoints>/MODEL/scorers/KIND
  kvzip-jax compress --model NAME_OR_PATH --context FILE --ratio R [--method kvzip|am-hak|...]
                     [--level pair|pair-uniform|layer|head] [--question Q ...] [--questions FILE]
                     [--max-new-tokens N] [--chunk-size M] [--save DIR] [--plot PNG] [--html FILE]
      prefill the context once, compress its cache with a method that sees no question (--level: KVzip's; ratio =
      fraction of context pairs kept), then answer each question from the
      compressed cache; with no questions given, reads them from stdin, one per line. --save DIR: keep the
      compressed cache (kvzip_jax.cache_io: orbax arrays + a checked manifest, written atomically; no questions
      given: save only)
  kvzip-jax ask --cache DIR [--question Q ...] [--questions FILE] [--model NAME_OR_PATH]
      answer from a saved cache in a new process: no prefill, no scoring (the model is the one that made it, checked)
  kvzip-jax chat --model NAME_OR_PATH --context FILE --ratio R [--method M] [--room N] | --cache DIR
      a terminal chat over a compressed document: answers streamed, earlier turns kept after the compressed context
      (never evicted), /bytes, /reset, Ctrl-D exits
  kvzip-jax eval --model NAME_OR_PATH [--methods kvzip,snapkv,...] [--ratios 1,0.9,...] [--tasks niah,ruler,...]
                 [--jsonl FILE ...] [--dataset PATH ...] [--contexts N] [--context-tokens N] [--modes reuse,...]
                 [--out DIR] [--instruction kvzip|none|TEXT] [--process-index I --process-count N]
      a sweep: every context prefilled and scored once per method, every question answered from every compressed
      cache; results appended to DIR/results.jsonl (a rerun of the same settings resumes; other settings are
      refused), then DIR/summary.md, summary.csv, scores.png. With N processes (flags, else $KVZIP_PROCESS_INDEX and
      $KVZIP_PROCESS_COUNT, else jax.process_index() of jax.process_count()), process I sweeps every Nth batch of
      contexts (sorted by length) into DIR/results.I-of-N.jsonl and writes no summary
  kvzip-jax eval ... --write-dataset PATH
      no sweep: the examples written in kvpress's format, one row per question, to a .jsonl or .parquet file that
      --dataset reads back (--model only for RULER's tasks, generated in its tokens)
  kvzip-jax eval --merge --out DIR
      joins the results files of a sweep's processes into DIR/results.jsonl and writes the summary a one-process
      sweep writes (the files must hold one sweep's settings)
  kvzip-jax eval ... --distributed [--coordinator HOST:PORT --num-processes N --process-id I]
      one replica over every process's devices (jax.distributed.initialize first); every process runs every batch,
      process 0 writes DIR/results.jsonl and the summary

On a base model (weights.registry.BASE_MODELS) compress, ask and chat say so in one line and ask each question as a
plain completion prompt (prompts: "Question: ...", "Answer:", ending at a newline), not through a chat template.
Errors kvzip-jax raises on purpose (kvzip_jax.errors) print as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from kvzip_jax.cli import ask, chat, compress, convert, head_scores, methods, train_scorer
from kvzip_jax.cli import eval as eval_command
from kvzip_jax.cli.head_scores import head_scores_path
from kvzip_jax.errors import KvzipError

__all__ = ["EXIT_USER_ERROR", "build_parser", "head_scores_path", "main"]

EXIT_USER_ERROR = 2
# in the order `kvzip-jax --help` lists them
COMMANDS = (convert, head_scores, compress, ask, chat, eval_command, methods, train_scorer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvzip-jax", description="KV-cache compression (KVzip) in JAX")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KvzipError as e:
        print(f"kvzip-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
