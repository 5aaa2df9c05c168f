"""The decode kernels over int8 / packed int4 keys and values (pallas_kernels.QuantizedRows), in interpret mode,
against their jnp oracles: odd lengths, an empty head, a bias, several tokens and splits, int8 keys beside int4
values; the kernels' reading of the
format equals kvzip_jax.quant's; and both kernels lower to Triton for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax.quant import groups as quant
from pallas_kernels import (
    MASK_VALUE,
    KernelInputError,
    QuantizedRows,
    decode_attention,
    decode_attention_reference,
    ragged_decode,
    ragged_decode_reference,
)
from pallas_kernels.quantized_rows import dequantize_rows
from pallas_kernels.quantized_rows import parts as parts_of
from pallas_kernels.ragged_decode import _ragged_decode_pallas
from tests.test_kernels import BLOCK, LENGTHS, OFFSETS, STORE_SLOTS, _bias, _query, _used_slots

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _rows(x: np.ndarray, bits: int, group: int, nan_outside=None) -> QuantizedRows:
    """x [..., S, H] quantized by kvzip_jax.quant, as the kernels take it; NaN scales and zeros on unused slots."""
    q = quant.quantize(jnp.asarray(x), quant.QuantFormat(bits=bits, group=group))
    scale, zero = np.asarray(q.scale, np.float32), np.asarray(q.zero, np.float32)
    if nan_outside is not None:
        scale[~nan_outside], zero[~nan_outside] = np.nan, np.nan
    return QuantizedRows(q.codes, jnp.asarray(scale, q.scale.dtype), jnp.asarray(zero, q.zero.dtype))


CASES = [  # bits, group, head dim, tokens, splits, bias
    (8, 16, 16, 1, 1, False),
    (8, 8, 32, 3, 2, True),
    (4, 16, 16, 1, 3, True),
    (4, 8, 32, 2, 1, False),
    (4, 32, 64, 3, 2, True),
]


@pytest.mark.parametrize("bits,group,head_dim,num_tokens,num_splits,with_bias", CASES)
def test_quantized_ragged_decode_matches_its_oracle(bits, group, head_dim, num_tokens, num_splits, with_bias):
    rng = np.random.default_rng(bits * 100 + head_dim + num_tokens)
    used = _used_slots(OFFSETS, LENGTHS, STORE_SLOTS)
    k, v = (_rows(rng.normal(size=(2, STORE_SLOTS, head_dim)), bits, group, used) for _ in range(2))
    q = _query(rng, 3 * num_tokens, head_dim)
    bias = _bias(rng) if with_bias else None
    args = (q, k, v, jnp.asarray(OFFSETS), jnp.asarray(LENGTHS), bias)
    out, lse = ragged_decode(
        *args, scale=head_dim**-0.5, num_tokens=num_tokens, impl="pallas", block_k=BLOCK, num_splits=num_splits
    )
    want_out, want_lse = ragged_decode_reference(*args, scale=head_dim**-0.5, num_tokens=num_tokens)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    np.testing.assert_array_equal(out[0, 2], 0.0)  # the empty head (row 0, head 2)
    np.testing.assert_array_equal(lse[0, 2], MASK_VALUE)


@pytest.mark.parametrize("num_splits,with_bias", [(1, False), (2, True)])
def test_int8_keys_beside_int4_values_match_the_oracle(num_splits, with_bias):
    """k8v4: the keys' parts (int8, groups of 16) order the queries and the logits; the values' (int4, groups of 8)
    order the output; both decode kernels give their oracles' results."""
    rng = np.random.default_rng(84 + num_splits)
    used = _used_slots(OFFSETS, LENGTHS, STORE_SLOTS)
    k = _rows(rng.normal(size=(2, STORE_SLOTS, 32)), 8, 16, used)
    v = _rows(rng.normal(size=(2, STORE_SLOTS, 32)), 4, 8, used)
    q = _query(rng, 6, 32)
    args = (q, k, v, jnp.asarray(OFFSETS), jnp.asarray(LENGTHS), _bias(rng) if with_bias else None)
    out, lse = ragged_decode(*args, scale=0.2, num_tokens=2, impl="pallas", block_k=BLOCK, num_splits=num_splits)
    want_out, want_lse = ragged_decode_reference(*args, scale=0.2, num_tokens=2)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    B, K, C, H = 2, 3, 24, 32
    lengths = jnp.asarray([[0, 13, 24], [5, 17, 1]], jnp.int32)
    dense_k = _rows(rng.normal(size=(B, K, C, H)), 8, 32)
    dense_v = _rows(rng.normal(size=(B, K, C, H)), 4, 16)
    q = _query(rng, 2, H, batch=B, kv_heads=K)
    keep = jnp.asarray(rng.random((B, K, C)) < 0.6)
    got = decode_attention(q, dense_k, dense_v, lengths, keep, scale=0.2, impl="pallas", block_k=16, num_splits=2)
    want = decode_attention_reference(q, dense_k, dense_v, lengths, keep, scale=0.2)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    np.testing.assert_allclose(got[1], want[1], **TOL)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_oracle_reads_the_format_as_quant_writes_it(bits):
    """pallas_kernels dequantizes without importing kvzip_jax: both readings of the same rows agree exactly, and the
    oracle over them equals ragged_decode_reference over quant's dequantized float rows."""
    rng = np.random.default_rng(bits)
    x = rng.normal(size=(2, STORE_SLOTS, 32)) * 3
    q = quant.quantize(jnp.asarray(x), quant.QuantFormat(bits=bits, group=8, scale_dtype="float16"))
    rows = QuantizedRows(q.codes, q.scale, q.zero)
    np.testing.assert_array_equal(np.asarray(dequantize_rows(rows, 32)), np.asarray(quant.dequantize(q)))
    query = _query(rng, 4, 32)
    args = (jnp.asarray(OFFSETS), jnp.asarray(LENGTHS))
    got = ragged_decode_reference(query, rows, rows, *args, scale=0.2)
    floats = quant.dequantize(q)
    want = ragged_decode_reference(query, floats, floats, *args, scale=0.2)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits,masked", [(8, True), (4, False), (4, True)])
def test_quantized_dense_decode_attention_matches_its_oracle(bits, masked):
    rng = np.random.default_rng(7 + bits)
    B, K, C, H = 2, 3, 40, 32
    lengths = jnp.asarray([[0, 13, 40], [5, 33, 1]], jnp.int32)
    k, v = (_rows(rng.normal(size=(B, K, C, H)), bits, 16) for _ in range(2))
    keep = jnp.asarray(rng.random((B, K, C)) < 0.6) if masked else None
    bias = jnp.asarray(rng.normal(size=(B, K, C)), jnp.float32)
    q = _query(rng, 6, H, batch=B, kv_heads=K)
    out, lse = decode_attention(
        q, k, v, lengths, keep, bias, scale=0.2, num_tokens=2, impl="pallas", block_k=16, num_splits=2
    )
    want_out, want_lse = decode_attention_reference(q, k, v, lengths, keep, bias, scale=0.2, num_tokens=2)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


def test_quantized_inputs_are_checked():
    rng = np.random.default_rng(0)
    rows = _rows(rng.normal(size=(2, STORE_SLOTS, 32)), 4, 8)
    q = _query(rng, 2, 32)
    plain = jnp.zeros((2, STORE_SLOTS, 32))
    args = (jnp.asarray(OFFSETS), jnp.asarray(LENGTHS))
    with pytest.raises(KernelInputError, match="both"):
        ragged_decode(q, rows, plain, *args, scale=1.0)
    with pytest.raises(KernelInputError, match="neither int8"):
        ragged_decode(_query(rng, 2, 64), rows, rows, *args, scale=1.0)
    with pytest.raises(KernelInputError, match="scale"):
        bad = QuantizedRows(rows.codes, rows.scale[:, :-1], rows.zero)
        ragged_decode(q, bad, bad, *args, scale=1.0)
    with pytest.raises(KernelInputError, match="slots"):
        fewer = QuantizedRows(*(x[:, :-1] for x in rows))
        ragged_decode(q, rows, fewer, *args, scale=1.0)


@pytest.mark.parametrize("bits", [8, 4, "8/4"])
def test_quantized_kernel_lowers_to_triton(bits):
    """The quantized ragged kernel lowers to a Triton custom call for CUDA at model shapes (H = 64 and 128, group
    64, 32 and int4's default 16, whose parts are 8 columns wide; "8/4": int8 keys in groups of 64 beside int4
    values in the group named): the in-kernel loads, nibble shifts and per-part float32 dots are all
    Triton-expressible."""
    for head_dim, group in [(64, 64), (128, 32), (64, 16), (128, 16)]:
        key_bits, value_bits = (8, 4) if bits == "8/4" else (bits, bits)
        key_group = 64 if bits == "8/4" else group

        def store(bits, group):
            width, groups = head_dim if bits == 8 else head_dim // 2, head_dim // group
            return (
                jax.ShapeDtypeStruct((2, 777, width), jnp.uint8),
                jax.ShapeDtypeStruct((2, 777, groups), jnp.bfloat16),
                jax.ShapeDtypeStruct((2, 777, groups), jnp.bfloat16),
            ), parts_of(head_dim, head_dim // group, bits)

        (keys, key_parts), (values, value_parts) = store(key_bits, key_group), store(value_bits, group)
        decode = functools.partial(
            _ragged_decode_pallas,
            scale=0.125,
            num_tokens=1,
            block_k=64,
            num_splits=4,
            interpret=False,
            parts=(key_parts, value_parts),
        )
        per_head = jax.ShapeDtypeStruct((2, 3), jnp.int32)
        text = (
            jax.jit(decode)
            .trace(jax.ShapeDtypeStruct((2, 3, 7, head_dim), jnp.bfloat16), keys, values, per_head, per_head, None)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert "xla.gpu.triton" in text
