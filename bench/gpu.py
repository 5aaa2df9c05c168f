"""The one prepared device script: KVzip at the paper's scale on one GPU, impl=xla and impl=pallas side by side.

    python bench/gpu.py            # on the GPU machine (fits one call of <= 8 minutes on one H200)
    python bench/gpu.py --smoke    # the same code at tiny sizes on CPU (Pallas in interpret mode): CI's check

    python bench/gpu.py --models qwen2.5-coder-1.5b-instruct --cases none   # real weights only

Random weights at real configurations (weights do not travel to the device; the configs are written below):
LLaMA-3.1-8B in bfloat16 at 32K and 124K context tokens, batch 1; SmolLM2-135M and Qwen2.5-0.5B at 4K and 32K,
batch 8. --models adds registry models by name or path with their real weights in bfloat16 (where their packages or
checkpoints are on the machine), batch --model-batch at --model-contexts tokens. For each case and each impl:
  - prefill time and model FLOP utilisation (models/flops.py FLOPs / time / the device's peak), at the context of
    --prefill-tokens at most (stated per row);
  - KVzip scoring time / prefill time, and scoring's extra device memory (the compiled scoring program's temporary
    and output bytes) against the cache's bytes;
  - decode ms per token for the full, masked-0.3 and ragged-0.3 caches, and the ragged one with its kept pairs in
    int8 and int4 (groups of 64 and 16, bf16 scales; KVzip + quantization): attention alone (every layer's attention
    over its cache, one jitted call) and the whole step (forward_step, cache donated); decode caches are synthetic
    (random keys and values, kept sets drawn per head as KVzip's uneven head budgets are), so 124K decode does not
    wait on a 124K prefill;
  - the decode step's achieved HBM bandwidth: bytes it must read (params + visible K/V pairs) / time, against the
    device's peak.
Every figure is measured in this run; nothing is copied from elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kv_bits, kvzip
from kvzip_jax.config import MLASpec, ModelConfig, RopeSpec, mla_query_scale
from kvzip_jax.errors import ModelFileError
from kvzip_jax.kvzip.scoring import RereadInputs, evictable_layers
from kvzip_jax.models import attention, ragged_attention
from kvzip_jax.models.flops import kvzip_scoring_flops, prefill_flops
from kvzip_jax.models.params import param_shapes
from kvzip_jax.quant.groups import Quantized, kv_formats
from kvzip_jax.weights import registry
from pallas_kernels import QuantizedRows, decode_attention, ragged_decode

# Real configurations (HF config.json values).
LLAMA_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    max_position=131072,
    rope=RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
    tie_embeddings=False,
)
SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rms_norm_eps=1e-5,
    max_position=32768,
    rope=RopeSpec(100000.0),
)
QWEN_05B = ModelConfig(
    architecture="qwen2",
    vocab_size=151936,
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=4864,
    rms_norm_eps=1e-6,
    max_position=32768,
    rope=RopeSpec(1000000.0),
    qkv_bias=True,
)
# DeepSeek-V2-Lite's attention (MLA: 16 heads, latent 512, RoPE key 64, nope 128, value 128, no query
# down-projection, its YaRN RoPE and softmax temperature) and dense MLP width (random weights).
V2_LITE_YARN = dict(
    type="yarn",
    factor=40,
    original_max_position_embeddings=4096,
    mscale=0.707,
    mscale_all_dim=0.707,
    beta_fast=32,
    beta_slow=1,
)
V2_LITE_ROPE = RopeSpec.from_hf(V2_LITE_YARN, 10000.0)
V2_LITE_MLA = MLASpec(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V2_LITE = ModelConfig(
    architecture="deepseek",
    vocab_size=102400,
    hidden_size=2048,
    num_layers=27,
    num_heads=16,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=10944,
    rms_norm_eps=1e-6,
    max_position=163840,
    rope=V2_LITE_ROPE,
    tie_embeddings=False,
    mla=V2_LITE_MLA,
    query_scale=mla_query_scale(V2_LITE_MLA, V2_LITE_ROPE, V2_LITE_YARN),
)
# (name, config, batch, context tokens) of random-weight cases, most important first; 124K = 126,976 tokens, the
# paper's LLaMA3.1-8B setting.
CASES = [
    ("llama3.1-8b", LLAMA_8B, 1, (126976, 32768)),
    ("smollm2-135m", SMOLLM2, 8, (4096, 32768)),
    ("qwen2.5-0.5b", QWEN_05B, 8, (4096, 32768)),
    ("deepseek-v2-lite-mla", DEEPSEEK_V2_LITE, 4, (32768,)),
]
SMOKE = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    rms_norm_eps=1e-5,
    max_position=4096,
    rope=RopeSpec(10000.0),
)
SMOKE_MLA = dataclasses.replace(
    SMOKE,
    architecture="deepseek",
    num_kv_heads=1,
    head_dim=16,
    query_scale=48**-0.5,
    mla=MLASpec(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=16),
)
SMOKE_CASES = [("smoke", SMOKE, 2, (192,)), ("smoke-mla", SMOKE_MLA, 2, (192,))]
PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}  # HBM B/s, dense bf16 FLOP/s
RATIO = 0.3
KV_BITS = (8, 4, "8/4")  # the ragged cache's kept pairs quantized (default groups: 64 for int8, 16 for int4; bf16
# scales; "8/4": int8 keys beside int4 values)
REREAD_PROMPT = 16  # tokens of the reread prompt before each chunk (KVzip's is about this long)


def device_peaks() -> tuple[str, float | None, float | None]:
    kind = jax.devices()[0].device_kind
    for name, (bandwidth, flops) in PEAKS.items():
        if name in kind:
            return kind, bandwidth, flops
    return kind, None, None


def random_params(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """Random params drawn on the device in `dtype` (an 8B model never passes through host memory)."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    ]
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [
        jnp.ones(s, dtype) if "norm" in path else (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
        for path, s, k in zip(paths, leaves, keys)
    ]
    return jax.tree.unflatten(treedef, drawn)


def random_case(name: str, cfg: ModelConfig, batch: int, contexts: tuple[int, ...], dtype) -> tuple:
    """(name, batch, contexts, load): load() gives (config, random params in dtype)."""
    return name, batch, contexts, lambda: (cfg, random_params(cfg, dtype))


def model_case(name: str, batch: int, contexts: tuple[int, ...], dtype) -> tuple:
    """A registry model (a bundled name or a path) with its real weights, loaded in dtype when its case starts; a
    name that is neither fails at once, before any case spends device time."""
    if name not in registry.BUNDLED and not Path(name).exists():
        raise ModelFileError(f"--models {name!r}: neither a bundled model nor a path ({', '.join(registry.BUNDLED)})")

    def load():
        model = registry.load(name, dtype=dtype)
        return model.cfg, model.params

    return name, batch, contexts, load


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of fn() (which returns arrays) over `repeats`, after one warm-up call."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def synthetic_cache(cfg: ModelConfig, batch: int, tokens: int, dtype, seed: int = 0) -> kv.KVCache:
    """A dense cache holding `tokens` random keys/values per head, with room for decode steps."""
    capacity = gen.capacity_for(tokens + 64, cfg)
    shape = lambda width: (batch, cfg.num_kv_heads, capacity, width)
    k_width, v_width = cfg.cache_widths()  # an MLA cache: the RoPE key and the latent
    key = jax.random.key(seed)
    layers = []
    for i in range(cfg.num_layers):
        kk, kv_ = jax.random.split(jax.random.fold_in(key, i))
        layers.append(
            kv.LayerCache(
                k=jax.random.normal(kk, shape(k_width), jnp.float32).astype(dtype),
                v=jax.random.normal(kv_, shape(v_width), jnp.float32).astype(dtype),
                lengths=jnp.full((batch, cfg.num_kv_heads), tokens, jnp.int32),
            )
        )
    return kv.KVCache(layers=tuple(layers), next_position=jnp.full((batch,), tokens, jnp.int32))


def compressed(cfg: ModelConfig, cache: kv.KVCache, tokens: int, seed: int = 1):
    """(masked, ragged) at RATIO from KVzip-like scores: a per-head level times per-pair noise, so heads keep
    uneven shares (as KVzip's do) and the prefix (first 4 slots) is never evicted."""
    rng = np.random.default_rng(seed)
    L, B, K, n = cfg.num_layers, cache.batch_size, cfg.num_kv_heads, tokens - 4
    scores = rng.random((L, B, K, 1), np.float32) ** 3 * rng.random((L, B, K, n), np.float32)
    keep = kvzip.keep_mask(jnp.asarray(scores), jnp.full((B,), n, jnp.int32), RATIO)
    masked = kv.mask_context(cache, keep, jnp.full((B,), 4, jnp.int32), jnp.full((B,), n, jnp.int32))
    return masked, kv.pack(masked, room=64)


def attention_alone(cfg: ModelConfig, cache: kv.KVCache, impl: str, repeats: int = 3) -> float:
    """Seconds of one decode step's attention over every layer's cache (no projections, no MLP), best of `repeats`.
    MLA: the absorbed form (queries as wide as [latent | RoPE key]) through the XLA paths under either impl (no MLA
    kernel yet)."""
    B, K, G, H = cache.batch_size, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    latent = cfg.mla is not None
    if latent:
        H, impl = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim, "xla"
    first = cache.layers[0]
    dtype = (first.window if isinstance(first, kv.QuantizedLayerCache) else first).k.dtype  # the model's dtype
    q = jax.random.normal(jax.random.key(3), (B, 1, K, G, H), jnp.float32).astype(dtype)

    @jax.jit
    def run(q, cache):
        total = jnp.zeros((), jnp.float32)
        for layer in cache.layers:
            if isinstance(layer, kv.QuantizedLayerCache):  # its store (the window is empty here)
                layer = layer.store
            if impl == "pallas":
                rows = q.reshape(B, K, G, H)
                if isinstance(layer, kv.RaggedLayerCache):
                    k, v = layer.k, layer.v
                    if isinstance(k, Quantized):
                        k, v = (QuantizedRows(x.codes, x.scale, x.zero) for x in (k, v))
                    out, _ = ragged_decode(
                        rows, k, v, layer.offsets, layer.lengths, scale=cfg.query_scale, impl="pallas"
                    )
                else:
                    out, _ = decode_attention(
                        rows, layer.k, layer.v, layer.lengths, layer.keep, scale=cfg.query_scale, impl="pallas"
                    )
            else:
                slots = layer.lengths[:, :, None] - 1  # [B, K, 1] the query sits at the last filled slot
                if isinstance(layer, kv.RaggedLayerCache):
                    out, _, _ = ragged_attention.ragged_attention(
                        q,
                        layer.k,
                        layer.v,
                        layer.offsets,
                        layer.lengths,
                        None,
                        None,
                        slots,
                        None,
                        cfg.query_scale,
                        layer.block,
                        latent_keys=latent,
                    )
                else:
                    out, _, _ = attention.blocked_attention(
                        q,
                        layer.k,
                        layer.v,
                        layer.lengths,
                        None,
                        None,
                        slots,
                        None,
                        cfg.query_scale,
                        layer.keep,
                        latent_keys=latent,
                    )
            total = total + out.astype(jnp.float32).sum()
        return total

    return timed(lambda: run(q, cache), repeats)


def decode_step(params, cfg: ModelConfig, cache: kv.KVCache, steps: int) -> float:
    """Seconds per token of forward_step on `cache` (donated and threaded through `steps` tokens)."""
    B = cache.batch_size
    token, one = jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32)
    cache = gen.on_params_device(jax.tree.map(jnp.copy, cache), params)  # else the second step compiles again
    _, cache = gen.forward_step(params, token, one, cache, cfg)  # compile
    jax.block_until_ready(cache)
    start = time.perf_counter()
    for _ in range(steps):
        logits, cache = gen.forward_step(params, token, one, cache, cfg)
    jax.block_until_ready(logits)
    return (time.perf_counter() - start) / steps


def step_bytes(params, cache: kv.KVCache) -> int:
    """Bytes a decode step must read: every parameter once and the visible K/V pairs."""
    return sum(x.nbytes for x in jax.tree.leaves(params)) + kv.used_bytes(cache)


def reread_inputs(cfg: ModelConfig, batch: int, tokens: int, chunk: int, seed: int = 2) -> RereadInputs:
    """Random reread inputs for rows holding [4 prefix | tokens - 4 context] (tokens as KVzip's would be laid out)."""
    rng = np.random.default_rng(seed)
    n = tokens - 4
    num_chunks = -(-n // chunk)
    width = -(-(REREAD_PROMPT + min(chunk, n)) // 64) * 64
    lengths = np.clip(n - chunk * np.arange(num_chunks), 0, chunk)  # [C]
    return RereadInputs(
        tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (num_chunks, batch, width)), jnp.int32),
        num_valid=jnp.asarray(np.broadcast_to((REREAD_PROMPT + lengths)[:, None], (num_chunks, batch)), jnp.int32),
        chunk_start=jnp.asarray(
            np.broadcast_to((4 + chunk * np.arange(num_chunks))[:, None], (num_chunks, batch)), jnp.int32
        ),
        chunk_len=jnp.asarray(np.broadcast_to(lengths[:, None], (num_chunks, batch)), jnp.int32),
        prefix_len=jnp.full((batch,), 4, jnp.int32),
        context_len=jnp.full((batch,), n, jnp.int32),
        chunk_size=min(chunk, -(-n // 64) * 64),
    )


def prefill_and_score(params, cfg: ModelConfig, batch: int, tokens: int, chunk: int, peak_flops) -> dict:
    """Prefill time and MFU; KVzip scoring time, its ratio to prefill, and its extra device memory."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (batch, tokens)).astype(np.int32)
    capacity = gen.capacity_for(tokens + 64, cfg)
    dtype = params["embed"].dtype
    run_prefill = lambda: gen.prefill(params, cfg, ids, kv.init_cache(cfg, batch, capacity, dtype))
    prefill_s = timed(run_prefill, repeats=1)
    _, cache = run_prefill()
    reread = reread_inputs(cfg, batch, tokens, chunk)
    score = jax.jit(kvzip.score)
    compiled = score.lower(params, cfg, cache, reread).compile()
    memory = compiled.memory_analysis()
    extra = None if memory is None else memory.temp_size_in_bytes + memory.output_size_in_bytes
    score_s = timed(lambda: compiled(params, cfg, cache, reread), repeats=1)
    flops = batch * prefill_flops(cfg, tokens)
    score_flops = batch * kvzip_scoring_flops(
        cfg,
        tokens,
        [int(w) for w in reread.num_valid[:, 0]],
        [int(c) for c in reread.chunk_len[:, 0]],
        len(evictable_layers(cfg)),
    )
    mfu = None if not peak_flops else flops / prefill_s / peak_flops
    return dict(
        prefill_tokens=tokens,
        prefill_s=prefill_s,
        mfu=mfu,
        score_s=score_s,
        score_flop_ratio=score_flops / flops,
        score_extra_bytes=extra,
        cache_bytes=kv.used_bytes(cache),
    )


def decode_figures(params, cfg: ModelConfig, caches: dict, steps: int, peak_bw, repeats: int = 3) -> None:
    """Prints decode attention (best of `repeats`) and step times of the caches {form: cache} (full, masked, ragged,
    and the ragged one with int8 / int4 kept pairs), with the step's bandwidth."""
    impl, started, attention_s = cfg.attention_impl, time.perf_counter(), {}
    for form, cache in caches.items():
        attention_s[form] = attention_alone(cfg, cache, impl, repeats)
        step_s = decode_step(params, cfg, cache, steps)
        bw = step_bytes(params, cache) / step_s
        share = "" if not peak_bw else f" = {bw / peak_bw:.0%} of peak"
        print(
            f"[{impl}] decode {form:>11}: attention {attention_s[form] * 1e3:8.3f} ms, step {step_s * 1e3:8.3f} "
            f"ms/token, {bw / 1e9:7.1f} GB/s{share}; KV {kv.used_bytes(cache) / 2**20:,.1f} MiB visible, "
            f"{kv.nbytes(cache) / 2**20:,.1f} MiB allocated",
            flush=True,
        )
    print(
        f"[{impl}] attention speed-up at {RATIO} over the full cache: "
        + ", ".join(f"{form} {attention_s['full'] / attention_s[form]:.2f}x" for form in caches if form != "full")
        + f" ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )


def prefill_figures(params, cfg: ModelConfig, batch: int, tokens: int, chunk: int, peak_flops) -> None:
    """Prints prefill time and MFU, scoring time over prefill time and scoring's extra device memory."""
    p = prefill_and_score(params, cfg, batch, tokens, chunk, peak_flops)
    mfu = "" if p["mfu"] is None else f", MFU {p['mfu']:.1%}"
    extra, cache_bytes = p["score_extra_bytes"], p["cache_bytes"]
    extra = "n/a" if extra is None else f"{extra / 2**20:.1f} MiB = {extra / cache_bytes:.1%} of the cache"
    print(
        f"[{cfg.attention_impl}] prefill {p['prefill_s']:.3f} s{mfu}; KVzip scoring {p['score_s']:.3f} s = "
        f"{p['score_s'] / p['prefill_s']:.2f}x prefill (FLOP ratio {p['score_flop_ratio']:.2f}); scoring's extra "
        f"device memory {extra}",
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (Pallas in interpret mode)")
    parser.add_argument("--cases", help="comma-separated random-weight case names (default: all; none: none)")
    parser.add_argument("--models", help="comma-separated registry models (names or paths) run with real weights")
    parser.add_argument("--model-batch", type=int, default=8, help="batch of the --models cases")
    parser.add_argument("--model-contexts", default="4096,32768", help="context tokens of the --models cases")
    parser.add_argument("--prefill-tokens", type=int, default=32768, help="longest context prefilled and scored")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=kvzip.scoring.DEFAULT_CHUNK)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420,
        help="wall seconds: later rows are skipped past it, "
        "prefill and scoring past half of it (decode figures come first)",
    )
    parser.add_argument(
        "--repeats", type=int, help="timed calls per attention figure, best kept (default 3; 1 with --smoke)"
    )
    args = parser.parse_args(argv)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases.split(",")]
    cases = [random_case(*case, dtype) for case in cases]
    contexts = tuple(int(t) for t in args.model_contexts.split(","))
    cases += [model_case(name, args.model_batch, contexts, dtype) for name in (args.models or "").split(",") if name]
    chunk = 64 if args.smoke else args.chunk_size
    repeats = args.repeats or (1 if args.smoke else 3)  # the smoke run checks the script, not the times
    kind, peak_bw, peak_flops = device_peaks()
    print(
        f"device {kind} ({jax.default_backend()}), jax {jax.__version__}; params and caches {jnp.dtype(dtype).name}; "
        f"ratio {RATIO}; peaks: HBM {peak_bw and peak_bw / 1e12} TB/s, bf16 {peak_flops and peak_flops / 1e12} "
        "TFLOP/s"
    )
    clock = time.perf_counter()
    for name, batch, contexts, load in cases:
        base, params = load()
        for tokens in contexts:
            print(f"\n== {name}, batch {batch}, {tokens:,} context tokens ==", flush=True)
            if time.perf_counter() - clock > args.budget_s:
                print(f"skipped: past the {args.budget_s:.0f} s budget")
                continue
            if tokens + args.decode_steps > base.max_position:
                print(f"skipped: past the model's maximum context of {base.max_position:,} tokens")
                continue
            full = synthetic_cache(base, batch, tokens, dtype)
            masked, ragged = compressed(base, full, tokens)
            caches = {"full": full, "masked": masked, "ragged": ragged}
            for bits in KV_BITS:  # KVzip + quantization: the ragged cache's kept pairs in int8 / int4 / k8v4
                keys, values = kv_formats(bits)
                label = kv_bits.label(bits)
                caches[f"ragged-{label}"] = kv.quantized(ragged, keys, value_fmt=values)
            for impl in ("xla", "pallas"):
                if impl == "pallas" and base.mla is not None:  # its decode would compile the [xla] rows again
                    print("[pallas] decode: no Pallas kernel for MLA's latent attention; the [xla] rows stand for it")
                    continue
                decode_figures(
                    params, dataclasses.replace(base, attention_impl=impl), caches, args.decode_steps, peak_bw, repeats
                )
            del full, masked, ragged, caches
            for impl in ("xla", "pallas"):
                cfg = dataclasses.replace(base, attention_impl=impl)
                if tokens > args.prefill_tokens:
                    print(
                        f"[{impl}] prefill and scoring not run at {tokens:,} tokens (--prefill-tokens "
                        f"{args.prefill_tokens:,}); decode above used a synthetic cache"
                    )
                elif time.perf_counter() - clock > args.budget_s / 2:
                    print(f"[{impl}] prefill and scoring skipped: past half the {args.budget_s:.0f} s budget")
                else:
                    prefill_figures(params, cfg, batch, tokens, chunk, peak_flops)
        del params
    print(f"\nwall time {time.perf_counter() - clock:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
