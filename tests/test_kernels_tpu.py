"""The Pallas kernels' TPU (Mosaic) variants: against their jnp oracles in Pallas TPU interpret mode, and lowered for
"tpu" on this CPU host. Never run on a TPU.

The interpret tests trace the public entry points (impl="pallas") as for a TPU (`target_platform` "tpu") with the
Mosaic kernels run in TPU interpret mode (`pltpu.InterpretParams`: simulated VMEM, SMEM, DMAs and out-of-bounds
checks), so the dispatch, the padding and the kernels are all exercised. Store slots no segment owns (values
included) and padding query rows hold NaN: a leak shows up as NaN. float32 at atol = rtol = 1e-5, as
tests/test_kernels.py (IEEE float32 products on both sides; only the summation order differs).

The export tests lower each kernel for "tpu" under an abstract TPU v5e (jax's Mosaic lowering asks the current device
for its TPU generation) and find Mosaic's custom call in the module. Lowering checks Mosaic's block-shape rules, not
what the TPU compiler does with the kernel.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from kvzip_jax.quant import groups as quant
from pallas_kernels import (
    MASK_VALUE,
    QuantizedRows,
    decode_attention,
    decode_attention_reference,
    dispatch,
    ragged_decode,
    ragged_decode_reference,
    ragged_decode_tpu,
    score_max,
    score_max_reference,
    score_max_tpu,
)

# the modules (the package's names of the same spelling are the functions)
ragged_module = importlib.import_module("pallas_kernels.ragged_decode")
score_module = importlib.import_module("pallas_kernels.score_max")

TOL = {"atol": 1e-5, "rtol": 1e-5}
MOSAIC = "tpu_custom_call"
TPU_V5E = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
)

# A store of 120 slots, 2 batch rows x 3 KV heads, lengths 0, 1, 15, 16, 17 and a whole room of 40 (row 1 head 2,
# ending at the store's end, where the last block read is clamped back over keys already seen). Offsets 4, 28 and 44
# are not multiples of 8: the kernel's first block starts at the aligned slot below and masks the keys before.
SLOTS = 120
OFFSETS = np.array([[0, 8, 44], [4, 28, 80]], np.int32)  # [B, K]
LENGTHS = np.array([[0, 1, 15], [16, 17, 40]], np.int32)  # [B, K]


@pytest.fixture
def tpu_interpret(monkeypatch):
    """The kernels traced as for a TPU, their Mosaic kernels run in TPU interpret mode."""
    monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")
    interpreted = lambda kernel: lambda *args, **kwargs: kernel(*args, **{**kwargs, "interpret": True})
    monkeypatch.setattr(ragged_module, "ragged_decode_mosaic", interpreted(ragged_decode_tpu.ragged_decode_mosaic))
    monkeypatch.setattr(score_module, "score_max_mosaic", interpreted(score_max_tpu.score_max_mosaic))


@pytest.fixture
def tpu_trace(monkeypatch):
    """The kernels traced as for a TPU: Mosaic kernels, lowered (for an export)."""
    monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")


def _used(offsets, lengths, slots):
    """[B, S] bool: slots some head's segment owns."""
    used = np.zeros((offsets.shape[0], slots), bool)
    for b, h in np.ndindex(offsets.shape):
        used[b, offsets[b, h] : offsets[b, h] + lengths[b, h]] = True
    return used


def _ragged_inputs(rng, offsets, lengths, rows, head_dim, slots, bias):
    """q [B, K, rows, H], k, v [B, S, H] (NaN outside the segments), bias [B, S] (-inf on a quarter of the slots,
    NaN outside the segments) or None."""
    used = _used(offsets, lengths, slots)
    batch, kv_heads = offsets.shape
    k, v = (rng.normal(size=(batch, slots, head_dim)).astype(np.float32) for _ in range(2))
    k[~used], v[~used] = np.nan, np.nan
    q = rng.normal(size=(batch, kv_heads, rows, head_dim)).astype(np.float32)
    slot_bias = None
    if bias:
        slot_bias = rng.normal(size=(batch, slots)).astype(np.float32)
        slot_bias[rng.random(slot_bias.shape) < 0.25] = -np.inf
        slot_bias[~used] = np.nan
    return tuple(None if x is None else jnp.asarray(x) for x in (q, k, v, offsets, lengths, slot_bias))


def _assert_close(got, want):
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all(), "NaN or inf in a kernel output"
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


# ------------------------------------------------------------------------------------------------ dispatch


def test_lowering_follows_the_target_platform(monkeypatch):
    assert dispatch.lowering("cuda") == "triton" and dispatch.lowering("tpu") == "mosaic"
    assert dispatch.lowering() == "interpret" and dispatch.interpret_mode()  # this CPU host
    monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")
    assert dispatch.lowering() == "mosaic" and not dispatch.interpret_mode()
    assert dispatch.resolve_impl("auto") == "xla"  # the default backend (CPU here; unmeasured on a TPU anyway)


# ------------------------------------------------------------------------------------------------ interpret mode


@pytest.mark.parametrize(
    "batch, kv_heads, groups, num_tokens, head_dim, block_k, bias",
    [
        (2, 3, 4, 1, 128, 16, False),
        (2, 3, 1, 3, 128, 32, True),
        (2, 3, 4, 1, 64, 16, True),
        (1, 1, 1, 1, 64, 16, False),
    ],
    ids=["B2K3G4-hd128", "B2K3G1T3-hd128-bias-bk32", "B2K3G4-hd64-bias", "B1K1G1-hd64"],
)
def test_ragged_decode_tpu_matches_reference(
    tpu_interpret, batch, kv_heads, groups, num_tokens, head_dim, block_k, bias
):
    """Every length of the store (0, 1, 15, 16, 17, a whole room; B = K = 1: the last head, at the store's end)."""
    offsets, lengths = OFFSETS[-batch:, -kv_heads:], LENGTHS[-batch:, -kv_heads:]
    rng = np.random.default_rng(1)
    q, k, v, offsets, lengths, slot_bias = _ragged_inputs(
        rng, offsets, lengths, groups * num_tokens, head_dim, SLOTS, bias
    )
    call = dict(scale=head_dim**-0.5, num_tokens=num_tokens)
    got = ragged_decode(q, k, v, offsets, lengths, slot_bias, **call, impl="pallas", block_k=block_k)
    want = ragged_decode_reference(q, k, v, offsets, lengths, slot_bias, **call)
    _assert_close(got, want)
    empty = np.asarray(lengths) == 0  # [B, K]
    assert (np.asarray(got[1])[empty] == MASK_VALUE).all() and (np.asarray(got[0])[empty] == 0).all()


def _quantized(rng, x, bits, group, used):
    """x [B, S, H] quantized by kvzip_jax.quant, as the kernels take it; NaN scales and zeros on unused slots."""
    rows = quant.quantize(jnp.asarray(x), quant.QuantFormat(bits=bits, group=group))
    scale, zero = np.asarray(rows.scale, np.float32), np.asarray(rows.zero, np.float32)
    scale[~used], zero[~used] = np.nan, np.nan
    return QuantizedRows(rows.codes, jnp.asarray(scale), jnp.asarray(zero))


@pytest.mark.parametrize(
    "key_bits, value_bits, group, head_dim, bias",
    [(8, 8, 32, 64, False), (4, 4, 32, 128, True), (8, 4, 64, 64, True)],
    ids=["int8-hd64", "int4-hd128-bias", "k8v4-hd64-bias"],
)
def test_quantized_ragged_decode_tpu_matches_reference(tpu_interpret, key_bits, value_bits, group, head_dim, bias):
    """int8 / packed int4 keys and values (each in its own bits), G = 2 over T = 2 tokens."""
    rng = np.random.default_rng(4)
    q, k, v, offsets, lengths, slot_bias = _ragged_inputs(rng, OFFSETS, LENGTHS, 4, head_dim, SLOTS, bias)
    used = _used(OFFSETS, LENGTHS, SLOTS)
    k = _quantized(rng, np.nan_to_num(np.asarray(k)), key_bits, group, used)
    v = _quantized(rng, np.nan_to_num(np.asarray(v)), value_bits, group, used)
    call = dict(scale=head_dim**-0.5, num_tokens=2)
    got = ragged_decode(q, k, v, offsets, lengths, slot_bias, **call, impl="pallas", block_k=16)
    _assert_close(got, ragged_decode_reference(q, k, v, offsets, lengths, slot_bias, **call))


def test_decode_attention_tpu_matches_reference(tpu_interpret):
    """A dense cache [B, K, C, H] as a ragged store (offsets k C, C = 20 not a multiple of 8) with a keep mask."""
    rng = np.random.default_rng(2)
    batch, kv_heads, capacity, head_dim = 2, 3, 20, 64
    lengths = jnp.asarray([[0, 1, 15], [16, 17, 20]], jnp.int32)
    filled = np.arange(capacity) < np.asarray(lengths)[..., None]  # [B, K, C]
    k, v = (rng.normal(size=(batch, kv_heads, capacity, head_dim)).astype(np.float32) for _ in range(2))
    k[~filled], v[~filled] = np.nan, np.nan
    q = jnp.asarray(rng.normal(size=(batch, kv_heads, 4, head_dim)), jnp.float32)
    keep = jnp.asarray(rng.random((batch, kv_heads, capacity)) < 0.7)
    call = dict(scale=0.125, num_tokens=2)
    got = decode_attention(q, jnp.asarray(k), jnp.asarray(v), lengths, keep, **call, impl="pallas", block_k=16)
    want = decode_attention_reference(q, jnp.asarray(k), jnp.asarray(v), lengths, keep, **call)
    _assert_close(got, want)


@pytest.mark.parametrize(
    "rows, keys, head_dim, exp", [(20, 30, 128, True), (40, 200, 64, False)], ids=["one-key-block", "two-key-blocks"]
)
def test_score_max_tpu_matches_reference(tpu_interpret, rows, keys, head_dim, exp):
    """Padding rows (bias MASK_VALUE, q NaN) ignored; several row blocks; 200 keys: two blocks of 128 lanes."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 3, rows, head_dim)).astype(np.float32)
    row_bias = rng.normal(size=(2, 3, rows)).astype(np.float32) - 3
    padding = rng.random((2, 3, rows)) < 0.2
    q[padding], row_bias[padding] = np.nan, MASK_VALUE
    k = jnp.asarray(rng.normal(size=(2, 3, keys, head_dim)), jnp.float32)
    q, row_bias = jnp.asarray(q), jnp.asarray(row_bias)
    got = score_max(q, k, row_bias, exp=exp, impl="pallas", block_keys=64, block_rows=16)
    _assert_close([got], [score_max_reference(q, k, row_bias, exp=exp)])


# ------------------------------------------------------------------------------------------------ TPU lowering


def _lowered_for_tpu(fn, *args) -> str:
    """The StableHLO text of fn exported for "tpu" from abstract args under an abstract TPU v5e."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    with use_abstract_mesh(TPU_V5E):
        exported = export.export(jax.jit(fn), platforms=("tpu",))(*shapes)
    return exported.mlir_module()


def _spec(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("head_dim, rows, num_tokens, bias", [(64, 9, 3, False), (128, 21, 3, True), (64, 3, 1, True)])
def test_ragged_decode_lowers_for_tpu(tpu_trace, dtype, head_dim, rows, num_tokens, bias):
    """Model shapes (M = 9 and 21: GQA groups of 3 and 7 over 3 tokens), a store of 777 slots, block_k 64."""
    call = functools.partial(ragged_decode, scale=0.125, num_tokens=num_tokens, impl="pallas", block_k=64)
    store = _spec((2, 777, head_dim), dtype)
    per_head = _spec((2, 3), jnp.int32)
    text = _lowered_for_tpu(
        call, _spec((2, 3, rows, head_dim), dtype), store, store, per_head, per_head, _spec((2, 777)) if bias else None
    )
    assert MOSAIC in text


@pytest.mark.parametrize("key_bits, value_bits", [(8, 8), (4, 4), (8, 4)])
def test_quantized_ragged_decode_lowers_for_tpu(tpu_trace, key_bits, value_bits):
    """Quantized stores at model shapes: H = 128, groups of 32, bfloat16 scales and zero points."""
    call = functools.partial(ragged_decode, scale=0.125, num_tokens=3, impl="pallas", block_k=64)

    def store(bits):
        width = 128 if bits == 8 else 64
        groups = _spec((2, 777, 4), jnp.bfloat16)
        return QuantizedRows(_spec((2, 777, width), jnp.uint8), groups, groups)

    per_head = _spec((2, 3), jnp.int32)
    text = _lowered_for_tpu(
        call, _spec((2, 3, 9, 128), jnp.bfloat16), store(key_bits), store(value_bits), per_head, per_head, None
    )
    assert MOSAIC in text


def test_decode_attention_lowers_for_tpu(tpu_trace):
    call = functools.partial(decode_attention, scale=0.125, impl="pallas")
    cache = _spec((2, 3, 300, 64))
    text = _lowered_for_tpu(
        call, _spec((2, 3, 3, 64)), cache, cache, _spec((2, 3), jnp.int32), _spec((2, 3, 300), bool)
    )
    assert MOSAIC in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_score_max_lowers_for_tpu(tpu_trace, dtype):
    call = functools.partial(score_max, impl="pallas", block_keys=128, block_rows=128)
    text = _lowered_for_tpu(call, _spec((2, 3, 300, 64), dtype), _spec((2, 3, 500, 64), dtype), _spec((2, 3, 300)))
    assert MOSAIC in text
