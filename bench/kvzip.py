"""KVzip cost on SmolLM2-135M, measured side by side in one run (CPU float32 here).

    python bench/kvzip.py [--tokens 2048 4096] [--ratio 0.3] [--decode-tokens 32] [--kvpress-python PATH]
                           [--random-weights]

Per context length (real text: the bundled demo document, repeated as needed, cut to exactly N context tokens):
  - prefill time, and scoring time (KVzip's reread + scores, jitted) as a multiple of that prefill, printed beside
    the ratio of the FLOPs the two passes must do (models/flops.py); their quotient shows wasted work (target:
    <= 1.15);
  - KV bytes of the full cache (filled pairs and allocated) and of the ragged cache at the ratio (allocated,
    with no room and with room for a 64-token question + answer) (target: ragged <= 0.32x full);
  - decode time per token from the full, masked and ragged caches;
  - when kvpress is installed in its own venv (bench/setup_kvpress_venv.sh; default .venv-kvpress/bin/python),
    its prefill and KVzipPress times on the same model and text, and our prefill + scoring speed-up over
    KVzipPress (target >= 2.5x).
Compilation is excluded: every timed call runs once before. Times are best of --repeats.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK, evictable_layers
from kvzip_jax.models.flops import kvzip_scoring_flops, prefill_flops
from kvzip_jax.weights import registry

ROOT = Path(__file__).resolve().parent.parent
QUESTION_ROOM = 64


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(best wall time of `repeats` calls after one warm-up call, the last result)."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        jax.block_until_ready(result)
        times.append(time.perf_counter() - start)
    return min(times), result


def context_text(tokenizer, num_tokens: int) -> str:
    """Exactly num_tokens tokens of the bundled demo document (repeated as needed), as text."""
    document = resources.files("kvzip_jax").joinpath("data", "demo_document.txt").read_text()
    ids = prompts.encode_text(tokenizer, document)
    ids = np.concatenate([ids] * (num_tokens // len(ids) + 1))[:num_tokens]
    return tokenizer.decode(ids.tolist())


def decode_per_token(model, logits, cache, steps: int, repeats: int) -> float:
    """Seconds per decoded token (greedy, no stop token), the cache rewound between runs."""
    cache = jax.tree.map(jnp.array, cache)  # decode donates its cache; callers keep theirs
    before = kv.mark(cache)
    state = {"cache": cache}

    def run():
        out, after = gen.decode(model.params, model.cfg, logits, state["cache"], steps)
        state["cache"] = kv.rewind(after, before)
        return out

    seconds, out = best_time(run, repeats)
    assert len(out[0]) == steps, "decoding stopped early (cache full?)"
    return seconds / steps


def kvpress_figures(python: str, tokens: list[int], text: str) -> dict[int, dict]:
    """Runs bench/kvpress_peer.py in kvpress's own venv; {tokens: its JSON line}."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    command = [
        python,
        str(ROOT / "bench" / "kvpress_peer.py"),
        "--gguf",
        str(registry.bundled_gguf(registry.SMOLLM2)),
        "--context",
        f.name,
        "--tokens",
        ",".join(map(str, tokens)),
    ]
    print(f"running kvpress: {' '.join(command)}", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    os.unlink(f.name)
    if done.returncode != 0:
        print(f"kvpress peer failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return {}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["tokens"]: row for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kvpress-python", default=str(ROOT / ".venv-kvpress" / "bin" / "python"))
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="the checkpoint's config and tokenizer with "
        "random params (timing only, for machines without the weights; kvpress is skipped)",
    )
    args = parser.parse_args()

    model = registry.load_random(registry.SMOLLM2) if args.random_weights else registry.load(registry.SMOLLM2)
    cfg, tok = model.cfg, model.tokenizer
    weights = " (random weights)" if args.random_weights else ""
    print(
        f"SmolLM2-135M float32{weights}, jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores), "
        f"KVzip ratio {args.ratio}, chunk {args.chunk_size}, best of {args.repeats}"
    )
    score = jax.jit(kvzip.score)
    rows = []
    for n in args.tokens:
        context, _ = prompts.split_for_reuse(tok, context_text(tok, n), ["?"])
        ids = context.ids()
        prefix_len, n_ctx = context.context_start, len(ids) - context.context_start
        prefill_s, (logits, cache) = best_time(lambda: gen.prefill(model.params, cfg, [ids]), args.repeats)
        reread = kvzip.reread_inputs(tok, [prefix_len], [ids[prefix_len:]], args.chunk_size)
        score_s, scores = best_time(functools.partial(score, model.params, cfg, cache, reread), args.repeats)

        num_chunks = reread.tokens.shape[0]
        flops_prefill = prefill_flops(cfg, len(ids))
        flops_score = kvzip_scoring_flops(
            cfg,
            len(ids),
            [int(w) for w in reread.num_valid[:, 0]],
            [int(c) for c in reread.chunk_len[:, 0]],
            len(evictable_layers(cfg)),
        )

        keep = kvzip.keep_mask(scores, reread.context_len, args.ratio, "pair", evictable_layers(cfg))
        masked = kv.mask_context(cache, keep, reread.prefix_len, reread.context_len)
        ragged_bare = kv.pack(masked, 0)
        ragged = kv.pack(masked, QUESTION_ROOM)
        full_filled, full_alloc = kv.used_bytes(cache), kv.nbytes(cache)
        bytes_bare, bytes_room = kv.nbytes(ragged_bare), kv.nbytes(ragged)
        full_with_room = full_filled * (len(ids) + QUESTION_ROOM) / len(ids)  # the full cache given the same room

        decode_full = decode_per_token(model, logits, cache, args.decode_tokens, args.repeats)
        decode_masked = decode_per_token(model, logits, masked, args.decode_tokens, args.repeats)
        decode_ragged = decode_per_token(model, logits, ragged, args.decode_tokens, args.repeats)
        rows.append(
            dict(
                tokens=n,
                context=n_ctx,
                prefix=prefix_len,
                chunks=num_chunks,
                prefill_s=prefill_s,
                score_s=score_s,
                flop_ratio=flops_score / flops_prefill,
            )
        )
        print(f"\n== {n_ctx} context tokens (+{prefix_len} prefix), {num_chunks} chunk(s) ==")
        print(
            f"prefill {prefill_s:.2f} s; scoring {score_s:.2f} s = {score_s / prefill_s:.2f}x prefill; FLOP ratio "
            f"{flops_score / flops_prefill:.2f}x -> time/FLOP ratio "
            f"{score_s / prefill_s / (flops_score / flops_prefill):.2f}"
            f" ({flops_prefill / prefill_s / 1e9:.0f} and {flops_score / score_s / 1e9:.0f} GFLOP/s)"
        )
        print(
            f"KV bytes: full {full_filled / 2**20:.2f} MiB filled ({full_alloc / 2**20:.2f} MiB allocated); ragged "
            f"at {args.ratio}: {bytes_bare / 2**20:.2f} MiB = {bytes_bare / full_filled:.3f}x filled full, "
            f"{bytes_bare / full_alloc:.3f}x allocated; with room for {QUESTION_ROOM} tokens "
            f"{bytes_room / 2**20:.2f} MiB = {bytes_room / full_with_room:.3f}x the full cache with the same room; "
            f"masked: {kv.nbytes(masked) / 2**20:.2f} MiB"
        )
        print(
            f"decode per token: full {decode_full * 1e3:.1f} ms, masked {decode_masked * 1e3:.1f} ms, ragged "
            f"{decode_ragged * 1e3:.1f} ms ({decode_full / decode_ragged:.2f}x faster than full)"
        )
        del cache, masked, ragged, ragged_bare, scores

    if args.random_weights:
        return
    if not Path(args.kvpress_python).exists():
        print(f"\nkvpress: not installed ({args.kvpress_python} missing; run bench/setup_kvpress_venv.sh)")
        return
    theirs = kvpress_figures(args.kvpress_python, args.tokens, context_text(tok, max(args.tokens)))
    print("\n  tokens   ours: prefill  +score   kvpress: prefill  KVzipPress   KVzipPress / (our prefill+score)")
    for row in rows:
        peer = theirs.get(row["tokens"])
        if peer is None:
            print(f"{row['tokens']:>8}   (kvpress gave no figure)")
            continue
        ours = row["prefill_s"] + row["score_s"]
        print(
            f"{row['tokens']:>8}   {row['prefill_s']:>12.2f} {row['score_s']:>7.2f}   {peer['prefill_s']:>16.2f} "
            f"{peer['kvzip_press_s']:>11.2f}   {peer['kvzip_press_s'] / ours:>10.2f}x"
        )


if __name__ == "__main__":
    main()
