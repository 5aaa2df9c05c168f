"""Exporting a compressed cache into a serving engine's pages: on tiny random GQA models (4 query heads over 2 KV
heads, head dim 64 and 128, contexts of 37 and 50 tokens in one batch, pages of 8 slots), a KVzip pair-uniform cache
exported to tpu-inference's layout attends through the wheel's own reference kernel (ref_ragged_paged_attention, its
hd64 variant at head dim 64) as our attention over the same cache does, for one new token and for three, with and
without a sliding window; the GPU layout through our oracle the same; merge_kv is the wheel's; the logical position
and the kept length are carried; a cache with unequal counts per (layer, KV head) is named."""

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, serving
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import KvzipError
from kvzip_jax.models import attention, ragged_attention
from kvzip_jax.models.params import init_params
from kvzip_jax.serving import tpu_inference_kernel as engine
from tests.conftest import tiny_config

PREFIX, CONTEXTS, RATIO, PAGE = 4, (37, 50), 0.3, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def serving_config(head_dim: int, **changes) -> ModelConfig:
    """The serving tests' tiny model: 4 query heads over 2 key-value heads of `head_dim` (the engine's 64 or 128)."""
    small = dict(hidden_size=32, num_heads=4, intermediate_size=32, max_position=256)
    return tiny_config(2, head_dim=head_dim, **small, **changes)


def _wheel(hd64: bool = False):
    """The engine's kernel module (make's test environment downloads the wheel: its absence fails, never skips)."""
    return engine.load(hd64)


@pytest.fixture(scope="module", params=[64, 128], ids=["hd64", "hd128"])
def compressed(request):
    """(cfg, full cache, pair-uniform masked cache, its ragged pack, random scores, context lengths)."""
    cfg = serving_config(request.param)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 101, PREFIX + n).astype(np.int32) for n in CONTEXTS]
    _, cache = gen.prefill(params, cfg, rows, capacity=64)
    scores = jnp.asarray(rng.random((cfg.num_layers, 2, cfg.num_kv_heads, max(CONTEXTS))), jnp.float32)
    context = jnp.array(CONTEXTS, jnp.int32)
    keep = kvzip.keep_mask(scores, context, RATIO, "pair-uniform")
    masked = kv.mask_context(cache, keep, jnp.full((2,), PREFIX, jnp.int32), context)
    return cfg, cache, masked, kv.pack(masked, room=0), scores, context


def _step(cfg: ModelConfig, T: int, seed: int = 3):
    """Random post-RoPE queries [B, T, N, H] and new keys, values [B, T, K, H] for one step."""
    rng = np.random.default_rng(seed)
    draw = lambda heads: jnp.asarray(rng.normal(size=(2, T, heads, cfg.head_dim)), jnp.float32)
    return draw(cfg.num_heads), draw(cfg.num_kv_heads), draw(cfg.num_kv_heads)


def _ours(cfg: ModelConfig, layer, q, k_new, v_new, window=None):
    """Our attention [B, T, N, H] of q over a masked or ragged layer and the new tokens (models/)."""
    B, T, N, H = q.shape
    K = cfg.num_kv_heads
    q5 = q.reshape(B, T, K, N // K, H)
    kn, vn = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)  # [B, K, T, H]
    slots = layer.lengths[:, :, None] + jnp.arange(T, dtype=jnp.int32)  # [B, K, T]
    if isinstance(layer, kv.RaggedLayerCache):
        args = (layer.k, layer.v, layer.offsets, layer.lengths, kn, vn, slots, window, cfg.query_scale, layer.block)
        out = ragged_attention.ragged_attention(q5, *args)[0]
    else:
        args = (layer.k, layer.v, layer.lengths, kn, vn, slots, window, cfg.query_scale, layer.keep)
        out = attention.blocked_attention(q5, *args)[0]
    return np.asarray(out.reshape(B, T, N, H))


def test_merge_kv_and_page_shapes_are_the_wheels():
    main, hd64 = _wheel(), _wheel(hd64=True)
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        for K in (1, 2, 3):
            for H in (64, 96, 128):
                k, v = (jnp.asarray(rng.normal(size=(5, K, H)), dtype) for _ in range(2))
                np.testing.assert_array_equal(np.asarray(serving.merge_kv(k, v)), np.asarray(main.merge_kv(k, v)))
                assert serving.tpu_page_shape(6, 8, K, H, dtype) == main.get_kv_cache_shape(6, 8, K, H, dtype)
            k, v = (jnp.asarray(rng.normal(size=(5, K, 64)), dtype) for _ in range(2))
            np.testing.assert_array_equal(np.asarray(serving.merge_kv(k, v, True)), np.asarray(hd64.merge_kv(k, v)))
            assert serving.tpu_page_shape(6, 8, K, 64, dtype, True) == hd64.get_kv_cache_shape(6, 8, K, 64, dtype)


def test_loading_the_wheel_leaves_no_stub_behind(monkeypatch):
    _wheel(), _wheel(hd64=True)
    assert not any(name == "tpu_inference" or name.startswith("tpu_inference.") for name in sys.modules)
    monkeypatch.setattr(engine.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(engine, "wheel_dirs", lambda: [])
    with pytest.raises(serving.EngineKernelMissingError, match="pip download --no-deps"):
        engine._folder()


def test_export_carries_the_kept_length_and_the_logical_position(compressed):
    cfg, cache, masked, ragged, _, context = compressed
    kept = PREFIX + np.floor(RATIO * np.asarray(context)).astype(int)  # [15, 19]: not multiples of PAGE
    assert (np.asarray(kv.kept_per_head(masked)) == kept[None, :, None]).all()
    for source in (masked, ragged):
        for export in (serving.export_tpu(source, PAGE), serving.export_gpu(source, PAGE)):
            np.testing.assert_array_equal(np.asarray(export.kv_lens), kept)
            np.testing.assert_array_equal(np.asarray(export.positions), PREFIX + np.asarray(context))
            np.testing.assert_array_equal(np.asarray(export.positions), np.asarray(cache.next_position))
            pps = -(-kept.max() // PAGE)
            np.testing.assert_array_equal(np.asarray(export.page_indices), np.arange(2 * pps).reshape(2, pps))
            for i, layer in enumerate(ragged.layers):
                k, v = serving.read_pages(export, i)  # [B, S, K, H]
                for b in range(2):
                    for h in range(cfg.num_kv_heads):
                        start = int(layer.offsets[b, h])
                        pairs = slice(start, start + kept[b])  # head h's kept pairs in slot order
                        np.testing.assert_array_equal(np.asarray(k[b, : kept[b], h]), layer.k[b, pairs])
                        np.testing.assert_array_equal(np.asarray(v[b, : kept[b], h]), layer.v[b, pairs])
                    assert not np.asarray(k[b, kept[b] :]).any() and not np.asarray(v[b, kept[b] :]).any()
        tpu = serving.export_tpu(source, PAGE)
        assert tpu.hd64 == (cfg.head_dim == 64)
        shape = serving.tpu_page_shape(2 * pps, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32, tpu.hd64)
        assert all(p.shape == shape for p in tpu.pages)
        # tail slots of the tpu pages (padding heads and lanes included) are zero
        rows = np.asarray(tpu.pages[0]).reshape(2, pps * PAGE, -1)
        assert not rows[0, kept[0] :].any() and not rows[1, kept[1] :].any()


@pytest.mark.parametrize("T", [1, 3])
def test_engine_reference_over_the_pages_is_our_attention(compressed, T):
    cfg, _, masked, ragged, _, _ = compressed
    _wheel(cfg.head_dim == 64)
    q, k_new, v_new = _step(cfg, T)
    for source in (masked, ragged):
        tpu = serving.export_tpu(source, PAGE, room=T)
        gpu = serving.export_gpu(source, PAGE)
        for i, layer in enumerate(source.layers):
            want = _ours(cfg, layer, q, k_new, v_new)
            out, pages = engine.attend_export(q, k_new, v_new, tpu, i, cfg.query_scale)
            np.testing.assert_allclose(np.asarray(out), want, **TOL)
            for export in (tpu, gpu):
                got = serving.paged_decode_attention(q, export, i, cfg.query_scale, k_new, v_new)
                np.testing.assert_allclose(np.asarray(got), want, **TOL)
            # the engine wrote the new tokens at slots kv_lens + t of the pages
            written = dataclasses.replace(tpu, pages=tpu.pages[:i] + (pages,) + tpu.pages[i + 1 :])
            k, v = serving.read_pages(written, i)
            for b, n in enumerate(np.asarray(tpu.kv_lens)):
                np.testing.assert_array_equal(np.asarray(k[b, n : n + T]), np.asarray(k_new[b]))
                np.testing.assert_array_equal(np.asarray(v[b, n : n + T]), np.asarray(v_new[b]))


def test_sliding_window_is_our_window_over_the_kept_pairs(compressed):
    cfg, _, _, ragged, _, _ = compressed
    _wheel(cfg.head_dim == 64)
    T, window = 3, 6
    q, k_new, v_new = _step(cfg, T, seed=4)
    tpu = serving.export_tpu(ragged, PAGE, room=T)
    gpu = serving.export_gpu(ragged, PAGE)
    for i, layer in enumerate(ragged.layers):
        want = _ours(cfg, layer, q, k_new, v_new, window)
        assert np.abs(want - _ours(cfg, layer, q, k_new, v_new)).max() > 1e-3  # the window changes the result
        out, _ = engine.attend_export(q, k_new, v_new, tpu, i, cfg.query_scale, window=window)
        np.testing.assert_allclose(np.asarray(out), want, **TOL)
        got = serving.paged_decode_attention(q, gpu, i, cfg.query_scale, k_new, v_new, window=window)
        np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_main_layout_at_head_dim_64_and_bfloat16_pages(compressed):
    cfg, _, masked, _, _, _ = compressed
    _wheel(cfg.head_dim == 64)
    q, k_new, v_new = _step(cfg, 1)
    layer = masked.layers[1]
    want = _ours(cfg, layer, q, k_new, v_new)
    if cfg.head_dim == 64:  # the main kernel takes head dim 64 too, padded to 128 lanes
        main = serving.export_tpu(masked, PAGE, room=1, hd64=False)
        assert main.pages[0].shape[-1] == 128 and not main.hd64
        np.testing.assert_allclose(
            np.asarray(engine.attend_export(q, k_new, v_new, main, 1, cfg.query_scale)[0]), want, **TOL
        )
    with pytest.raises(ValueError, match="multiple of 2"):
        serving.export_tpu(masked, 7, dtype=jnp.bfloat16)
    half = serving.export_tpu(masked, PAGE, dtype=jnp.bfloat16, room=1)
    assert half.pages[0].dtype == jnp.bfloat16 and half.pages[0].shape[3] == 2  # two bfloat16 per 32-bit word
    out, _ = engine.attend_export(q.astype(jnp.bfloat16), k_new, v_new, half, 1, cfg.query_scale)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)


def test_unequal_counts_are_named_not_padded(compressed):
    cfg, cache, _, _, scores, context = compressed
    keep = kvzip.keep_mask(scores, context, RATIO, "pair")
    masked = kv.mask_context(cache, keep, jnp.full((2,), PREFIX, jnp.int32), context)
    counts = np.asarray(kv.kept_per_head(masked))
    assert (counts.min(axis=(0, 2)) < counts.max(axis=(0, 2))).all()
    for source in (masked, kv.pack(masked, room=0)):
        for export in (lambda c: serving.export_tpu(c, PAGE), lambda c: serving.export_gpu(c, PAGE)):
            with pytest.raises(serving.NonUniformCacheError, match="pair-uniform") as raised:
                export(source)
            assert isinstance(raised.value, KvzipError) and isinstance(raised.value, ValueError)
            assert f"counts {', '.join(map(str, sorted(set(counts[:, 0].ravel().tolist()))[:8]))}" in str(raised.value)


def test_quantized_and_biased_caches_are_named(compressed):
    _, _, masked, _, _, _ = compressed
    biased = dataclasses.replace(
        masked, layers=tuple(dataclasses.replace(layer, bias=jnp.zeros(layer.keep.shape)) for layer in masked.layers)
    )
    with pytest.raises(serving.UnsupportedCacheError, match="no bias"):
        serving.export_tpu(biased, PAGE)
    with pytest.raises(serving.UnsupportedCacheError, match="quantized"):
        serving.export_gpu(kv.quantized(masked), PAGE)
