"""Masked and ragged compressed caches: ratio 1.0 is the full cache, ragged decoding equals masked decoding,
and a head that keeps nothing gives no NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.models.params import init_params
from tests.conftest import tiny_config

PREFIX, CONTEXT = 4, 36
CFG = tiny_config(2)
PARAMS = init_params(CFG, seed=1, scale=0.15)
RNG = np.random.default_rng(0)
SEQUENCE = RNG.integers(0, CFG.vocab_size, PREFIX + CONTEXT).astype(np.int32)
QUESTION = RNG.integers(0, CFG.vocab_size, 6).astype(np.int32)
SCORES = jnp.asarray(RNG.random((CFG.num_layers, 1, CFG.num_kv_heads, CONTEXT)), jnp.float32)


def _context_cache():
    return gen.prefill(PARAMS, CFG, [SEQUENCE], capacity=64)[1]


def _masked(keep):
    return kv.mask_context(_context_cache(), keep, jnp.array([PREFIX]), jnp.array([CONTEXT]))


def test_ratio_one_equals_the_uncompressed_cache():
    keep = keep_mask(SCORES, jnp.array([CONTEXT]), 1.0)
    full, _ = gen.prefill(PARAMS, CFG, [QUESTION], _context_cache())
    masked, _ = gen.prefill(PARAMS, CFG, [QUESTION], _masked(keep))
    ragged, _ = gen.prefill(PARAMS, CFG, [QUESTION], kv.pack(_masked(keep), 64))
    np.testing.assert_array_equal(np.asarray(masked), np.asarray(full))
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(full), atol=1e-5, rtol=0)


@pytest.mark.parametrize("level", ["pair", "pair-uniform", "layer"])
def test_ragged_decoding_equals_masked_decoding(level):
    keep = keep_mask(SCORES, jnp.array([CONTEXT]), 0.3, level)
    masked = _masked(keep)
    most_kept = int(kv.kept_per_head(masked).max())
    assert most_kept < PREFIX + CONTEXT
    ragged = kv.pack(masked, 8)
    assert kv.nbytes(ragged) < kv.nbytes(masked) / 2
    assert np.array_equal(np.asarray(kv.kept_per_head(ragged)), np.asarray(kv.kept_per_head(masked)))
    answer_alike(ragged, masked, 8, atol=1e-4)


def answer_alike(cache, reference, steps: int, atol: float):
    """QUESTION's prefill logits over cache within atol of reference's, and the same `steps` greedy tokens after it.
    Both caches are donated; returns cache after the answer."""
    logits, cache = gen.prefill(PARAMS, CFG, [QUESTION], cache)
    logits_ref, reference = gen.prefill(PARAMS, CFG, [QUESTION], reference)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), atol=atol, rtol=0)
    tokens, cache = gen.decode(PARAMS, CFG, logits, cache, steps)
    tokens_ref, _ = gen.decode(PARAMS, CFG, logits_ref, reference, steps)
    assert tokens == tokens_ref
    return cache


def test_ragged_store_holds_each_heads_kept_pairs_plus_room_in_whole_blocks():
    scores = np.asarray(SCORES).copy()
    scores[0, :, 0] += 1.0  # layer 0, head 0 wins most of the global budget: very uneven heads
    masked = _masked(keep_mask(jnp.asarray(scores), jnp.array([CONTEXT]), 0.3, "pair"))
    room = len(QUESTION) + 4  # the question, then four decoded tokens
    ragged = kv.pack(masked, room, multiple=kv.RAGGED_BLOCK)
    kept = np.asarray(kv.kept_per_head(masked))  # [L, B, K]
    block = kv.RAGGED_BLOCK
    for layer, kept_l in zip(ragged.layers, kept):
        segments = -(-(kept_l + room) // block) * block  # [B, K]
        assert layer.k.shape[1] == segments.sum()  # no head is padded to the most-kept head
        np.testing.assert_array_equal(np.asarray(layer.head_capacity()), segments)
        np.testing.assert_array_equal(np.asarray(layer.lengths), kept_l)
    assert kv.used_bytes(ragged) == kv.used_bytes(masked)
    logits_m, masked = gen.prefill(PARAMS, CFG, [QUESTION], jax.tree.map(jnp.array, masked))
    logits_r, ragged = gen.prefill(PARAMS, CFG, [QUESTION], ragged)
    np.testing.assert_allclose(np.asarray(logits_r), np.asarray(logits_m), atol=1e-4, rtol=0)
    assert int(ragged.room().min()) >= 0
    out_m, _ = gen.decode(PARAMS, CFG, logits_m, masked, 4)
    out_r, _ = gen.decode(PARAMS, CFG, logits_r, ragged, 4)
    assert out_m == out_r


def test_ragged_cache_with_no_room_refuses_new_tokens():
    from kvzip_jax.errors import ContextTooLongError

    ragged = kv.pack(_masked(keep_mask(SCORES, jnp.array([CONTEXT]), 0.3)), 0, multiple=kv.RAGGED_BLOCK)
    room = int(ragged.room().min())  # only what rounding each head up to whole blocks left over
    assert 0 <= room < kv.RAGGED_BLOCK
    with pytest.raises(ContextTooLongError):
        gen.prefill(PARAMS, CFG, [np.zeros(room + 1, np.int32)], ragged)


def test_a_head_that_keeps_nothing_gives_no_nan():
    keep = np.ones((CFG.num_layers, 1, CFG.num_kv_heads, CONTEXT), bool)
    keep[0, 0, 1] = False  # layer 0, KV head 1 keeps no context pair
    masked = _masked(jnp.asarray(keep))
    no_prefix = kv.mask_context(
        _context_cache(), jnp.zeros_like(jnp.asarray(keep)), jnp.array([0]), jnp.array([PREFIX + CONTEXT])
    )
    for cache in (masked, kv.pack(masked, 48), no_prefix, kv.pack(no_prefix, 48)):
        logits, _ = gen.prefill(PARAMS, CFG, [QUESTION], jax.tree.map(jnp.array, cache))
        assert np.isfinite(np.asarray(logits)).all()


def test_score_and_evict_jits_as_written_and_a_new_ratio_does_not_recompile():
    from kvzip_jax import kvzip
    from tests.test_kvzip_score import _inputs

    reread, _ = _inputs(CFG, SEQUENCE[:PREFIX], SEQUENCE[PREFIX:], 16)
    compress = jax.jit(kvzip.score_and_evict)
    masked, scores = compress(PARAMS, CFG, _context_cache(), reread, 0.3)
    eager_masked, eager_scores = kvzip.score_and_evict(PARAMS, CFG, _context_cache(), reread, 0.3)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(eager_scores), atol=1e-6)
    for a, b in zip(masked.layers, eager_masked.layers):
        np.testing.assert_array_equal(np.asarray(a.keep), np.asarray(b.keep))
    kept = int(kv.kept_per_head(masked).sum()) - CFG.num_layers * CFG.num_kv_heads * PREFIX
    assert kept == int(0.3 * CFG.num_layers * CFG.num_kv_heads * CONTEXT)
    compiled = compress._cache_size()
    compress(PARAMS, CFG, _context_cache(), reread, 0.5)
    assert compress._cache_size() == compiled


def test_gemma_sliding_layers_keep_their_context_and_global_layers_are_evicted():
    from kvzip_jax import kvzip
    from tests.test_kvzip_score import _inputs

    cfg = ModelConfig(
        architecture="gemma3",
        vocab_size=101,
        hidden_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeSpec(10000.0),
        rope_sliding=RopeSpec(100.0),
        layer_types=("sliding", "full", "sliding"),
        sliding_window=8,
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=48**0.5,
    )
    params = init_params(cfg, seed=2, scale=0.15)
    reread, _ = _inputs(cfg, SEQUENCE[:PREFIX], SEQUENCE[PREFIX:], 16)
    _, cache = gen.prefill(params, cfg, [SEQUENCE], capacity=64)
    masked, scores = jax.jit(kvzip.score_and_evict)(params, cfg, cache, reread, 0.3)
    assert not np.asarray(scores[0, :, :, :CONTEXT]).any() and np.asarray(scores[1, :, :, :CONTEXT]).all()
    kept = np.asarray(kv.kept_per_head(masked))[:, 0, 0]  # [L]
    assert kept.tolist() == [PREFIX + CONTEXT, PREFIX + int(0.3 * CONTEXT), PREFIX + CONTEXT]
    logits_m, _ = gen.prefill(params, cfg, [QUESTION], jax.tree.map(jnp.array, masked))
    logits_r, _ = gen.prefill(params, cfg, [QUESTION], kv.pack(masked, 64))
    np.testing.assert_allclose(np.asarray(logits_r), np.asarray(logits_m), atol=1e-4, rtol=0)


@pytest.mark.parametrize("form", ["masked", "ragged"])
def test_compressed_cache_serves_questions_independently_without_recompiling(form):
    """Question 2's answer is the same whether or not question 1 was asked first; a second question of the same
    shape compiles nothing new; a mark can be rewound to more than once."""
    masked = _masked(keep_mask(SCORES, jnp.array([CONTEXT]), 0.3))
    fresh = lambda: jax.tree.map(jnp.array, kv.pack(masked, 16) if form == "ragged" else masked)
    q1, q2 = QUESTION, QUESTION[::-1].copy()
    alone, _ = gen.ask(PARAMS, CFG, fresh(), q2, 6)
    cache = fresh()
    first, cache = gen.ask(PARAMS, CFG, cache, q1, 6)
    compiled = (gen.forward_step._cache_size(), gen._decode_loop._cache_size())
    second, cache = gen.ask(PARAMS, CFG, cache, q2, 6)
    assert second == alone
    assert (gen.forward_step._cache_size(), gen._decode_loop._cache_size()) == compiled

    before = kv.mark(cache)
    for _ in range(2):
        again, cache = gen.ask(PARAMS, CFG, kv.rewind(cache, before), q2, 6)
        assert again == alone


@pytest.mark.parametrize("form", ["full", "masked", "ragged"])
def test_compiled_decode_and_append_copy_no_cache_array(form):
    """XLA updates a donated cache in place: the compiled decode loop and append step hold no copy of a K/V array
    (reading the old cache while writing a new one made every step copy every layer's K and V)."""
    masked = _masked(keep_mask(SCORES, jnp.array([CONTEXT]), 0.3))
    cache = {"full": _context_cache(), "masked": masked, "ragged": kv.pack(masked, 16)}[form]
    logits = jnp.zeros((1, CFG.vocab_size), jnp.float32)
    stops = jnp.full((gen.MAX_STOP_TOKENS,), -1, jnp.int32)
    texts = [
        gen._decode_loop.lower(PARAMS, CFG, logits, cache, jnp.int32(4), stops, gen.Sampling.make(), buffer=16)
        .compile()
        .as_text(),
        gen.forward_step.lower(PARAMS, jnp.asarray(QUESTION)[None], jnp.array([6], jnp.int32), cache, CFG)
        .compile()
        .as_text(),
    ]
    kv_shapes = {"f32[" + ",".join(map(str, layer.k.shape)) + "]" for layer in cache.layers}
    copies = [
        line.strip()
        for text in texts
        for line in text.splitlines()
        if " copy(" in line and any(f"= {shape}" in line for shape in kv_shapes)
    ]
    assert kv_shapes and not copies, copies[:4]


def numpy_logits_with_evicted_keys(params, cfg, tokens, prefix_len, context_len, keep):
    """Next-token logits after tokens [prefix | context | question] in a float64 forward where the question's rows
    do not see the context keys a (layer, KV head) evicted: keep [L, K, n]. The prefix and context rows see every
    earlier key, as in the prefill that filled the cache. An independent reference for mask_context's slot mapping.
    """
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T, N, K, H = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rms = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w
    inv_freq = 1.0 / cfg.rope.theta ** (np.arange(0, H, 2) / H)
    angles = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(x):  # [T, heads, H]
        a, b = x[..., : H // 2], x[..., H // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    kv_of = np.arange(N) // (N // K)
    causal = np.tril(np.ones((T, T), bool))
    question_rows = np.arange(T) >= prefix_len + context_len
    x = P["embed"][tokens]
    for i in range(cfg.num_layers):
        p = P[f"layers_{i}"]
        qkv = rms(x, p["attn_norm"]) @ p["qkv"]
        q = rope(qkv[:, : N * H].reshape(T, N, H))
        k = rope(qkv[:, N * H : (N + K) * H].reshape(T, K, H))
        v = qkv[:, (N + K) * H :].reshape(T, K, H)
        evicted = np.zeros((K, T), bool)  # [K, key]
        evicted[:, prefix_len : prefix_len + context_len] = ~keep[i]
        visible = causal[None] & ~(question_rows[None, :, None] & evicted[:, None, :])  # [K, T, T]
        logits = np.einsum("tnh,snh->nts", q, k[:, kv_of]) * H**-0.5
        logits = np.where(visible[kv_of], logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snh->tnh", probs, v[:, kv_of]).reshape(T, N * H) @ p["o"]
        gate, up = np.split(rms(x, p["mlp_norm"]) @ p["gate_up"], 2, axis=-1)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["down"]
    head = P["embed"].T if cfg.tie_embeddings else P["lm_head"]
    return rms(x[-1], P["final_norm"]) @ head


@pytest.mark.parametrize("level", ["pair", "layer"])
def test_mask_context_hides_exactly_the_evicted_slots(level):
    """A masked cache answers as a float64 forward that drops the evicted keys from the question's view, and the
    ragged cache packed from it too (a slot mapping off by one moves the logits by ~4 here)."""
    keep = np.array(keep_mask(SCORES, jnp.array([CONTEXT]), 0.3, level))
    keep[0, 0, 1] = False  # a head that keeps nothing
    masked = _masked(jnp.asarray(keep))
    expected = numpy_logits_with_evicted_keys(
        PARAMS, CFG, np.concatenate([SEQUENCE, QUESTION]), PREFIX, CONTEXT, keep[:, 0]
    )
    for cache in (masked, kv.pack(masked, 16)):
        logits, _ = gen.prefill(PARAMS, CFG, [QUESTION], jax.tree.map(jnp.array, cache))
        np.testing.assert_allclose(np.asarray(logits)[0], expected, atol=2e-4, rtol=0)
    full_logits, _ = gen.prefill(PARAMS, CFG, [QUESTION], _context_cache())
    assert np.abs(np.asarray(full_logits)[0] - expected).max() > 1e-2  # the eviction is visible at this tolerance


@pytest.mark.parametrize("form", ["masked", "ragged"])
def test_tiled_rows_copy_every_row_and_decode_as_it(form):
    """kv.tiled_rows: row c B + b of the tiled cache is row b (every leaf, ragged too), in new arrays (the tiled
    cache may be donated), and each copy continues exactly as the cache it came from."""
    masked = _masked(keep_mask(SCORES, jnp.array([CONTEXT]), 0.3, "pair"))
    cache = masked if form == "masked" else kv.pack(masked, room=len(QUESTION) + 4, multiple=kv.RAGGED_BLOCK)
    tiled = kv.tiled_rows(cache, 3)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(tiled)):
        np.testing.assert_array_equal(np.asarray(b), np.concatenate([np.asarray(a)] * 3))
    assert all(a is not b for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(kv.tiled_rows(cache, 1))))
    logits, _ = gen.prefill(PARAMS, CFG, [QUESTION] * 3, tiled)
    alone, _ = gen.prefill(PARAMS, CFG, [QUESTION], jax.tree.map(jnp.array, cache))
    np.testing.assert_allclose(np.asarray(logits), np.repeat(np.asarray(alone), 3, axis=0), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="copies"):
        kv.tiled_rows(cache, 0)
