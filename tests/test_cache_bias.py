"""A compacted cache's per-key bias (Attention Matching's beta): every attention path adds it to the logits (XLA
blocked and ragged, the Pallas kernels), packing carries it, new tokens get none, and bytes count it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.models import attention
from tests.test_kernels_in_model import CFG, CONTEXT, PARAMS, PREFIX, _caches


def _with_bias(cache, seed=0, hide=None):
    """The cache with a random bias on its context slots (0 elsewhere); `hide` [L, B, K, C] bool puts -inf there."""
    rng = np.random.default_rng(seed)
    layers = []
    for i, layer in enumerate(cache.layers):
        slots = np.arange(layer.capacity)
        in_context = (slots >= PREFIX) & (slots < PREFIX + CONTEXT)
        bias = np.where(in_context, rng.normal(0, 1.5, layer.k.shape[:3]), 0.0).astype(np.float32)
        if hide is not None:
            bias = np.where(hide[i], -np.inf, bias).astype(np.float32)
        layers.append(dataclasses.replace(layer, bias=jnp.asarray(bias)))
    return dataclasses.replace(cache, layers=tuple(layers))


def test_blocked_attention_adds_the_bias_to_the_logits():
    rng = np.random.default_rng(1)
    B, T, K, G, H, C = 2, 3, 2, 3, 16, 40
    q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, C, H)), jnp.float32) for _ in range(2))
    filled = jnp.asarray([[40, 33], [12, 0]], jnp.int32)
    bias = jnp.asarray(rng.normal(0, 2, (B, K, C)), jnp.float32)
    query_slots = filled[:, :, None] + jnp.arange(T)  # queries after every cached key
    out, lse, _ = attention.blocked_attention(
        q, k, v, filled, None, None, query_slots, None, 0.25, key_bias=bias, block=16
    )
    logits = 0.25 * jnp.einsum("BTKGH,BKSH->BKGTS", q, k, precision="highest") + bias[:, :, None, None, :]
    visible = (jnp.arange(C) < filled[..., None])[:, :, None, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    want_lse = jax.nn.logsumexp(logits, axis=-1)  # [B, K, G, T]
    probs = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(want_lse), want_lse, 0)[..., None]), 0)
    want = jnp.einsum("BKGTS,BKSH->BTKGH", probs, v, precision="highest")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
    seen = np.asarray(filled) > 0
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_every_cache_form_decodes_the_same_with_a_bias(impl):
    cfg = dataclasses.replace(CFG, attention_impl=impl)
    _, masked, _ = _caches(cfg, PARAMS)
    masked = _with_bias(masked)
    ragged = kv.pack(masked, room=16)
    assert ragged.layers[0].bias is not None and ragged.layers[0].bias.shape == ragged.layers[0].k.shape[:2]
    outs = []
    for cache in (masked, ragged):
        logits, _, _ = gen.forward(PARAMS, jnp.asarray([[7]]), cache.next_position[:, None], cache, cfg)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5)
    plain, _, _ = gen.forward(PARAMS, jnp.asarray([[7]]), masked.next_position[:, None], _caches(cfg, PARAMS)[1], cfg)
    assert np.abs(outs[0] - np.asarray(plain)).max() > 1e-3  # the bias changed the answer


def test_pallas_and_xla_agree_on_a_biased_cache():
    logits = []
    for impl in ("xla", "pallas"):
        cfg = dataclasses.replace(CFG, attention_impl=impl)
        for cache in (lambda c: c, lambda c: kv.pack(c, room=16)):
            c = cache(_with_bias(_caches(cfg, PARAMS)[1], seed=3))
            logits.append(np.asarray(gen.forward(PARAMS, jnp.asarray([[5]]), c.next_position[:, None], c, cfg)[0]))
    for other in logits[1:]:
        np.testing.assert_allclose(other, logits[0], atol=1e-5)


def test_a_minus_infinite_bias_evicts_and_bytes_count_the_bias():
    _, masked, _ = _caches(CFG, PARAMS)
    rng = np.random.default_rng(4)
    hide = rng.random((CFG.num_layers, 1, CFG.num_kv_heads, masked.layers[0].capacity)) < 0.3
    hide[..., :PREFIX] = False
    hide[..., PREFIX + CONTEXT :] = False  # only context pairs: new tokens get no bias
    biased = _with_bias(masked, hide=hide)
    zero_bias = dataclasses.replace(
        biased,
        layers=tuple(
            dataclasses.replace(layer, bias=jnp.where(jnp.isinf(layer.bias), -jnp.inf, 0.0).astype(jnp.float32))
            for layer in biased.layers
        ),
    )
    evicted = dataclasses.replace(
        masked,
        layers=tuple(
            dataclasses.replace(layer, keep=layer.keep & ~jnp.asarray(h)) for layer, h in zip(masked.layers, hide)
        ),
    )
    position = masked.next_position[:, None]
    a = gen.forward(PARAMS, jnp.asarray([[9]]), position, zero_bias, CFG)[0]
    b = gen.forward(PARAMS, jnp.asarray([[9]]), position, evicted, CFG)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    packed = kv.pack(zero_bias, room=16)  # the ragged form: whole blocks of -inf keys give no NaN either
    c = gen.forward(PARAMS, jnp.asarray([[9]]), position, packed, CFG)[0]
    np.testing.assert_allclose(np.asarray(c), np.asarray(b), atol=1e-5)
    pairs = int(kv.kept_per_head(masked).sum())
    assert kv.used_bytes(biased) - kv.used_bytes(masked) == 4 * pairs
    assert kv.nbytes(biased) - kv.nbytes(masked) == 4 * sum(layer.bias.size for layer in biased.layers)


def test_whole_ragged_blocks_of_minus_infinite_bias_give_no_nan():
    """A head whose every context key has bias -inf: its ragged blocks hold only such keys and stay finite."""
    dense = _caches(CFG, PARAMS)[0]
    hide = np.zeros((CFG.num_layers, 1, CFG.num_kv_heads, dense.layers[0].capacity), bool)
    hide[0, :, 0, PREFIX : PREFIX + CONTEXT] = True
    biased = dataclasses.replace(
        dense,
        layers=tuple(
            dataclasses.replace(layer, bias=jnp.where(jnp.asarray(h), -jnp.inf, 0.0).astype(jnp.float32))
            for layer, h in zip(dense.layers, hide)
        ),
    )
    position = dense.next_position[:, None]
    want = gen.forward(PARAMS, jnp.asarray([[9]]), position, biased, CFG)[0]
    got = gen.forward(PARAMS, jnp.asarray([[9]]), position, kv.pack(biased, room=16), CFG)[0]
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
