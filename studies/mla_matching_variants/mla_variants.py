"""Attention Matching on an MLA cache: which fit pays for its bytes? (studies/mla_matching_variants/README.md)

One layer's latent cache is compacted to the same bytes four ways and each is judged on queries the fit never saw:

  evict       the kept tokens as they are (the bytes buy the most tokens)
  shared      one bias per kept token for all heads (NNLS over the heads' masses stacked): the library's AM on MLA
  per-head    one bias per kept token and query head (N NNLS fits): + 4 N bytes per token
  shared+lat  the shared bias and a refitted value latent per kept token (least squares over the heads' outputs
              stacked, in latent space): a second latent per token, + 2 R bytes (the first stays the key)
  per-head+lat  both

Bytes per kept token: bfloat16 latent and RoPE key 2 (R + dr), float32 biases. At a byte ratio rho of the full latent
cache, a variant keeps floor(rho n 2 (R + dr) / its bytes per token) tokens, chosen by HAK (RMS over every head's
attention) from the same reference queries (a repeat pass: a random prompt, then the context, on top of the cache).

Judged per layer and batch row on a pass of fresh random tokens: the heads' output error after W_UV (mean squared
error over the full cache's output variance) and the mean |log-mass error| of each head's attention over the context.

Einsum legend: N heads, M rows per head, T context tokens, S kept tokens, R latent width, v head value width.

    python studies/mla_matching_variants/mla_variants.py > studies/mla_matching_variants/results/variants.txt
"""

from __future__ import annotations

import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from kvzip_jax import generate as gen
from kvzip_jax import matching
from kvzip_jax.kvzip.scoring import RereadInputs
from kvzip_jax.matching.self_study import probes_from_rows
from kvzip_jax.models.mla import latent_keys, up_projections
from kvzip_jax.models.params import layer_name
from kvzip_jax.weights.hf import params_from_hf

SHAPE = dict(
    vocab_size=211,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=48,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    max_position_embeddings=1024,
    first_k_dense_replace=2,
    n_routed_experts=4,
)
SEEDS = (0, 1, 2)  # random models
ROWS, PREFIX, CONTEXT, PROMPT = 2, 4, 256, 16
FRESH = 4  # passes of 48 fresh tokens per row
RATIOS = (0.1, 0.2, 0.3)
FIT = jax.jit(matching.fit_head, static_argnames=("scale", "fit_values"))
VARIANTS = ("evict", "shared", "per-head", "shared+lat", "per-head+lat")


def model(seed: int, folder: pathlib.Path):
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE)).eval()
    with torch.no_grad():  # the tests' scale: peaked attention, as trained models have
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.15)
    hf.save_pretrained(folder)
    cfg, params = params_from_hf(folder)
    return cfg, jax.tree.map(jnp.asarray, params)


def queries(params, cfg, seed: int):
    """(cache, per layer: fit queries [B, N, M, R + dr] and fresh ones [B, N, M', R + dr]) on random rows."""
    rng = np.random.default_rng(100 + seed)
    rows = rng.integers(0, cfg.vocab_size, (ROWS, PREFIX + CONTEXT)).astype(np.int32)
    _, cache = gen.prefill(params, cfg, rows, capacity=PREFIX + CONTEXT + 64)
    prompt = rng.integers(0, cfg.vocab_size, (ROWS, PROMPT)).astype(np.int32)
    reread_tokens = np.concatenate([prompt, rows[:, PREFIX:]], axis=1)
    width = -(-reread_tokens.shape[1] // 64) * 64
    padded = np.zeros((1, ROWS, width), np.int32)
    padded[0, :, : reread_tokens.shape[1]] = reread_tokens
    full = lambda value: jnp.full((1, ROWS), value, jnp.int32)
    reread = RereadInputs(
        tokens=jnp.asarray(padded),
        num_valid=full(reread_tokens.shape[1]),
        chunk_start=full(PREFIX),
        chunk_len=full(CONTEXT),
        prefix_len=jnp.full((ROWS,), PREFIX, jnp.int32),
        context_len=jnp.full((ROWS,), CONTEXT, jnp.int32),
        chunk_size=width,
    )
    fresh_rows = [[rng.integers(0, cfg.vocab_size, 48).astype(np.int32) for _ in range(ROWS)] for _ in range(FRESH)]
    seen = matching.reference_queries(params, cfg, cache, reread)
    fresh = matching.reference_queries(params, cfg, cache, None, ("self-study",), probes=probes_from_rows(fresh_rows))
    N = cfg.num_heads

    def per_head(ref, i, b):  # rows g M + r are head g's (queries.stack_rows)
        q = np.asarray(ref.q[i][b, 0], np.float64)[np.asarray(ref.valid[b])]
        return q.reshape(N, -1, q.shape[-1])

    return cache, [[(per_head(seen, i, b), per_head(fresh, i, b)) for b in range(ROWS)] for i in range(cfg.num_layers)]


def softmax_parts(q, k, scale, bias=None):
    """(weights [N, M, T], lse [N, M]) of every head's queries q [N, M, W] over keys k [T, W] (+ bias [N, T])."""
    z = np.einsum("NMW,TW->NMT", q, k) * scale
    if bias is not None:
        z = z + bias[:, None, :]
    top = z.max(-1, keepdims=True)
    e = np.exp(z - top)
    return e / e.sum(-1, keepdims=True), (np.log(e.sum(-1, keepdims=True)) + top)[..., 0]


def nnls_bias(q, k, kept, scale) -> np.ndarray:
    """[S] log-weights of the kept keys that best match every given head's mass (the library's fit: box NNLS)."""
    q = jnp.asarray(q.reshape(-1, q.shape[-1]), jnp.float32)
    _, beta, _ = FIT(
        q, jnp.asarray(k, jnp.float32), jnp.asarray(k[:, :1], jnp.float32), jnp.asarray(kept), scale, fit_values=False
    )
    return np.asarray(beta, np.float64)


def fitted_latents(q, k, lat, kept, bias, scale) -> np.ndarray:
    """[S, R] value latents of the kept tokens by least squares over every head's latent output stacked."""
    target, _ = softmax_parts(q, k, scale)
    target = np.einsum("NMT,TR->NMR", target, lat).reshape(-1, lat.shape[1])
    weights, _ = softmax_parts(q, k[kept], scale, bias)
    weights = weights.reshape(-1, len(kept))
    start = lat[kept]  # the least-norm change from the kept latents (where the fit leaves a direction free)
    return start + np.linalg.lstsq(weights, target - weights @ start, rcond=None)[0]


def compact(variant, q, k, lat, count, scale):
    """(kept [S], bias [N, S], value latents [S, R]) of one variant at `count` tokens."""
    N = q.shape[0]
    kept = np.asarray(
        matching.highest_attention_keys(
            jnp.asarray(q.reshape(-1, q.shape[-1]), jnp.float32), jnp.asarray(k, jnp.float32), scale, count
        )
    )
    if variant == "evict":
        return kept, np.zeros((N, count)), lat[kept]
    if variant.startswith("shared"):
        bias = np.tile(nnls_bias(q, k, kept, scale), (N, 1))
    else:
        bias = np.stack([nnls_bias(q[g : g + 1], k, kept, scale) for g in range(N)])
    values = fitted_latents(q, k, lat, kept, bias, scale) if variant.endswith("+lat") else lat[kept]
    return kept, bias, values


def bytes_per_token(variant, N, R, dr) -> int:
    extra = {"evict": 0, "shared": 4, "per-head": 4 * N, "shared+lat": 4 + 2 * R, "per-head+lat": 4 * N + 2 * R}
    return 2 * (R + dr) + extra[variant]


def errors(q_new, k, lat, w_uv, kept, bias, values, scale):
    """(output error over the full output's variance, mean |log-mass error|) of every head on fresh queries."""
    weights, lse = softmax_parts(q_new, k, scale)
    want = np.einsum("NMT,TR,RNv->NMv", weights, lat, w_uv)
    weights_c, lse_c = softmax_parts(q_new, k[kept], scale, bias)
    got = np.einsum("NMS,SR,RNv->NMv", weights_c, values, w_uv)
    return float(((got - want) ** 2).mean() / want.var()), float(np.abs(lse_c - lse).mean())


def main():
    print(__doc__.split("\n\n")[0])
    table = {(v, r): [] for v in VARIANTS for r in RATIOS}
    for seed in SEEDS:
        with tempfile.TemporaryDirectory() as folder:
            cfg, params = model(seed, pathlib.Path(folder))
        m = cfg.mla
        R, dr, N = m.kv_lora_rank, m.qk_rope_head_dim, cfg.num_heads
        cache, per_layer = queries(params, cfg, seed)
        for i, layer in enumerate(cache.layers):
            tree = params.get("params", params)[layer_name(i)]
            w_uv = np.asarray(up_projections(lambda name: tree[name], cfg)[1], np.float64)  # [R, N, v]
            keys = np.asarray(latent_keys(layer.k, layer.v), np.float64)[:, 0, PREFIX : PREFIX + CONTEXT]
            lats = np.asarray(layer.v, np.float64)[:, 0, PREFIX : PREFIX + CONTEXT]
            for b, (q_fit, q_new) in enumerate(per_layer[i]):
                for ratio in RATIOS:
                    budget = ratio * CONTEXT * 2 * (R + dr)
                    for variant in VARIANTS:
                        count = int(budget // bytes_per_token(variant, N, R, dr))
                        kept, bias, values = compact(variant, q_fit, keys[b], lats[b], count, cfg.query_scale)
                        table[variant, ratio].append(
                            (count,) + errors(q_new, keys[b], lats[b], w_uv, kept, bias, values, cfg.query_scale)
                        )
    print(
        f"\n{len(SEEDS)} random models x {cfg.num_layers} layers x {ROWS} rows; {CONTEXT} context tokens; N = {N} "
        f"heads, R = {R}, dr = {dr}\n"
    )
    print("| bytes ratio | variant | tokens kept | output error (x evict) | log-mass error (x evict) |")
    print("|---:|---|---:|---:|---:|")
    for ratio in RATIOS:
        base = np.asarray(table["evict", ratio])
        for variant in VARIANTS:
            rows = np.asarray(table[variant, ratio])
            out, mass = rows[:, 1] / base[:, 1], rows[:, 2] / base[:, 2]
            print(
                f"| {ratio} | {variant} | {int(rows[0, 0])} | {np.exp(np.log(out).mean()):.3f} "
                f"[{out.min():.2f}, {out.max():.2f}] | {np.exp(np.log(mass).mean()):.3f} "
                f"[{mass.min():.2f}, {mass.max():.2f}] |"
            )
    print(
        "\nx evict: the geometric mean over models, layers and rows of the variant's error over eviction's at the "
        "same bytes [min, max]."
    )


if __name__ == "__main__":
    main()
