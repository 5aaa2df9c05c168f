"""Decode attention over per-(row, KV head) segments of a flat key/value store.

Einsum legend:
  B batch rows, K KV heads, G query heads per KV head, T new tokens per step, M = G T query rows per KV head (row
  r = g T + t), S store slots, H head dim, NS key splits (flash-decoding split-K), Mp = M padded to a power of two
  >= 16 (Triton dot tiles).

Head k of batch row b owns store slots [offsets[b, k], offsets[b, k] + lengths[b, k]); its local key i is store slot
offsets[b, k] + i. The T new tokens of a step are the last T keys of each segment (already written), so query token t
sees local keys i < lengths - (T - 1 - t). A per-slot bias [B, S] is added to the logits (-inf hides a key).

The kernel's cost follows the segment lengths, not S: grid (B, K, NS); program (b, k, s) reads its head's offset and
length and loops over blocks of block_k keys of its split only, with an online softmax in float32. The NS partial
results are merged in jnp afterwards.

Keys and values may be group-quantized (int8, or int4 two per byte: quantized_rows.QuantizedRows): each block is
dequantized inside the kernel, group by group, so the store is read at its quantized size; keys and values may
differ in bits and groups (int8 keys beside int4 values).

On a TPU (dispatch.lowering() "mosaic") ragged_decode_tpu.py's kernel runs instead, quantized stores included: grid
(B, K, key blocks), no split-K.

Empty softmax (zero-length segment, or every key hidden by the causal bound or the bias): out = 0 and
lse = MASK_VALUE (finite, so merging it with another segment's (out, lse) gives that segment's result exactly).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import online_softmax
from . import quantized_rows as qrows
from .dispatch import (
    MASK_VALUE,
    KernelInputError,
    check_power_of_two,
    compiler_params,
    interpret_mode,
    kernel_dot,
    lowering,
    next_power_of_two,
    resolve_impl,
)
from .ragged_decode_tpu import ragged_decode_mosaic

# Programs the default split count aims for: one per SM of an H200 (132); more programs than that only queue.
TARGET_PROGRAMS = 132
MAX_SPLITS = 16


def default_num_splits(batch: int, kv_heads: int) -> int:
    """Static split count: enough (b, k, split) programs to fill a GPU, 1 in interpret mode (grid steps cost time)."""
    if interpret_mode():
        return 1
    return min(max(-(-TARGET_PROGRAMS // (batch * kv_heads)), 1), MAX_SPLITS)


def _check_inputs(q, k, v, offsets, lengths, bias, num_tokens) -> None:
    """Raise KernelInputError on inconsistent shapes (see ragged_decode)."""
    if isinstance(k, qrows.QuantizedRows) != isinstance(v, qrows.QuantizedRows):
        raise KernelInputError("k and v must both be arrays or both be QuantizedRows")
    if isinstance(k, qrows.QuantizedRows):  # keys and values may differ in bits and groups (k8v4)
        if k.codes.shape[:-1] != v.codes.shape[:-1]:
            raise KernelInputError(f"v codes {v.codes.shape} must hold k's slots {k.codes.shape[:-1]}")
        qrows.bits_of(k, q.shape[-1])
        qrows.bits_of(v, q.shape[-1])
        k_shape = k.codes.shape[:2] + (q.shape[-1],)
    else:
        k_shape = k.shape
        if v.shape != k.shape:
            raise KernelInputError(f"v {v.shape} must have k's shape {k.shape}")
    if q.ndim != 4 or len(k_shape) != 3:
        raise KernelInputError(f"q must be [B, K, M, H] and k [B, S, H], got {q.shape} and {k_shape}")
    batch, kv_heads, rows, head_dim = q.shape
    if k_shape[0] != batch or k_shape[2] != head_dim:
        raise KernelInputError(f"k {k_shape} does not match q {q.shape} (batch and head dim)")
    if offsets.shape != (batch, kv_heads) or lengths.shape != (batch, kv_heads):
        raise KernelInputError(
            f"offsets {offsets.shape} and lengths {lengths.shape} must be [B, K] = {(batch, kv_heads)}"
        )
    if bias is not None and bias.shape != k_shape[:2]:
        raise KernelInputError(f"bias {bias.shape} must be [B, S] = {k_shape[:2]}")
    if num_tokens < 1 or rows % num_tokens:
        raise KernelInputError(f"num_tokens {num_tokens} must be >= 1 and divide the query rows M = {rows}")


def ragged_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets: jax.Array,
    lengths: jax.Array,
    bias: jax.Array | None = None,
    *,
    scale: float,
    num_tokens: int = 1,
    impl: str = "auto",
    block_k: int = 64,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each head's query rows over its own segment of the store.

    Args:
      q: [B, K, M, H] query rows per KV head, any float dtype; M = G T, row r = g T + t.
      k, v: [B, S, H] the flat store (bfloat16 or float32), or both QuantizedRows (codes [B, S, H] int8 or
        [B, S, H / 2] packed int4, scale and zero [B, S, N]; keys and values each in their own bits and groups).
        Slots outside every segment may hold anything (NaN).
      offsets, lengths: [B, K] integer: head k of row b owns slots [offsets, offsets + lengths); lengths may be 0;
        offsets + lengths <= S.
      bias: [B, S] float32 additive logit bias per slot, or None; -inf hides a slot.
      scale: static logit scale (1 / sqrt(H) for plain attention).
      num_tokens: T, new tokens per step (static); queries are causal over the last T keys of each segment.
      impl: "auto" | "xla" | "pallas" (see dispatch.resolve_impl); "pallas" needs H a power of two >= 16.
      block_k: keys per kernel block, a power of two >= 16.
      num_splits: key splits per head (static), default `default_num_splits(B, K)`; the TPU kernel has none.

    Returns:
      out [B, K, M, H] float32 (softmax-weighted values, 0 for an empty softmax) and lse [B, K, M] float32, the
      natural-log normaliser log(sum exp(logits)) over visible keys (MASK_VALUE for an empty softmax).
    """
    _check_inputs(q, k, v, offsets, lengths, bias, num_tokens)
    if resolve_impl(impl) == "xla":
        return ragged_decode_reference(q, k, v, offsets, lengths, bias, scale=scale, num_tokens=num_tokens)
    head_dim = q.shape[3]
    check_power_of_two("head dim H", head_dim)
    check_power_of_two("block_k", block_k)
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], q.shape[1])
    if num_splits < 1:
        raise KernelInputError(f"num_splits must be >= 1, got {num_splits}")
    parts, out_order = None, None
    if isinstance(k, qrows.QuantizedRows):  # the kernel works in the parts' column orders (quantized_rows.py): the
        # queries in the keys', the outputs in the values'
        layout = lambda rows: (rows.scale.shape[-1], qrows.bits_of(rows, head_dim))  # (groups, bits)
        parts = (qrows.parts(head_dim, *layout(k)), qrows.parts(head_dim, *layout(v)))
        q = q[..., qrows.column_order(head_dim, *layout(k))]
        out_order = qrows.column_order(head_dim, *layout(v))
    int32 = lambda x: x.astype(jnp.int32)
    args = (q, tuple(k) if parts else (k,), tuple(v) if parts else (v,), int32(offsets), int32(lengths), bias)
    common = dict(scale=float(scale), num_tokens=num_tokens, block_k=block_k, parts=parts)
    if lowering() == "mosaic":
        out, lse = ragged_decode_mosaic(*args, **common, interpret=False)
    else:
        out, lse = _ragged_decode_pallas(*args, **common, num_splits=num_splits, interpret=interpret_mode())
    return (out, lse) if out_order is None else (out[..., np.argsort(out_order)], lse)


def _ragged_decode_kernel(*refs, scale, num_tokens, block_k, num_splits, parts, has_bias):
    """One (b, k, split) program: online softmax over the split's key blocks of head k's segment.

    Refs: q [Mp, H]; k, v each [S, H] (the whole store row, read block by block) or, quantized, (codes, scale,
    zero) with `parts` = (the keys' static column parts, the values'); off, len [] int32; optional bias [S];
    outputs o [Mp, H] (unnormalised, in the values' column order), l [Mp] (sum of exp), m [Mp] (running max), all
    float32.
    """
    per_store = 3 if parts else 1
    q_ref = refs[0]
    k_refs, v_refs = refs[1 : 1 + per_store], refs[1 + per_store : 1 + 2 * per_store]
    off_ref, len_ref = refs[1 + 2 * per_store : 3 + 2 * per_store]
    bias_ref = refs[3 + 2 * per_store] if has_bias else None
    o_ref, l_ref, m_ref = refs[-3:]
    store_slots = k_refs[0].shape[0]
    offset = off_ref[()]
    length = len_ref[()]
    # The split's local key range [lo, hi): splits of equal whole-block size, the last one short or empty.
    split_len = pl.cdiv(pl.cdiv(length, num_splits), block_k) * block_k
    lo = pl.program_id(2) * split_len
    hi = jnp.minimum(length, lo + split_len)
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)

    rows, head_dim = q_ref.shape
    if parts:  # dequantized float32 parts: the queries' columns matching the keys' parts, loaded once
        k_parts, v_parts = parts
        q_parts = [q_ref[:, pl.ds(part.column, part.width)].astype(jnp.float32) for part in k_parts]
    else:
        q_parts = [q_ref[...].astype(jnp.promote_types(q_ref.dtype, k_refs[0].dtype))]  # [Mp, H]
        k_parts = v_parts = (qrows.Part(0, head_dim, 0, None, 0),)
    # Query row r is token t = r % T, which sees local keys below length - (T - 1 - t).
    row_limit = length - (num_tokens - 1 - jnp.arange(rows, dtype=jnp.int32) % num_tokens)  # [Mp]

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        first = lo + i * block_k  # local index of the block's first key
        # Read a whole block inside the store: near its end the read starts earlier and the keys before `first`
        # (already counted, or another head's) are masked out by index.
        start = jnp.minimum(offset + first, store_slots - block_k)
        key = start - offset + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] local key index
        key_in = (key >= first) & (key < hi)  # [block_k]
        visible = key_in[None, :] & (key[None, :] < row_limit[:, None])  # [Mp, block_k]

        logits = scale * sum(
            kernel_dot(q_part, load(k_refs, start, part, q_part.dtype), transpose_b=True)
            for q_part, part in zip(q_parts, k_parts)
        )  # [Mp, block_k]
        if bias_ref is not None:
            logits = logits + bias_ref[pl.ds(start, block_k)][None, :]
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))  # [Mp]
        correction = jnp.exp(m_prev - m_next)  # [Mp]
        p = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)  # [Mp, block_k]
        # Slots outside the segment may hold NaN, and 0 * NaN = NaN: zero them before p @ v.
        v_blks = [
            jnp.where(key_in[:, None], load(v_refs, start, part, jnp.float32), 0.0)  # [block_k, width]
            for part in v_parts
        ]
        l_next = correction * l_prev + p.sum(axis=1)
        acc_next = tuple(correction[:, None] * acc + kernel_dot(p, v_blk) for acc, v_blk in zip(acc_prev, v_blks))
        return m_next, l_next, acc_next

    def load(store_refs, start, part, dtype):  # [block_k, width]
        if len(store_refs) == 3:
            return qrows.load_part(store_refs, start, block_k, part)
        return store_refs[0][pl.ds(start, block_k), :].astype(dtype)

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),  # m [Mp]
        jnp.zeros((rows,), jnp.float32),  # l [Mp]
        tuple(jnp.zeros((rows, part.width), jnp.float32) for part in v_parts),  # acc [Mp, width] per value part
    )
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    for part, acc_part in zip(v_parts, acc):
        o_ref[:, pl.ds(part.column, part.width)] = acc_part
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("scale", "num_tokens", "block_k", "num_splits", "interpret", "parts"))
def _ragged_decode_pallas(q, k, v, offsets, lengths, bias, *, scale, num_tokens, block_k, num_splits, interpret, parts):
    """The pallas_call and the merge of its splits; arguments as ragged_decode's, already checked, with k and v
    tuples of store arrays [B, S, .] (one, or the quantized triple) and parts None or (the keys' static column
    parts, the values')."""
    batch, kv_heads, rows, head_dim = q.shape
    padded_rows = max(16, next_power_of_two(rows))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [B, K, Mp, H]
    if k[0].shape[1] < block_k:  # a block read must fit in the store
        grow = lambda x: jnp.pad(x, ((0, 0), (0, block_k - x.shape[1]), (0, 0)))  # [B, block_k, .]
        k, v = tuple(map(grow, k)), tuple(map(grow, v))
        if bias is not None:
            bias = jnp.pad(bias, ((0, 0), (0, block_k - bias.shape[1])))  # [B, block_k]
    slots = k[0].shape[1]

    head_scalar = pl.BlockSpec((None, None), lambda b, h, s: (b, h))
    store_spec = lambda x: pl.BlockSpec((None, slots, x.shape[2]), lambda b, h, s: (b, 0, 0))
    in_specs = [
        pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        *map(store_spec, k),
        *map(store_spec, v),
        head_scalar,
        head_scalar,
    ]
    args = [q, *k, *v, offsets, lengths]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, slots), lambda b, h, s: (b, 0)))
        args.append(bias.astype(jnp.float32))
    split_rows = pl.BlockSpec((None, None, None, padded_rows), lambda b, h, s: (s, b, h, 0))
    kernel = functools.partial(
        _ragged_decode_kernel,
        scale=scale,
        num_tokens=num_tokens,
        block_k=block_k,
        num_splits=num_splits,
        parts=parts,
        has_bias=bias is not None,
    )
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, padded_rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            split_rows,
            split_rows,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, padded_rows, head_dim), jnp.float32),  # o
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, padded_rows), jnp.float32),  # l
            jax.ShapeDtypeStruct((num_splits, batch, kv_heads, padded_rows), jnp.float32),  # m
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
    )(*args)

    # Merge the splits. The barrier keeps XLA from rewriting the max into the exps (NaN after jit in jax's
    # decode_attention, b/389925439).
    m_max = jax.lax.optimization_barrier(m.max(axis=0))  # [B, K, Mp]
    weight = jnp.exp(m - m_max)  # [NS, B, K, Mp]
    l_sum = (l * weight).sum(axis=0)  # [B, K, Mp]
    o_sum = (o * weight[..., None]).sum(axis=0)  # [B, K, Mp, H]
    out, lse = online_softmax.finish(m_max, l_sum, o_sum)  # [B, K, Mp, H], [B, K, Mp]
    return out[:, :, :rows], lse[:, :, :rows]


def ragged_decode_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    offsets: jax.Array,
    lengths: jax.Array,
    bias: jax.Array | None = None,
    *,
    scale: float,
    num_tokens: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """The plain jnp oracle of ragged_decode (same arguments and results), float32 with HIGHEST precision.

    Materialises the [B, K, M, S] logits with a per-head mask over the whole store (quantized rows dequantized
    whole): fine for decode (M small).
    """
    _check_inputs(q, k, v, offsets, lengths, bias, num_tokens)
    if isinstance(k, qrows.QuantizedRows):
        k, v = (qrows.dequantize_rows(x, q.shape[-1]) for x in (k, v))
    rows = q.shape[2]
    local = jnp.arange(k.shape[1])[None, None, :] - offsets[..., None]  # [B, K, S] local key index of each slot
    in_segment = (local >= 0) & (local < lengths[..., None])  # [B, K, S]
    lag = num_tokens - 1 - jnp.arange(rows) % num_tokens  # [M] keys a row's token may not see at the segment end
    visible = in_segment[:, :, None, :] & (local[:, :, None, :] < (lengths[..., None] - lag)[..., None])  # [B, K, M, S]
    used = in_segment.any(axis=1)[..., None]  # [B, S, 1] slots some head owns; the others may hold NaN
    k32 = jnp.where(used, k.astype(jnp.float32), 0.0)  # [B, S, H]
    v32 = jnp.where(used, v.astype(jnp.float32), 0.0)  # [B, S, H]
    logits = scale * jnp.einsum(
        "BKMH,BSH->BKMS", q.astype(jnp.float32), k32, precision=jax.lax.Precision.HIGHEST
    )  # [B, K, M, S]
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)[:, None, None, :]
    m, p = online_softmax.exp_from_row_max(jnp.where(visible, logits, -jnp.inf))  # [B, K, M], [B, K, M, S]
    o = jnp.einsum("BKMS,BSH->BKMH", p, v32, precision=jax.lax.Precision.HIGHEST)  # [B, K, M, H]
    return online_softmax.finish(m, p.sum(axis=-1), o)
