"""ragged_decode's TPU kernel (Mosaic): one program per (batch row, KV head, key block), no split-K.

Einsum legend:
  B batch rows, K KV heads, M query rows per KV head (row r = g T + t), Mp = M padded to a multiple of 8 (sublanes),
  S store slots, Sp = S padded to a multiple of 8 and at least block_k, H head dim, NB key blocks per head.

Same arguments and results as ragged_decode, quantized stores included (dequantized block by block, part by part,
as in ragged_decode.py). Offsets and lengths are scalar-prefetched into SMEM; the grid is (B, K, NB) with NB the most
blocks any segment can span, its last axis "arbitrary": program (b, k, j) reads the store rows [start, start +
block_k) chosen by the index map from head k's offset, where the first block starts at the offset rounded down to a
multiple of 8 (aligned DMAs) and the start is clamped to the last whole block inside the store. Steps past a head's
last block repeat that block's index (the pipeline issues no new copy) and skip their compute (`pl.when`). The online
softmax keeps m, l [Mp, 1] and acc [Mp, H] in float32 VMEM scratch; keys outside the segment (or already seen, when
the clamp moves a block back) are masked by slot index, and their value rows zeroed (unused slots may hold NaN, and
0 x NaN = NaN).

The per-slot bias travels as a column [Sp, 1] (a 1-D row of the store cannot be cut at dynamic, unaligned lane
offsets) and is turned into a row [1, block_k] in the kernel by a diagonal select and a sublane sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import online_softmax
from . import quantized_rows as qrows
from .dispatch import MASK_VALUE, kernel_dot, mosaic_compiler_params, mosaic_interpret_params, round_up

SUBLANES = 8  # rows of a float32 vreg tile: the alignment of DMA starts and of the row padding


def _segment(off_ref, len_ref, b, h, kv_heads):
    """(offset, length, first aligned slot) of head h of row b, from the prefetched [B K] scalars."""
    offset = off_ref[b * kv_heads + h]
    length = len_ref[b * kv_heads + h]
    return offset, length, offset - offset % SUBLANES


def _block_start(b, h, j, off_ref, len_ref, *, kv_heads, block_k, slots):
    """First store row of step j's block: j clamped to the head's last block, the start to the store."""
    offset, length, base = _segment(off_ref, len_ref, b, h, kv_heads)
    last = jnp.maximum(pl.cdiv(offset - base + length, block_k) - 1, 0)
    return jnp.minimum(base + jnp.minimum(j, last) * block_k, slots - block_k)


def _kernel(off_ref, len_ref, q_ref, *refs, scale, num_tokens, block_k, kv_heads, slots, parts, has_bias):
    """One (b, k, j) step of head k's online softmax.

    Refs: off, len [B K] int32 (SMEM); q [Mp, H]; k, v each [block_k, H] or, quantized, (codes, scale, zero) blocks
    with `parts` = (the keys' static column parts, the values'); optional bias [block_k, 1] float32; outputs
    o [Mp, H] (unnormalised, in the values' column order), l [Mp, 1], m [Mp, 1] float32, written at the last step;
    scratch m, l [Mp, 1] and acc [Mp, H] float32.
    """
    per_store = 3 if parts else 1
    k_refs, v_refs = refs[:per_store], refs[per_store : 2 * per_store]
    bias_ref = refs[2 * per_store] if has_bias else None
    o_ref, l_ref, m_ref, m_scr, l_scr, acc_scr = refs[-6:]
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    offset, length, base = _segment(off_ref, len_ref, b, h, kv_heads)
    first = base + j * block_k  # the step's first slot before the clamp: slots below it were seen (or are not ours)
    rows, head_dim = q_ref.shape

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(first < offset + length)
    def _step():
        start = jnp.minimum(first, slots - block_k)
        slot_col = start + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [block_k, 1]
        slot_row = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)  # [Mp, block_k]
        ours = lambda slot: (slot >= first) & (slot >= offset) & (slot < offset + length)
        # Query row r is token t = r % T, which sees local keys below length - (T - 1 - t).
        lag = num_tokens - 1 - jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) % num_tokens  # [Mp, block_k]
        visible = ours(slot_row) & (slot_row - offset < length - lag)  # [Mp, block_k]

        if parts:  # dequantized float32 parts: the queries' columns matching the keys' parts
            k_parts, v_parts = parts
            q_parts = [q_ref[:, pl.ds(part.column, part.width)].astype(jnp.float32) for part in k_parts]
        else:
            q_parts = [q_ref[...].astype(jnp.promote_types(q_ref.dtype, k_refs[0].dtype))]  # [Mp, H]
            k_parts = v_parts = (qrows.Part(0, head_dim, 0, None, 0),)
        load = lambda store_refs, part, dtype: (  # [block_k, width]
            qrows.load_part(store_refs, 0, block_k, part) if parts else store_refs[0][...].astype(dtype)
        )
        logits = scale * sum(
            kernel_dot(q_part, load(k_refs, part, q_part.dtype), transpose_b=True)
            for q_part, part in zip(q_parts, k_parts)
        )  # [Mp, block_k]
        if bias_ref is not None:
            diagonal = jax.lax.broadcasted_iota(jnp.int32, (block_k, block_k), 0) == jax.lax.broadcasted_iota(
                jnp.int32, (block_k, block_k), 1
            )  # [block_k, block_k]
            logits = logits + jnp.sum(jnp.where(diagonal, bias_ref[...], 0.0), axis=0, keepdims=True)  # [1, block_k]
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_prev = m_scr[...]  # [Mp, 1]
        m_next = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))  # [Mp, 1]
        correction = jnp.exp(m_prev - m_next)  # [Mp, 1]
        p = jnp.where(visible, jnp.exp(logits - m_next), 0.0)  # [Mp, block_k]
        l_scr[...] = correction * l_scr[...] + p.sum(axis=1, keepdims=True)
        for part in v_parts:
            values = jnp.where(ours(slot_col), load(v_refs, part, jnp.float32), 0.0)  # [block_k, width]
            columns = pl.ds(part.column, part.width)
            acc_scr[:, columns] = correction * acc_scr[:, columns] + kernel_dot(p, values)
        m_scr[...] = m_next

    @pl.when(j == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = acc_scr[...]
        l_ref[...] = l_scr[...]
        m_ref[...] = m_scr[...]


@functools.partial(jax.jit, static_argnames=("scale", "num_tokens", "block_k", "interpret", "parts"))
def ragged_decode_mosaic(q, k, v, offsets, lengths, bias, *, scale, num_tokens, block_k, interpret, parts=None):
    """(out [B, K, M, H], lse [B, K, M]) float32, as ragged_decode's, for checked inputs q [B, K, M, H], k and v
    tuples of store arrays [B, S, .] (one float store, or the quantized (codes, scale, zero) with q and out in the
    column orders of `parts` = (the keys' static column parts, the values')), offsets, lengths [B, K] int, bias
    [B, S] or None; block_k a multiple of 8; interpret: run in Pallas TPU interpret mode (on any host) instead of
    lowering to Mosaic."""
    batch, kv_heads, rows, head_dim = q.shape
    slots = k[0].shape[1]
    padded_rows = round_up(rows, SUBLANES)
    padded_slots = max(block_k, round_up(slots, SUBLANES))
    num_blocks = pl.cdiv(slots + SUBLANES - 1, block_k)  # a segment of up to S slots, its start aligned down
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [B, K, Mp, H]
    grow = lambda x: jnp.pad(x, ((0, 0), (0, padded_slots - slots)) + ((0, 0),) * (x.ndim - 2))
    k, v = tuple(map(grow, k)), tuple(map(grow, v))  # [B, Sp, .]
    offsets = offsets.astype(jnp.int32).reshape(-1)  # [B K]
    lengths = lengths.astype(jnp.int32).reshape(-1)  # [B K]

    block_start = functools.partial(_block_start, kv_heads=kv_heads, block_k=block_k, slots=padded_slots)
    store_map = lambda b, h, j, off_ref, len_ref: (b, block_start(b, h, j, off_ref, len_ref), 0)
    store_spec = lambda x: pl.BlockSpec((None, pl.Element(block_k), pl.Element(x.shape[2])), store_map)  # all Element
    head_rows = lambda width: pl.BlockSpec((None, None, padded_rows, width), lambda b, h, j, *_: (b, h, 0, 0))
    in_specs = [head_rows(head_dim), *map(store_spec, k), *map(store_spec, v)]
    args = [q, *k, *v]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, pl.Element(block_k), pl.Element(1)), store_map))
        args.append(grow(bias.astype(jnp.float32))[..., None])  # [B, Sp, 1]
    kernel = functools.partial(
        _kernel,
        scale=scale,
        num_tokens=num_tokens,
        block_k=block_k,
        kv_heads=kv_heads,
        slots=padded_slots,
        parts=parts,
        has_bias=bias is not None,
    )
    o, l, m = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, kv_heads, num_blocks),
            in_specs=in_specs,
            out_specs=[head_rows(head_dim), head_rows(1), head_rows(1)],
            scratch_shapes=[
                pltpu.VMEM((padded_rows, 1), jnp.float32),  # m
                pltpu.VMEM((padded_rows, 1), jnp.float32),  # l
                pltpu.VMEM((padded_rows, head_dim), jnp.float32),  # acc
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, padded_rows, head_dim), jnp.float32),  # o
            jax.ShapeDtypeStruct((batch, kv_heads, padded_rows, 1), jnp.float32),  # l
            jax.ShapeDtypeStruct((batch, kv_heads, padded_rows, 1), jnp.float32),  # m
        ],
        compiler_params=mosaic_compiler_params("parallel", "parallel", "arbitrary"),
        interpret=mosaic_interpret_params() if interpret else False,
    )(offsets, lengths, *args)
    out, lse = online_softmax.finish(m[..., 0], l[..., 0], o)  # [B, K, Mp, H], [B, K, Mp]
    return out[:, :, :rows], lse[:, :, :rows]
