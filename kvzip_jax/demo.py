"""`make demo`: load a bundled model, prefill a bundled document once, answer questions about it from that cache,
then compress the cache with KVzip and answer the same questions from the compressed cache.

    python -m kvzip_jax.demo [--model qwen2.5-coder-0.5b-instruct] [--document FILE --questions FILE]

Prints the prefill time, the cache's bytes, and each answer with its time and whether it contains the expected
answer. The first run converts the bundled GGUF into checkpoints/ (about a minute); later runs load from there.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import jax

from kvzip_jax import cache as kv
from kvzip_jax import dtypes, kvzip, prompts
from kvzip_jax import generate as gen
from kvzip_jax.weights import registry

DEFAULT_MODEL = registry.QWEN


def _data(name: str) -> str:
    return resources.files("kvzip_jax").joinpath("data", name).read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name or a model path")
    parser.add_argument("--document", help="text file to use as the context (default: the bundled report)")
    parser.add_argument("--questions", help='JSON list of {"question", "answer"} (default: the bundled three)')
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--ratio", type=float, default=0.3, help="fraction of context KV pairs KVzip keeps")
    parser.add_argument(
        "--dtype",
        choices=dtypes.CHOICES,
        default="auto",
        help="params and cache precision (auto: bfloat16 on GPU and TPU, float32 on CPU)",
    )
    args = parser.parse_args(argv)

    document = open(args.document).read() if args.document else _data("demo_document.txt")
    qa = json.load(open(args.questions)) if args.questions else json.loads(_data("demo_questions.json"))

    start = time.perf_counter()
    model = registry.load(args.model, dtype=args.dtype)
    print(
        f"model {model.name}: {model.cfg.num_layers} layers, loaded in {time.perf_counter() - start:.1f} s, "
        f"{model.dtype} (jax {jax.__version__}, {jax.default_backend()})"
    )
    tok = model.tokenizer
    context, suffixes = prompts.split_for_reuse(tok, document, [item["question"] for item in qa])
    stops = prompts.stop_token_ids(tok)

    start = time.perf_counter()
    logits, cache = gen.prefill(model.params, model.cfg, [context.ids()])
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    print(
        f"prefill: {len(context)} tokens in {prefill_s:.1f} s ({len(context) / prefill_s:.0f} tokens/s, "
        "including compilation)"
    )
    print(
        f"KV cache: {kv.used_bytes(cache) / 2**20:.1f} MiB of keys/values filled, "
        f"{kv.nbytes(cache) / 2**20:.1f} MiB allocated (capacity {cache.capacity} tokens)"
    )

    full, cache = _answer_all(model, cache, qa, suffixes, stops, args.max_new_tokens, "full cache")

    start = time.perf_counter()
    prefix_len = context.context_start
    reread = kvzip.reread_inputs(tok, [prefix_len], [context.ids()[context.context_slice]])
    masked, _ = jax.jit(kvzip.score_and_evict)(model.params, model.cfg, cache, reread, args.ratio)
    room = len(max(suffixes, key=len)) + args.max_new_tokens
    compressed = kv.pack(masked, room)
    jax.block_until_ready(compressed)
    print(
        f"\nKVzip at ratio {args.ratio} (pair level): scored and evicted in {time.perf_counter() - start:.1f} s "
        f"(including compilation); ragged cache {kv.nbytes(compressed) / 2**20:.1f} MiB allocated "
        f"({kv.used_bytes(compressed) / 2**20:.1f} MiB of kept pairs, the rest room for {room} question and "
        f"answer tokens) vs {kv.used_bytes(cache) / 2**20:.1f} MiB filled in the full cache"
    )
    del masked, cache
    short, _ = _answer_all(
        model, compressed, qa, suffixes, stops, args.max_new_tokens, f"compressed cache, ratio {args.ratio}"
    )

    print("\n== side by side ==")
    for item, (a_full, ok_full), (a_short, ok_short) in zip(qa, full, short):
        print(
            f"Q: {item['question']}\n  full       [{'right' if ok_full else 'WRONG'}] {a_full}\n"
            f"  ratio {args.ratio:<4} [{'right' if ok_short else 'WRONG'}] {a_short}"
        )
    full_right, short_right = sum(ok for _, ok in full), sum(ok for _, ok in short)
    print(f"\nfull cache {full_right}/{len(qa)} right; compressed cache {short_right}/{len(qa)} right")
    return 0 if full_right == short_right == len(qa) else 1


def _answer_all(model, cache, qa, suffixes, stops, max_new_tokens, label):
    """Answers every question from one cache (each question is appended, answered, then dropped).
    Returns ([(answer, right)], cache)."""
    print(f"\n== answers from the {label} ==")
    results = []
    for item, suffix in zip(qa, suffixes):
        start = time.perf_counter()
        answer, cache = gen.ask(model.params, model.cfg, cache, suffix, max_new_tokens, stop_tokens=stops)
        seconds = time.perf_counter() - start
        text = model.tokenizer.decode([t for t in answer if t not in stops]).strip()
        hit = item["answer"].lower() in text.lower()
        results.append((text, hit))
        print(
            f"Q: {item['question']}\nA: {text}\n   [{'right' if hit else 'WRONG'}: expected {item['answer']!r}; "
            f"{len(answer)} tokens in {seconds:.1f} s]"
        )
    return results, cache


if __name__ == "__main__":
    raise SystemExit(main())
