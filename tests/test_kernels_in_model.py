"""The Pallas kernels inside the model (interpret mode on CPU): decode over dense, masked and ragged caches and the
KVzip score reduction give what the XLA paths give; layers the kernels do not cover fall back; ragged store sizes
come in buckets, so a new context reuses the compiled decode step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import FULL, SLIDING, ModelConfig, RopeSpec
from kvzip_jax.kvzip import RereadInputs, keep_mask, score
from kvzip_jax.models.params import init_params
from tests.conftest import tiny_config

PREFIX, CONTEXT = 4, 44
CFG = tiny_config(2, hidden_size=64, head_dim=16)
PARAMS = init_params(CFG, seed=1, scale=0.15)
RNG = np.random.default_rng(0)
SEQUENCE = RNG.integers(0, CFG.vocab_size, PREFIX + CONTEXT).astype(np.int32)
QUESTION = RNG.integers(0, CFG.vocab_size, 5).astype(np.int32)


def _with(cfg, impl):
    return dataclasses.replace(cfg, attention_impl=impl)


def _caches(cfg, params, ratio=0.3, seed=1, level="pair"):
    """(dense, masked, ragged) caches of the context, compressed with random scores at `level`."""
    _, dense = gen.prefill(params, cfg, [SEQUENCE], capacity=64)
    scores = jnp.asarray(
        np.random.default_rng(seed).random((cfg.num_layers, 1, cfg.num_kv_heads, CONTEXT)), jnp.float32
    )
    masked = kv.mask_context(
        dense, keep_mask(scores, jnp.array([CONTEXT]), ratio, level), jnp.array([PREFIX]), jnp.array([CONTEXT])
    )
    return dense, masked, kv.pack(masked, room=16)


@pytest.mark.parametrize("form", ["dense", "masked", "ragged"])
def test_pallas_decode_answers_as_xla_decode(form):
    answers, logits_seen = [], []
    for impl in ("xla", "pallas"):
        cfg = _with(CFG, impl)
        cache = dict(zip(("dense", "masked", "ragged"), _caches(cfg, PARAMS)))[form]
        logits, cache = gen.prefill(PARAMS, cfg, [QUESTION], cache)  # several tokens: the XLA path either way
        out, _, last = gen.decode(PARAMS, cfg, logits, cache, 12, return_logits=True)  # one token: the kernel
        answers.append(out)
        logits_seen.append(np.asarray(last))
    assert answers[0] == answers[1]
    np.testing.assert_allclose(logits_seen[1], logits_seen[0], atol=1e-5, rtol=0)


def test_pallas_decode_in_bfloat16_follows_xla():
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
    logits = []
    for impl in ("xla", "pallas"):
        cfg = _with(CFG, impl)
        ragged = _caches(cfg, p16)[2]
        assert ragged.layers[0].k.dtype == jnp.bfloat16
        out, _, _ = gen.forward(p16, jnp.asarray([[7]]), ragged.next_position[:, None], ragged, cfg)
        logits.append(np.asarray(out))
    # The kernel multiplies q (rounded to bf16) by bf16 keys; XLA multiplies float32 q: one bf16 rounding of q.
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-2 * np.abs(logits[0]).max(), rtol=0)


@pytest.mark.parametrize("chunk", [CONTEXT, 16])  # one chunk (the forward's normaliser), three chunks (a subset)
@pytest.mark.parametrize("variant", ["softmax", "logits"])
def test_pallas_score_reduction_equals_xla(chunk, variant):
    chunks = [SEQUENCE[PREFIX + i : PREFIX + i + chunk] for i in range(0, CONTEXT, chunk)]
    rereads = [np.concatenate([[7, 8, 9], c]) for c in chunks]
    width = max(map(len, rereads))
    tokens = np.zeros((len(chunks), 1, width), np.int32)
    for t, r in enumerate(rereads):
        tokens[t, 0, : len(r)] = r
    reread = RereadInputs(
        tokens=jnp.asarray(tokens),
        num_valid=jnp.asarray([[len(r)] for r in rereads], jnp.int32),
        chunk_start=jnp.asarray(PREFIX + chunk * np.arange(len(chunks))[:, None], jnp.int32),
        chunk_len=jnp.asarray([[len(c)] for c in chunks], jnp.int32),
        prefix_len=jnp.asarray([PREFIX], jnp.int32),
        context_len=jnp.asarray([CONTEXT], jnp.int32),
        chunk_size=chunk,
    )
    scores = []
    for impl in ("xla", "pallas"):
        cfg = _with(CFG, impl)
        _, cache = gen.prefill(PARAMS, cfg, [SEQUENCE], capacity=64)
        scores.append(np.asarray(score(PARAMS, cfg, cache, reread, variant=variant)))
    np.testing.assert_allclose(scores[1], scores[0], atol=1e-5, rtol=1e-5)


def test_layers_the_kernels_do_not_cover_fall_back():
    """Sliding-window layers and head dims that are not a power of two >= 16 take the XLA path."""
    cfg = ModelConfig(
        architecture="gemma3",
        vocab_size=101,
        hidden_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeSpec(1000.0),
        layer_types=(SLIDING, FULL),
        sliding_window=8,
        sandwich_norms=True,
        activation="gelu_tanh",
    )
    params = init_params(cfg, seed=2, scale=0.15)
    outs = []
    for impl in ("xla", "pallas"):
        c = _with(cfg, impl)
        logits, cache = gen.prefill(params, c, [SEQUENCE], capacity=64)
        outs.append(gen.decode(params, c, logits, cache, 6)[0])
    assert outs[0] == outs[1]


def test_attention_impl_is_checked_and_never_saved():
    with pytest.raises(ValueError, match="attention_impl"):
        _with(CFG, "triton")
    assert "attention_impl" not in CFG.to_dict()
    assert ModelConfig.from_dict(_with(CFG, "pallas").to_dict()) == CFG


def test_store_buckets_bound_the_slack_and_are_shared_by_nearby_sizes():
    sizes = np.array([kv.store_bucket(n) for n in range(1, 70000)])
    assert (sizes % kv.RAGGED_BLOCK == 0).all() and (sizes >= np.arange(1, 70000)).all()
    assert (sizes[127:] <= np.arange(128, 70000) * 9 / 8).all()  # past 128 slots, at most 1/8 slack
    assert len(np.unique(sizes[1000:2000])) <= 9  # a thousand sizes, a handful of shapes


def test_a_new_context_reuses_the_compiled_ragged_decode_step():
    """Per-layer budgets (level "layer") fix each layer's pair count; the heads' shares and so the exact store needs
    vary from context to context, the buckets do not. (At level "pair" the layers' shares move too: a context whose
    layers land in other buckets compiles once more.)"""
    caches = [_caches(CFG, PARAMS, seed=seed, level="layer")[2] for seed in (1, 2, 3, 4)]
    needs = {tuple(int(x) for x in np.asarray(kv.kept_per_head(c)).reshape(-1)) for c in caches}
    assert len(needs) > 1  # different kept sets per head
    assert len({tuple(layer.k.shape for layer in c.layers) for c in caches}) == 1  # one set of store shapes
    step = jax.jit(lambda p, c: gen.forward(p, jnp.asarray([[7]]), c.next_position[:, None], c, CFG)[0])
    for cache in caches:
        step(PARAMS, cache)
    assert step._cache_size() == 1
    # A packed cache and the cache a jitted decode step returns from it compile once between them.
    token, one = jnp.asarray([[7]]), jnp.ones((1,), jnp.int32)
    advance = jax.jit(gen.append_tokens, static_argnames=("logits",))
    cache = caches[0]
    for _ in range(3):
        _, cache = advance(PARAMS, token, one, cache, CFG)
    assert advance._cache_size() == 1


@pytest.mark.parametrize("form,bits,center", [("masked", 8, False), ("ragged", 4, True)])
def test_pallas_decode_over_a_quantized_cache_answers_as_xla(form, bits, center):
    """int8 / int4 stores read by the decode kernels (dequantized in the kernel) then the full-precision window: the
    same greedy tokens as the XLA path (store dequantized block by block), logits within 1e-5; the window of 8 flushes
    during the answer, so both read a store that grew while decoding; centred keys (the int4 case) get their centre's
    logit back on the kernel's log-sum-exp."""
    from kvzip_jax.quant.groups import QuantFormat

    answers, logits_seen = [], []
    for impl in ("xla", "pallas"):
        cfg = _with(CFG, impl)
        cache = dict(zip(("dense", "masked", "ragged"), _caches(cfg, PARAMS)))[form]
        cache = kv.quantized(cache, QuantFormat(bits=bits, group=8), window=8, center=center)
        logits, cache = gen.prefill(PARAMS, cfg, [QUESTION], cache)
        out, cache, last = gen.decode(PARAMS, cfg, logits, cache, 12, return_logits=True)
        assert int(cache.layers[0].window.lengths[0, 0]) < len(QUESTION) + 12  # flushed
        answers.append(out)
        logits_seen.append(np.asarray(last))
    assert answers[0] == answers[1]
    np.testing.assert_allclose(logits_seen[1], logits_seen[0], atol=1e-5, rtol=0)
