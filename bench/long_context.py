"""Long context on this CPU: prefill and KVzip scoring of 8K-32K tokens in bounded memory and compile time.

    python bench/long_context.py [--tokens 8192 16384 32768] [--ratio 0.3] [--chunk 2048] [--allocator glibc]

Qwen2.5-Coder-0.5B-Instruct (float32, its maximum context is 32,768), one multi_needle context per length (four
planted "special magic number" facts in generated prose, the eval task), each length in a fresh process so its peak
memory is its own. Per length:
  - prefill wall time (its chunk program compiled once, included) and that compile alone (AOT, same shapes);
  - KVzip scoring (kvzip.score: the reread passes and the scores): compile time (AOT; the reread chunks run in
    lax.map, so it stays flat with the context) and execution time;
  - scoring's extra memory: peak resident set during the scoring call minus the resident set just before it,
    sampled every 2 ms (the scores it returns included), and its two parts apart: anonymous memory (what the run
    allocates: heap, XLA's buffers) and file-backed pages (mapped files paged in, such as the library's code);
    beside them the cache's bytes, XLA's temp allocation for the compiled program (memory_analysis) and the memory
    planner's estimate of scores + one chunk's workspace (memory_plan.plan);
  - the four facts asked of the full cache and of KVzip at --ratio (right answers out of 4).
--allocator returning runs the children with glibc told to return freed memory (see RETURNING; on the defaults,
memory the CPU runtime freed into per-thread arenas during the prefill can serve scoring, or not: see
studies/scoring_memory/scoring_memory.py).
Writes bench/results/long-context[-chunk<N>][-returning].txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK

ROOT = Path(__file__).resolve().parent.parent
# glibc told to give freed memory back to the system (one arena; large blocks mapped and unmapped; heap trimmed), so
# a call's peak is what the call needs, not what earlier work left in per-thread arenas: --allocator returning
RETURNING = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def resident() -> dict:
    """This process's resident bytes now (Linux /proc/self/status): total, anonymous (heap, XLA's buffers) and
    file-backed (pages of mapped files such as the jax library's code, shared with the page cache)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return {"total": fields["VmRSS"], "anon": fields["RssAnon"], "file": fields["RssFile"] + fields["RssShmem"]}


def peak_resident(run):
    """(run(), its seconds, resident() just before it, the peak of each resident() field during it, sampled every
    2 ms)."""
    before = resident()
    peak, done = dict(before), threading.Event()

    def sample():
        while not done.is_set():
            peak.update({k: max(v, peak[k]) for k, v in resident().items()})
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return result, seconds, before, peak


def measure(tokens: int, ratio: float, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvzip_jax import cache as kv
    from kvzip_jax import generate as gen
    from kvzip_jax import kvzip, memory_plan, prompts
    from kvzip_jax.eval import metrics, tasks
    from kvzip_jax.kvzip.scoring import evictable_layers, reread_inputs
    from kvzip_jax.weights import registry

    model = registry.load(registry.QWEN, dtype="float32")
    tok, cfg, params = model.tokenizer, model.cfg, model.params
    count = lambda text: len(tok.encode(text, add_special_tokens=False))
    example = tasks.generate("multi_needle", 1, seed=0, context_tokens=tokens - 256, count_tokens=count)[0]
    prompt, suffixes = prompts.split_for_reuse(
        tok, example.context, example.questions, instruction=prompts.named_instruction("kvzip")
    )
    ids = np.asarray(prompt.tokens, np.int32)
    capacity = gen.capacity_for(len(ids) + 128, cfg)
    out = dict(tokens=len(ids), context=prompt.context_end - prompt.context_start, capacity=capacity)

    empty = kv.init_cache(cfg, 1, capacity)
    width = min(chunk, gen.bucket(len(ids)))
    start = time.perf_counter()
    gen.forward_step.lower(params, jnp.zeros((1, width), jnp.int32), jnp.ones((1,), jnp.int32), empty, cfg).compile()
    out["prefill_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    _, cache = gen.prefill(params, cfg, [ids], empty, chunk=chunk)
    jax.block_until_ready(cache)
    out["prefill_s"] = time.perf_counter() - start
    out["cache_bytes"] = kv.nbytes(cache)

    reread = reread_inputs(tok, [prompt.context_start], [ids[prompt.context_start : prompt.context_end]], chunk)
    start = time.perf_counter()
    compiled = jax.jit(kvzip.score).lower(params, cfg, cache, reread).compile()
    out["score_compile_s"] = time.perf_counter() - start
    out["score_temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes  # XLA's own working set of the program
    jax.block_until_ready(cache)
    scores, out["score_s"], before, peak = peak_resident(
        lambda: jax.block_until_ready(compiled(params, cfg, cache, reread))
    )
    out["score_extra_bytes"] = peak["total"] - before["total"]  # the scores [L, 1, K, n] float32 included
    out["score_extra_anon_bytes"] = peak["anon"] - before["anon"]  # allocated memory (heap, XLA's buffers)
    out["score_extra_file_bytes"] = peak["file"] - before["file"]  # mapped files paged in (library code)
    keep = kvzip.keep_mask(scores, reread.context_len, ratio, "pair", evictable_layers(cfg))
    masked = jax.tree.map(jnp.copy, kv.mask_context(cache, keep, reread.prefix_len, reread.context_len))  # own K, V
    planned = memory_plan.plan(
        cfg, jnp.float32, out["context"] + prompt.context_start, 1, None, chunk, capacity=capacity
    )
    out["planned_workspace_bytes"] = planned.workspace + planned.scores
    del scores, keep

    stops = prompts.stop_token_ids(tok)
    right = {"full": 0, "kvzip": 0}
    for suffix, refs in zip(suffixes, example.answers):
        for name in right:
            answer, kept = gen.ask(
                params, cfg, cache if name == "full" else masked, suffix, example.max_new_tokens, stop_tokens=stops
            )
            if name == "full":
                cache = kept
            else:
                masked = kept
            right[name] += int(metrics.score(example.metric, tok.decode(answer, skip_special_tokens=True), refs) > 0)
    out.update(right_full=right["full"], right_kvzip=right["kvzip"], questions=len(suffixes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    parser.add_argument(
        "--allocator",
        choices=("glibc", "returning"),
        default="glibc",
        help="the children's malloc: glibc's defaults, or told to return freed memory (RETURNING)",
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one length, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.ratio, args.chunk)), flush=True)
        return
    rows = []
    for tokens in args.tokens:
        child = subprocess.run(
            [sys.executable, __file__, "--one", str(tokens), "--ratio", str(args.ratio), "--chunk", str(args.chunk)],
            capture_output=True,
            text=True,
            env={**os.environ, **(RETURNING if args.allocator == "returning" else {})},
        )
        if child.returncode:
            sys.exit(f"{tokens} tokens failed:\n{child.stderr[-3000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    MiB = 1 << 20
    lines = [
        f"Qwen2.5-Coder-0.5B-Instruct float32, this CPU, reread chunk {args.chunk}, KVzip at {args.ratio}, "
        f"allocator {args.allocator}",
        "| tokens | prefill s | prefill compile s | scoring s | scoring compile s | cache MiB | scoring extra MiB "
        "(% of cache) | of it anonymous / file-backed MiB | XLA temp MiB | planned MiB | "
        "facts right full / KVzip |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['prefill_s']:.0f} | {r['prefill_compile_s']:.1f} | {r['score_s']:.0f} | "
            f"{r['score_compile_s']:.1f} | {r['cache_bytes'] / MiB:.0f} | {r['score_extra_bytes'] / MiB:.0f} "
            f"({100 * r['score_extra_bytes'] / r['cache_bytes']:.1f}%) | "
            f"{r['score_extra_anon_bytes'] / MiB:.0f} ({100 * r['score_extra_anon_bytes'] / r['cache_bytes']:.1f}%)"
            f" / {r['score_extra_file_bytes'] / MiB:.0f} | {r['score_temp_bytes'] / MiB:.0f} | "
            f"{r['planned_workspace_bytes'] / MiB:.0f} | "
            f"{r['right_full']} / {r['right_kvzip']} of {r['questions']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    name = "long-context" + (f"-chunk{args.chunk}" if args.chunk != DEFAULT_CHUNK else "")
    name += "-returning.txt" if args.allocator == "returning" else ".txt"
    out = ROOT / "bench" / "results" / name
    out.write_text(text + "\n" + "\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
