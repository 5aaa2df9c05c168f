"""KVzip scoring against a slow numpy oracle written straight from the definition, on tiny random models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import generate as gen
from kvzip_jax.kvzip import scoring as kvscore
from kvzip_jax.models.params import init_params
from tests.conftest import tiny_config


def numpy_queries_and_keys(params, cfg, tokens):
    """Per layer (q [T, N, H], k [T, K, H], v [T, K, H], normed attention input h [T, D]) post-RoPE, of one causal
    pass over tokens [T], in float64."""
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T, N, K, H = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w
    inv_freq = 1.0 / cfg.rope.theta ** (np.arange(0, H, 2) / H)
    angles = np.arange(T)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(x):  # [T, heads, H]
        a, b = x[..., : H // 2], x[..., H // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = P["embed"][tokens]
    out = []
    for i in range(cfg.num_layers):
        p = P[f"layers_{i}"]
        h = rms(x, p["attn_norm"])
        qkv = h @ p["qkv"] + (p["qkv_bias"] if cfg.qkv_bias else 0)
        q = rope(qkv[:, : N * H].reshape(T, N, H))
        k = rope(qkv[:, N * H : (N + K) * H].reshape(T, K, H))
        v = qkv[:, (N + K) * H :].reshape(T, K, H)
        out.append((q, k, v, h))
        kv_of = np.arange(N) // (N // K)
        logits = np.einsum("tnh,snh->nts", q, k[:, kv_of]) * H**-0.5
        logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("nts,snh->tnh", probs, v[:, kv_of]).reshape(T, N * H)
        x = x + attn @ p["o"]
        gate, up = np.split(rms(x, p["mlp_norm"]) @ p["gate_up"], 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["down"]
    return out


def oracle_scores(params, cfg, prefix, context, rereads, chunk_size, variant="softmax", kvzip_plus=False):
    """[L, K, n] scores from the definition: per chunk, one causal pass over [prefix | context | reread].
    variant "logits" takes the raw scaled logits instead of the softmax; kvzip_plus divides a row's weights by
    |h| of its query token and multiplies a key's by |W_O v| for the query head's slice of W_O."""
    n, G = len(context), cfg.group_size
    scores = np.full((cfg.num_layers, cfg.num_kv_heads, n), np.nan)
    for t, reread in enumerate(rereads):
        sequence = np.concatenate([prefix, context, reread])
        start = len(prefix) + t * chunk_size
        end = min(start + chunk_size, len(prefix) + n)
        base = len(prefix) + n  # first reread slot
        for layer, (q, k, v, h) in enumerate(numpy_queries_and_keys(params, cfg, sequence)):
            o_proj = np.asarray(params[f"layers_{layer}"]["o"], np.float64).reshape(cfg.num_heads, cfg.head_dim, -1)
            for kh in range(cfg.num_kv_heads):
                for g in range(G):
                    best = np.full(end - start, -np.inf)
                    for row in range(len(reread)):
                        keys = list(range(len(prefix))) + list(range(start, end)) + list(range(base, base + row + 1))
                        logits = k[keys, kh] @ q[base + row, kh * G + g] * cfg.head_dim**-0.5
                        probs = np.exp(logits - logits.max())
                        probs /= probs.sum()
                        stat = (probs if variant == "softmax" else logits)[len(prefix) : len(prefix) + end - start]
                        if kvzip_plus:
                            head = kh * G + g
                            value_norm = np.linalg.norm(v[start:end, kh] @ o_proj[head], axis=-1)  # [chunk]
                            stat = stat / np.linalg.norm(h[base + row]) * value_norm
                        best = np.maximum(best, stat)
                    current = scores[layer, kh, start - len(prefix) : end - len(prefix)]
                    scores[layer, kh, start - len(prefix) : end - len(prefix)] = np.fmax(current, best)
    return scores


def _inputs(cfg, prefix, context, chunk_size, seed=0):
    """Reread inputs with random 'prompt' tokens (the prompt text itself is tested in test_prompts)."""
    rng = np.random.default_rng(seed)
    chunks = [context[i : i + chunk_size] for i in range(0, len(context), chunk_size)]
    rereads = [
        np.concatenate([rng.integers(0, cfg.vocab_size, 5 + t), c]).astype(np.int32) for t, c in enumerate(chunks)
    ]
    width = max(map(len, rereads))
    tokens = np.zeros((len(chunks), 1, width), np.int32)
    for t, r in enumerate(rereads):
        tokens[t, 0, : len(r)] = r
    starts = len(prefix) + chunk_size * np.arange(len(chunks))[:, None]
    inputs = kvscore.RereadInputs(
        tokens=jnp.asarray(tokens),
        num_valid=jnp.asarray([[len(r)] for r in rereads], jnp.int32),
        chunk_start=jnp.asarray(starts, jnp.int32),
        chunk_len=jnp.asarray([[len(c)] for c in chunks], jnp.int32),
        prefix_len=jnp.asarray([len(prefix)], jnp.int32),
        context_len=jnp.asarray([len(context)], jnp.int32),
        chunk_size=chunk_size,
    )
    return inputs, rereads


@pytest.mark.parametrize(
    "num_kv_heads, qkv_bias, context_len, chunk_size",
    [
        (2, False, 23, 32),  # one chunk, GQA group 3
        (2, True, 45, 16),  # three chunks, the last one short, q/k/v biases
        (6, False, 30, 12),  # no GQA, three chunks
    ],
)
def test_scores_equal_the_numpy_oracle(num_kv_heads, qkv_bias, context_len, chunk_size):
    cfg = tiny_config(num_kv_heads, qkv_bias)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, cfg.vocab_size, 4).astype(np.int32)
    context = rng.integers(0, cfg.vocab_size, context_len).astype(np.int32)
    _, cache = gen.prefill(params, cfg, [np.concatenate([prefix, context])], capacity=64)
    inputs, rereads = _inputs(cfg, prefix, context, chunk_size)
    reported = []
    with kvscore.chunk_progress(lambda done, total: reported.append((done, total))):  # a progress bar's feed
        ours = np.asarray(jax.jit(kvscore.score)(params, cfg, cache, inputs))[:, 0, :, :context_len]  # [L, K, n]
    chunks = -(-context_len // chunk_size)
    assert sorted(reported) == [(t, chunks) for t in range(1, chunks + 1)]  # every chunk once, jitted
    expected = oracle_scores(params, cfg, prefix, context, rereads, chunk_size)
    assert expected.min() < 0.2 and expected.max() > 0.8  # the scores really separate pairs
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)
    assert np.all(np.isneginf(np.asarray(kvscore.score(params, cfg, cache, inputs))[:, 0, :, context_len:]))


@pytest.mark.parametrize(
    "variant, kvzip_plus, chunk_size",
    [("logits", False, 32), ("logits", False, 16), ("softmax", True, 32), ("softmax", True, 16)],
)
def test_variants_equal_the_numpy_oracle(variant, kvzip_plus, chunk_size):
    """The softmax-free variant and KVzip+, with one chunk (the forward's normaliser reused) and with three."""
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, cfg.vocab_size, 4).astype(np.int32)
    context = rng.integers(0, cfg.vocab_size, 30).astype(np.int32)
    _, cache = gen.prefill(params, cfg, [np.concatenate([prefix, context])], capacity=64)
    inputs, rereads = _inputs(cfg, prefix, context, chunk_size)
    ours = np.asarray(jax.jit(kvscore.score, static_argnums=(4, 5))(params, cfg, cache, inputs, variant, kvzip_plus))
    expected = oracle_scores(params, cfg, prefix, context, rereads, chunk_size, variant, kvzip_plus)
    np.testing.assert_allclose(ours[:, 0, :, :30], expected, atol=1e-5, rtol=1e-5)


def test_scoring_a_cache_that_still_holds_a_question_is_a_named_error():
    """One-chunk scoring normalises over everything the cache holds: a question left in it would change the scores,
    so it is refused, eagerly and under jit, and accepted again once rewound."""
    from kvzip_jax import cache as kv
    from kvzip_jax import kvzip

    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(5)
    prefix, context = rng.integers(0, cfg.vocab_size, 4), rng.integers(0, cfg.vocab_size, 23)
    _, cache = gen.prefill(params, cfg, [np.concatenate([prefix, context])], capacity=64)
    inputs, _ = _inputs(cfg, prefix, context, 32)
    clean = kv.mark(cache)
    _, cache = gen.prefill(params, cfg, [rng.integers(0, cfg.vocab_size, 6)], cache)  # a question appended
    with pytest.raises(kvzip.CacheLayoutError, match="row 0 of the cache holds 33 tokens"):
        kvzip.score(params, cfg, cache, inputs)
    with pytest.raises(Exception, match="CacheLayoutError"):
        jax.block_until_ready(jax.jit(kvzip.score_and_evict)(params, cfg, cache, inputs, 0.3))
    scores = jax.jit(kvzip.score)(params, cfg, kv.rewind(cache, clean), inputs)
    assert np.isfinite(np.asarray(scores)[:, 0, :, :23]).all()
