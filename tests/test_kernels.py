"""The Pallas kernels against their jnp oracles, in interpret mode on CPU (impl="pallas").

Shapes are tiny (H = 16 or 32, block 16) so the file runs in well under a minute on two cores. Store slots that no
segment owns, cache slots past a head's length and padding query rows are filled with NaN: any leak of them into an
output shows up as NaN.

Tolerances. float32: atol = rtol = 1e-5 (both sides accumulate in float32 with IEEE products; only the summation
order differs). bfloat16 inputs: the oracle runs on the *same* bf16 values upcast to float32, and a bf16 x bf16
product is exact in float32 (8 + 8 significant bits < 24), so again only the accumulation order differs. The measured
bf16 errors are as small as the float32 ones (ragged_decode: max 4.2e-7 on outputs of unit scale, 4.8e-7 on lse;
score_max: 0), so we assert the float32 tolerance 1e-5. Against float32 inputs the same bf16 kernel differs by ~7e-3
(relative 2^-8 per input rounding), which would need atol ~2e-2.

`test_triton_lowering_on_cpu` lowers both kernels for CUDA without a GPU (Triton's block and dot constraints are
checked at lowering); compiling the Triton IR to GPU code needs a GPU.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import (
    IMPLS,
    KernelInputError,
    decode_attention,
    decode_attention_reference,
    ragged_decode,
    ragged_decode_reference,
    resolve_impl,
    score_max,
    score_max_reference,
)
from pallas_kernels.dispatch import MASK_VALUE, compiler_params, interpret_mode
from pallas_kernels.ragged_decode import _ragged_decode_pallas
from pallas_kernels.score_max import _score_max_pallas

TOL = {"atol": 1e-5, "rtol": 1e-5}
BLOCK = 16

# A store of 100 slots, 2 batch rows x 3 KV heads. Lengths cover 0, 1, BLOCK - 1, BLOCK + 1, a segment filling its
# whole room (row 0 head 1: slots 16..47 up to the next segment) and one ending at the store's end (row 1 head 2),
# where block reads must start early to stay inside the store.
STORE_SLOTS = 100
OFFSETS = np.array([[0, 16, 48], [2, 20, 64]], np.int32)  # [B, K]
LENGTHS = np.array([[15, 32, 0], [1, 17, 36]], np.int32)  # [B, K]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _used_slots(offsets: np.ndarray, lengths: np.ndarray, slots: int) -> np.ndarray:
    """[B, S] bool: slots some head's segment owns."""
    used = np.zeros((offsets.shape[0], slots), bool)
    for b, h in np.ndindex(offsets.shape):
        used[b, offsets[b, h] : offsets[b, h] + lengths[b, h]] = True
    return used


def _store(rng, head_dim, offsets=OFFSETS, lengths=LENGTHS, slots=STORE_SLOTS, dtype=np.float32):
    """k, v [B, S, H] with NaN in every slot outside the segments."""
    used = _used_slots(offsets, lengths, slots)
    k, v = (rng.normal(size=(offsets.shape[0], slots, head_dim)).astype(np.float32) for _ in range(2))
    k[~used], v[~used] = np.nan, np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _bias(rng, offsets=OFFSETS, lengths=LENGTHS, slots=STORE_SLOTS, hidden=0.25):
    """[B, S] float32 bias: normal logit offsets, -inf on a `hidden` fraction of slots, NaN outside the segments."""
    bias = rng.normal(size=(offsets.shape[0], slots)).astype(np.float32)
    bias[rng.random(bias.shape) < hidden] = -np.inf
    bias[~_used_slots(offsets, lengths, slots)] = np.nan
    return jnp.asarray(bias)


def _query(rng, rows, head_dim, dtype=np.float32, batch=2, kv_heads=3):
    return jnp.asarray(rng.normal(size=(batch, kv_heads, rows, head_dim)).astype(np.float32), dtype)


def _assert_finite(*arrays):
    for array in arrays:
        assert np.isfinite(np.asarray(array)).all(), "NaN or inf in a kernel output"


# ---------------------------------------------------------------------------------------------------------- dispatch


def test_resolve_impl_choices_and_error():
    assert IMPLS == ("auto", "xla", "pallas")
    assert resolve_impl("xla") == "xla"
    assert resolve_impl("pallas") == "pallas"
    if jax.default_backend() == "gpu":
        assert not interpret_mode() and isinstance(compiler_params(), pl_triton.CompilerParams)
    else:  # no compiled kernels: the tests force impl="pallas", which runs interpreted
        assert resolve_impl("auto") == "xla"
        assert interpret_mode() and compiler_params() is None
    with pytest.raises(ValueError, match="auto.*xla.*pallas"):
        resolve_impl("triton")


def test_bad_inputs_raise_kernel_input_error():
    rng = _rng(0)
    k, v = _store(rng, 16)
    offsets, lengths = jnp.asarray(OFFSETS), jnp.asarray(LENGTHS)
    call = functools.partial(ragged_decode, scale=1.0, impl="pallas", block_k=BLOCK)
    assert issubclass(KernelInputError, ValueError)
    with pytest.raises(KernelInputError, match="head dim"):  # Triton needs a power-of-two head dim
        k24, v24 = _store(rng, 24)
        call(_query(rng, 3, 24), k24, v24, offsets, lengths)
    with pytest.raises(KernelInputError, match="block_k"):
        call(_query(rng, 3, 16), k, v, offsets, lengths, block_k=24)
    with pytest.raises(KernelInputError, match="num_tokens"):
        call(_query(rng, 4, 16), k, v, offsets, lengths, num_tokens=3)
    with pytest.raises(KernelInputError, match="offsets"):
        call(_query(rng, 3, 16), k, v, offsets[:, :2], lengths)
    with pytest.raises(KernelInputError, match="bias"):
        call(_query(rng, 3, 16), k, v, offsets, lengths, jnp.zeros((2, 7)))
    with pytest.raises(KernelInputError, match="row_bias"):
        score_max(_query(rng, 5, 16), _query(rng, 8, 16), jnp.zeros((2, 3, 4)), impl="pallas")


# ----------------------------------------------------------------------------------------------------- ragged_decode


def _numpy_ragged_decode(q, k, v, offsets, lengths, bias, scale, num_tokens):
    """Per-(row, head, query row) loop in float64 numpy: the definition, to check the jnp oracle itself."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, kv_heads, rows, head_dim = q.shape
    out, lse = np.zeros((batch, kv_heads, rows, head_dim)), np.full((batch, kv_heads, rows), MASK_VALUE)
    for b, h, r in np.ndindex(batch, kv_heads, rows):
        lag = num_tokens - 1 - r % num_tokens
        keys = np.arange(offsets[b, h], offsets[b, h] + max(lengths[b, h] - lag, 0))
        logits = scale * k[b, keys] @ q[b, h, r]
        if bias is not None:
            logits = logits + np.asarray(bias, np.float64)[b, keys]
        if keys.size and np.isfinite(logits).any():
            top = logits.max()
            weights = np.exp(logits - top)
            out[b, h, r] = weights @ v[b, keys] / weights.sum()
            lse[b, h, r] = top + np.log(weights.sum())
    return out, lse


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_reference_matches_numpy_definition(num_tokens):
    rng = _rng(1)
    k, v = _store(rng, 16)
    q = _query(rng, 3 * num_tokens, 16)
    bias = _bias(rng)
    out, lse = ragged_decode_reference(q, k, v, OFFSETS, LENGTHS, bias, scale=0.3, num_tokens=num_tokens)
    want_out, want_lse = _numpy_ragged_decode(q, k, v, OFFSETS, LENGTHS, bias, 0.3, num_tokens)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


# (G query heads per KV head, T new tokens, key splits, bias, head dim)
RAGGED_CASES = [
    (1, 1, 1, False, 16),
    (3, 1, 3, True, 16),
    (7, 1, 1, True, 32),
    (1, 3, 3, True, 16),
    (3, 3, 1, False, 16),
    (7, 3, 3, True, 16),
]


@pytest.mark.parametrize("groups,num_tokens,num_splits,with_bias,head_dim", RAGGED_CASES)
def test_ragged_decode_matches_reference(groups, num_tokens, num_splits, with_bias, head_dim):
    rng = _rng(groups * 10 + num_tokens)
    k, v = _store(rng, head_dim)
    q = _query(rng, groups * num_tokens, head_dim)
    bias = _bias(rng) if with_bias else None
    offsets, lengths = jnp.asarray(OFFSETS), jnp.asarray(LENGTHS)
    scale = head_dim**-0.5
    out, lse = ragged_decode(
        q,
        k,
        v,
        offsets,
        lengths,
        bias,
        scale=scale,
        num_tokens=num_tokens,
        impl="pallas",
        block_k=BLOCK,
        num_splits=num_splits,
    )
    want_out, want_lse = ragged_decode_reference(q, k, v, offsets, lengths, bias, scale=scale, num_tokens=num_tokens)
    chex.assert_shape(out, (2, 3, groups * num_tokens, head_dim))
    chex.assert_shape(lse, (2, 3, groups * num_tokens))
    chex.assert_type([out, lse], jnp.float32)
    _assert_finite(out, lse)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    # The zero-length head (row 0, head 2) is an empty softmax: out 0, lse MASK_VALUE.
    np.testing.assert_array_equal(out[0, 2], 0.0)
    np.testing.assert_array_equal(lse[0, 2], MASK_VALUE)


def test_ragged_decode_bfloat16_inputs():
    rng = _rng(2)
    k, v = _store(rng, 16, dtype=jnp.bfloat16)
    q = _query(rng, 6, 16, dtype=jnp.bfloat16)
    bias = _bias(rng)
    out, lse = ragged_decode(
        q, k, v, OFFSETS, LENGTHS, bias, scale=0.25, num_tokens=3, impl="pallas", block_k=BLOCK, num_splits=3
    )
    # The oracle on the same bf16 values upcast: only the float32 accumulation order differs (module docstring).
    want_out, want_lse = ragged_decode_reference(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        OFFSETS,
        LENGTHS,
        bias,
        scale=0.25,
        num_tokens=3,
    )
    chex.assert_type([out, lse], jnp.float32)
    _assert_finite(out, lse)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


def test_ragged_decode_all_keys_hidden_by_bias():
    rng = _rng(3)
    k, v = _store(rng, 16)
    q = _query(rng, 3, 16)
    bias = np.array(_bias(rng, hidden=0.0))
    bias[1] = -np.inf  # batch row 1: every slot hidden, so all its heads see nothing
    for impl in ("pallas", "xla"):
        out, lse = ragged_decode(
            q, k, v, OFFSETS, LENGTHS, jnp.asarray(bias), scale=0.25, impl=impl, block_k=BLOCK, num_splits=3
        )
        _assert_finite(out, lse)
        np.testing.assert_array_equal(out[1], 0.0)
        np.testing.assert_array_equal(lse[1], MASK_VALUE)
        assert np.all(np.asarray(lse[0, :2]) > MASK_VALUE)  # row 0's non-empty heads are untouched


def test_ragged_decode_default_splits_and_small_store():
    """num_splits=None, and a store smaller than one block (the wrapper pads it to block_k slots)."""
    rng = _rng(4)
    offsets, lengths = np.array([[0, 5]], np.int32), np.array([[5, 6]], np.int32)
    k, v = _store(rng, 16, offsets, lengths, slots=12)
    q = _query(rng, 2, 16, batch=1, kv_heads=2)
    out, lse = ragged_decode(q, k, v, offsets, lengths, scale=0.25, impl="pallas", block_k=BLOCK)
    want_out, want_lse = ragged_decode_reference(q, k, v, offsets, lengths, scale=0.25)
    _assert_finite(out, lse)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


@pytest.mark.parametrize("first_len", [0, 13])
def test_merged_segments_equal_softmax_over_union(first_len):
    """(out, lse) of two disjoint segments, merged by their lse, equal one softmax over the union."""
    rng = _rng(5)
    union_len = 40
    offsets = np.array([[8, 8 + first_len, 8]], np.int32)  # heads: first part, second part, union
    lengths = np.array([[first_len, union_len - first_len, union_len]], np.int32)
    k, v = _store(rng, 16, offsets, lengths, slots=64)
    q = jnp.broadcast_to(_query(rng, 4, 16, batch=1, kv_heads=1), (1, 3, 4, 16))  # the same queries for all heads
    out, lse = ragged_decode(q, k, v, offsets, lengths, scale=0.25, impl="pallas", block_k=BLOCK, num_splits=3)
    merged_lse = jnp.logaddexp(lse[0, 0], lse[0, 1])  # [M]
    merged = (
        out[0, 0] * jnp.exp(lse[0, 0] - merged_lse)[:, None] + out[0, 1] * jnp.exp(lse[0, 1] - merged_lse)[:, None]
    )  # [M, H]
    np.testing.assert_allclose(merged, out[0, 2], **TOL)
    np.testing.assert_allclose(merged_lse, lse[0, 2], **TOL)


def test_ragged_decode_jit_matches_eager():
    rng = _rng(6)
    k, v = _store(rng, 16)
    q = _query(rng, 9, 16)
    bias = _bias(rng)
    call = functools.partial(ragged_decode, scale=0.25, num_tokens=3, impl="pallas", block_k=BLOCK, num_splits=3)
    eager = call(q, k, v, OFFSETS, LENGTHS, bias)
    jitted = jax.jit(call)(q, k, v, jnp.asarray(OFFSETS), jnp.asarray(LENGTHS), bias)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, **TOL)


# -------------------------------------------------------------------------------------------------- decode_attention


def _dense_cache(rng, lengths, capacity, head_dim, dtype=np.float32):
    """k, v [B, K, C, H] with NaN in the slots past each head's length."""
    batch, kv_heads = lengths.shape
    k, v = (rng.normal(size=(batch, kv_heads, capacity, head_dim)).astype(np.float32) for _ in range(2))
    empty = np.arange(capacity) >= lengths[..., None]  # [B, K, C]
    k[empty], v[empty] = np.nan, np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize("num_tokens,num_splits,masked", [(1, 1, False), (3, 3, True)])
def test_decode_attention_dense_as_ragged(num_tokens, num_splits, masked):
    rng = _rng(7)
    capacity = 40
    lengths = np.array([[0, 17, 40], [15, 1, 33]], np.int32)  # [B, K]
    k, v = _dense_cache(rng, lengths, capacity, 16)
    q = _query(rng, 3 * num_tokens, 16)
    keep = None
    if masked:
        keep = rng.random((2, 3, capacity)) > 0.3  # [B, K, C]
        keep[1, 2] = False  # a head whose every slot is masked out
        keep = jnp.asarray(keep)
    call = functools.partial(decode_attention, scale=0.25, num_tokens=num_tokens, block_k=BLOCK, num_splits=num_splits)
    out, lse = call(q, k, v, lengths, keep, impl="pallas")
    want_out, want_lse = decode_attention_reference(q, k, v, lengths, keep, scale=0.25, num_tokens=num_tokens)
    chex.assert_shape(out, (2, 3, 3 * num_tokens, 16))
    _assert_finite(out, lse)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)
    # The XLA path (ragged oracle on the reshaped cache) agrees with the independent dense oracle.
    xla_out, xla_lse = call(q, k, v, lengths, keep, impl="xla")
    np.testing.assert_allclose(xla_out, want_out, **TOL)
    np.testing.assert_allclose(xla_lse, want_lse, **TOL)
    np.testing.assert_array_equal(out[0, 0], 0.0)  # zero length
    if masked:
        np.testing.assert_array_equal(out[1, 2], 0.0)
        np.testing.assert_array_equal(lse[1, 2], MASK_VALUE)


def test_decode_attention_bfloat16_inputs():
    rng = _rng(8)
    lengths = np.array([[3, 40, 21]], np.int32)
    k, v = _dense_cache(rng, lengths, 40, 32, dtype=jnp.bfloat16)
    q = _query(rng, 7, 32, dtype=jnp.bfloat16, batch=1)
    out, lse = decode_attention(q, k, v, lengths, scale=32**-0.5, impl="pallas", block_k=BLOCK, num_splits=3)
    want_out, want_lse = decode_attention_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths, scale=32**-0.5
    )
    _assert_finite(out, lse)
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_allclose(lse, want_lse, **TOL)


# --------------------------------------------------------------------------------------------------------- score_max


def _score_inputs(rng, rows, keys, head_dim, padding_rows=0, dtype=np.float32):
    """Scaled q [1, 2, R, H], k [1, 2, S, H] and row_bias = -lse of each row over the keys (so scores <= 1).

    The last `padding_rows` rows are padding: q NaN, row_bias MASK_VALUE.
    """
    q = (rng.normal(size=(1, 2, rows, head_dim)) * head_dim**-0.5).astype(np.float32)
    k = rng.normal(size=(1, 2, keys, head_dim)).astype(np.float32)
    q, k = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k))  # values representable in dtype
    lse = np.log(np.exp(np.einsum("bkrh,bksh->bkrs", q, k)).sum(-1))  # [1, 2, R]
    row_bias = (-lse).astype(np.float32)
    if padding_rows:
        q[:, :, -padding_rows:] = np.nan
        row_bias[:, :, -padding_rows:] = MASK_VALUE
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(row_bias)


@pytest.mark.parametrize("exp", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_score_max_matches_reference(exp, dtype):
    rng = _rng(9)
    q, k, row_bias = _score_inputs(rng, rows=45, keys=50, head_dim=16, padding_rows=4, dtype=dtype)
    got = score_max(q, k, row_bias, exp=exp, impl="pallas", block_keys=BLOCK, block_rows=BLOCK)
    # For bf16 the oracle sees the same bf16 values upcast (module docstring).
    want = score_max_reference(q.astype(jnp.float32), k.astype(jnp.float32), row_bias, exp=exp)
    chex.assert_shape(got, (1, 2, 50))
    chex.assert_type(got, jnp.float32)
    _assert_finite(got)
    np.testing.assert_allclose(got, want, **TOL)
    if exp:
        assert np.all(np.asarray(got) <= 1 + 1e-6)  # probabilities


def test_score_max_all_rows_padding():
    rng = _rng(10)
    q, k, _ = _score_inputs(rng, rows=20, keys=16, head_dim=16)
    row_bias = jnp.full((1, 2, 20), MASK_VALUE)
    got = score_max(q, k, row_bias, impl="pallas", block_keys=BLOCK, block_rows=BLOCK)
    np.testing.assert_array_equal(got, 0.0)


@pytest.mark.parametrize("budget", [0.1, 0.3, 0.5])
def test_score_max_top_k_kept_set(budget):
    rng = _rng(11)
    q, k, row_bias = _score_inputs(rng, rows=48, keys=80, head_dim=32)
    got = score_max(q, k, row_bias, impl="pallas", block_keys=32, block_rows=BLOCK)
    want = score_max_reference(q, k, row_bias)
    kept = int(budget * 80)
    for h in range(2):
        got_set = set(np.argsort(-np.asarray(got[0, h]))[:kept])
        want_set = set(np.argsort(-np.asarray(want[0, h]))[:kept])
        assert got_set == want_set


def test_score_max_jit_matches_eager():
    rng = _rng(12)
    q, k, row_bias = _score_inputs(rng, rows=30, keys=40, head_dim=16, padding_rows=2)
    call = functools.partial(score_max, impl="pallas", block_keys=BLOCK, block_rows=BLOCK)
    np.testing.assert_allclose(call(q, k, row_bias), jax.jit(call)(q, k, row_bias), **TOL)


# ------------------------------------------------------------------------------------------------ Triton lowering


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_lowering_on_cpu(dtype):
    """Both kernels lower to a Triton custom call for CUDA at model shapes (H = 64 and 128, M = 9 and 21)."""

    def lowered(fn, *shapes):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    def spec(shape, spec_dtype=dtype):
        return jax.ShapeDtypeStruct(shape, spec_dtype)

    per_head = spec((2, 3), jnp.int32)  # offsets, lengths
    for head_dim, rows, num_tokens, bias in [(64, 9, 3, None), (128, 21, 3, spec((2, 777), jnp.float32))]:
        decode = functools.partial(
            _ragged_decode_pallas,
            scale=0.125,
            num_tokens=num_tokens,
            block_k=64,
            num_splits=4,
            interpret=False,
            parts=None,
        )
        store = (spec((2, 777, head_dim)),)
        text = lowered(decode, spec((2, 3, rows, head_dim)), store, store, per_head, per_head, bias)
        assert "xla.gpu.triton" in text
        score = functools.partial(_score_max_pallas, exp=True, block_keys=64, block_rows=64, interpret=False)
        text = lowered(score, spec((2, 3, 300, head_dim)), spec((2, 3, 500, head_dim)), spec((2, 3, 300), jnp.float32))
        assert "xla.gpu.triton" in text


def _tf32(x):
    """x rounded to TF32 (10 mantissa bits), what a Triton float32 dot multiplies unless asked for IEEE."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + 0x1000) & np.uint32(0xFFFFE000)).view(np.float32)


def test_the_float32_tolerance_would_notice_tf32_dots():
    """On a GPU the same tests compile the kernels (interpret_mode() is False there); a dot left at TF32 would miss
    the 1e-5 tolerance by far, as this oracle run on TF32-rounded inputs shows."""
    rng = _rng(7)
    k, v = _store(rng, 32)
    q = _query(rng, 3, 32)
    offsets, lengths = jnp.asarray(OFFSETS), jnp.asarray(LENGTHS)
    exact, _ = ragged_decode_reference(q, k, v, offsets, lengths, scale=32**-0.5)
    rounded, _ = ragged_decode_reference(
        jnp.asarray(_tf32(q)), jnp.asarray(_tf32(k)), jnp.asarray(_tf32(v)), offsets, lengths, scale=32**-0.5
    )
    assert np.abs(np.asarray(rounded) - np.asarray(exact)).max() > 10 * TOL["atol"]
