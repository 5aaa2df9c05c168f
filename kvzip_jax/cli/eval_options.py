"""kvzip-jax eval's flags (kvzip_jax/cli/eval.py runs them)."""

from __future__ import annotations

from kvzip_jax.cli import options

RULER = "ruler"  # --tasks ruler: every RULER task that needs no outside data set (ruler.OFFLINE)
OWN_SEED = 0  # --seed's default for the package's own tasks and the random baseline (RULER's: ruler.SEED)


def add_arguments(parser) -> None:
    """Every flag of `kvzip-jax eval` on its subparser."""
    from kvzip_jax import methods
    from kvzip_jax.eval.tasks import ruler

    options.add_model(parser, required=False, note="required unless --merge")
    parser.add_argument(
        "--methods",
        default="kvzip,snapkv,pyramidkv,h2o,streamingllm,random",
        help=f"comma-separated, from {','.join(methods.names())} (kvzip-jax methods describes them); a method with "
        "options as NAME:OPTION=VALUE[:...], e.g. kvzap:threshold=-4 (ratio then ignored) or kvzip:level=layer",
    )
    parser.add_argument("--ratios", default="1,0.9,0.7,0.5,0.3,0.2,0.1", help="fractions of context pairs kept")
    parser.add_argument(
        "--tasks",
        help="comma-separated generated tasks, ruler_* for a RULER task, ruler for the 11 needing no data set "
        "(default: the package's own tasks, unless --jsonl or --dataset is given)",
    )
    parser.add_argument(
        "--jsonl",
        action="append",
        metavar="FILE",
        help="SCBench-style records {context, queries, answers} (repeatable)",
    )
    parser.add_argument(
        "--dataset",
        action="append",
        metavar="PATH",
        help="a dataset in kvpress's format (parquet or JSONL: context, question, answer_prefix, answer, "
        "max_new_tokens, task), or a hub name OWNER/NAME[:DATA_DIR] read through `datasets` when online; rows "
        "sharing a context share one compressed cache (repeatable)",
    )
    parser.add_argument("--contexts", type=int, default=20, help="generated contexts (RULER: samples) per task")
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=1000,
        help="approximate size of generated contexts; RULER's max_seq_length in the model's tokens (e.g. 4096)",
    )
    parser.add_argument(
        "--questions-per-context",
        type=int,
        metavar="N",
        help="ask only the first N questions of each context (default all)",
    )
    parser.add_argument(
        "--modes",
        default="reuse",
        help="reuse (compress once, no question), first (compress "
        "with the first question, reuse), oracle (recompress per question); query-aware methods",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="contexts per jitted batch")
    options.add_chunk_size(parser)
    parser.add_argument(
        "--self-study",
        action="store_true",
        help="Attention Matching methods: add reference "
        "queries from turns the model writes about each context (a summary, its facts, questions "
        "and answers), beside the reread's",
    )
    parser.add_argument(
        "--self-study-samples",
        type=int,
        default=1,
        metavar="N",
        help="with --self-study: turns sampled per prompt and context, all written in one batch (default 1)",
    )
    parser.add_argument(
        "--self-study-tokens",
        type=int,
        default=64,
        metavar="N",
        help="with --self-study: most tokens of a sampled answer (default 64)",
    )
    parser.add_argument(
        "--query-cap",
        type=int,
        metavar="N",
        help="Attention Matching: most reference queries "
        "per KV head and layer, split evenly over the sources (default MatchingConfig's, 8192)",
    )
    parser.add_argument(
        "--kv-bits",
        default="16",
        help="comma-separated bits of the kept keys and values: every cache "
        "answers at each (16: the model's dtype; 8, 4: quantized per token in groups; 8/4: int8 keys beside int4 "
        "values; the full cache quantized is quantization alone); the report plots score against bytes",
    )
    parser.add_argument(
        "--kv-group",
        type=int,
        default=None,
        help="--kv-bits 8 / 4 / 8/4: elements per scale and zero point (default 64 for int8, 16 for int4)",
    )
    parser.add_argument(
        "--kv-window",
        type=int,
        default=options.KV_WINDOW,
        help="--kv-bits 8 / 4 / 8/4: recent tokens kept at full precision",
    )
    options.add_kv_center(parser)
    parser.add_argument(
        "--scorers",
        metavar="DIR",
        help="fast-kvzip, kvzap: a folder holding their trained scorers, gate/ and linear/ (default "
        "<checkpoints>/MODEL/scorers/KIND, then the bundled ones; kvzip-jax train-scorer makes them)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"task generation and the random baseline (default {OWN_SEED}; RULER's tasks: {ruler.SEED}, RULER's)",
    )
    parser.add_argument(
        "--instruction",
        default="kvzip",
        help="text that opens every user message before the "
        'context, in the never-evicted prefix: "kvzip" (default) for '
        f'{options.KVZIP_INSTRUCTION_QUOTED}, as bench/quality.py uses; "none" for none',
    )
    parser.add_argument("--out", metavar="DIR", help="output folder (default runs/MODEL)")
    parser.add_argument(
        "--write-dataset",
        metavar="PATH",
        help="run no sweep: write the examples in kvpress's format to PATH (.jsonl or .parquet, a row per question, "
        "with its task, metric and example id) and exit; --model is needed only for RULER's tasks (in its tokens)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--process-index",
        type=int,
        metavar="I",
        help="with --process-count N: sweep only every "
        "Nth batch of contexts (sorted by length), from the Ith (0-based), into "
        "DIR/results.I-of-N.jsonl, no summary; default $KVZIP_PROCESS_INDEX, else jax.process_index()",
    )
    parser.add_argument(
        "--process-count",
        type=int,
        metavar="N",
        help="processes sharing the sweep out (default "
        "$KVZIP_PROCESS_COUNT, else jax.process_count(): 1 unless jax.distributed is initialised)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="run no sweep: join the results files in --out DIR "
        "(results.jsonl, results.I-of-N.jsonl; one sweep's settings) into DIR/results.jsonl and "
        "write the summary, as one process would",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="one replica over the devices of every process: "
        "call jax.distributed.initialize() first (auto-detected on TPU pods, Slurm, Open MPI), then "
        "every process runs every batch in lockstep and process 0 writes results and summary (DIR "
        "on a filesystem every process shares)",
    )
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="with --distributed: process 0's address, for jax.distributed.initialize where it detects none",
    )
    parser.add_argument("--num-processes", type=int, metavar="N", help="with --distributed and --coordinator")
    parser.add_argument(
        "--process-id",
        type=int,
        metavar="I",
        help="with --distributed and --coordinator: this process's rank (0 writes)",
    )
    options.add_runtime(parser)
