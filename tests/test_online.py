"""Online compaction (matching.online) on a tiny random model: generation runs past the physical cache, the cache
keeps its capacity and its logical positions, nothing is NaN; with room to spare it is plain decoding; defragmenting
a compacted cache changes no attention; bad settings get named errors."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import SLIDING
from kvzip_jax.errors import ContextTooLongError, UnsupportedArchitectureError
from kvzip_jax.matching import online
from kvzip_jax.matching.queries import QueryObserver
from kvzip_jax.models.params import init_params
from kvzip_jax.models.transformer import forward
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(2)
    return cfg, init_params(cfg, seed=1, scale=0.15), np.random.default_rng(0).integers(0, 101, 20).astype(np.int32)


def test_generation_runs_past_the_physical_cache(model):
    cfg, params, prompt = model
    # 140 tokens through 64 slots: compactions after 44, 70 and 96 new tokens (each frees 26 of the 52 compactable
    # slots); the decode loop compiles at 3 buffer sizes (128, 64, 32: 120, 76, 50 and 24 tokens left)
    tokens, cache, compactions = online.generate(params, cfg, prompt, 120, capacity=64, protect=8, keep_prefix=4)
    assert len(tokens) == 120 and compactions >= 3
    assert cache.capacity == 64 and int(cache.next_position[0]) == 140
    lengths = np.asarray(cache.lengths())
    assert (lengths == lengths.flat[0]).all() and lengths.flat[0] <= 64
    for layer in cache.layers:
        assert layer.keep is None and np.isfinite(np.asarray(layer.bias)).all()
        np.testing.assert_array_equal(np.asarray(layer.bias)[..., :4], 0.0)  # the kept prefix is never compacted
    again, _, _ = online.generate(params, cfg, prompt, 120, capacity=64, protect=8, keep_prefix=4)
    assert again == tokens  # greedy and deterministic


def test_with_room_to_spare_it_is_plain_decoding(model):
    cfg, params, prompt = model
    tokens, _, compactions = online.generate(params, cfg, prompt, 40, capacity=128)
    logits, cache = gen.prefill(params, cfg, [prompt], capacity=128)
    plain, _ = gen.decode(params, cfg, logits, cache, 40)
    assert compactions == 0 and tokens == plain[0]


def test_defragmenting_a_compacted_cache_changes_no_attention(model):
    """One online compaction (dense, with a bias), its pairs spread over a masked cache with evicted gaps, and that
    cache defragmented give the same logits for the same appended tokens."""
    cfg, params, prompt = model
    _, cache = gen.prefill(params, cfg, [np.tile(prompt, 4)[:64]], capacity=128)
    config = online.MatchingConfig(ratio=0.5, budget="uniform", sources=("self-study",), same_bytes=False)
    compact = online.compact_full
    dense = compact(params, cfg, cache, list(np.tile(prompt, 4)[:64]), config, keep_prefix=2, protect=6, window=16)
    shuffled = kv.KVCache(tuple(_with_evicted_gaps(layer) for layer in dense.layers), dense.next_position)
    assert int(shuffled.room()[0]) < int(dense.room()[0])  # the gaps hold slots until defragmented
    back = kv.defragment(shuffled)
    for a, b in zip(back.layers, dense.layers):
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    new = jnp.asarray([[7, 8, 9]], jnp.int32)
    want, _ = gen.append_tokens(params, new, jnp.asarray([3]), dense, cfg, logits="all")
    for form in (shuffled, back):
        got, _ = gen.append_tokens(params, new, jnp.asarray([3]), form, cfg, logits="all")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # The observed forward (what the next compaction's reference pass runs) adds the bias too.
    observer = QueryObserver(jnp.zeros((1, 3), jnp.int32).at[0].set(jnp.arange(3)))
    positions = dense.next_position[:, None] + jnp.arange(3)
    observed, _, _ = forward(params, new, positions, dense, cfg, observer, num_new=jnp.asarray([3]), logits="all")
    np.testing.assert_allclose(np.asarray(observed), np.asarray(want), atol=1e-5)


def _with_evicted_gaps(layer: kv.LayerCache) -> kv.LayerCache:
    """The pairs of a dense layer with an evicted slot after each: a masked layer holding them spread out."""
    C = layer.capacity
    spread = lambda x: jnp.stack([x, jnp.zeros_like(x)], axis=3).reshape(x.shape[:2] + (2 * C,) + x.shape[3:])[
        :, :, :C
    ]  # [B, K, C, ...] slot i -> 2i
    assert int(layer.lengths.max()) * 2 <= C
    slots = jnp.arange(C)
    keep = (slots % 2 == 0) | (slots >= 2 * layer.lengths[..., None])  # appended tokens are kept
    return kv.LayerCache(
        k=spread(layer.k), v=spread(layer.v), keep=keep, bias=spread(layer.bias), lengths=2 * layer.lengths
    )


def test_bad_settings_get_named_errors(model):
    cfg, params, prompt = model
    run = lambda **kw: online.generate(params, cfg, prompt, 8, **{"capacity": 64, **kw})
    with pytest.raises(ValueError, match="ratio must be in"):
        run(ratio=1.0)
    with pytest.raises(ValueError, match="no KVzip scores"):
        run(selector="kvzip")
    with pytest.raises(ValueError, match="leaves nothing"):
        run(capacity=24, keep_prefix=4, protect=20)
    with pytest.raises(ContextTooLongError):
        online.generate(params, cfg, prompt, cfg.max_position, capacity=64)
    sliding = dataclasses.replace(cfg, layer_types=(SLIDING,) + cfg.layer_types[1:], sliding_window=8)
    with pytest.raises(UnsupportedArchitectureError, match="sliding"):
        online.generate(params, sliding, prompt, 8, capacity=64)
