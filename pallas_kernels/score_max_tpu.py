"""score_max's TPU kernel (Mosaic): grid (B, K, key blocks, row blocks), rows innermost and "arbitrary".

Einsum legend:
  B batch rows, K KV heads, R reread rows, S keys, H head dim, Rp / Sp = R / S padded to whole blocks.

Same arguments and result as score_max. Program (b, k, c, r) multiplies row block r [block_rows, H] by key block
c [block_keys, H] and folds the column max of q . k + row_bias into the output block [1, block_keys], which stays
resident in VMEM across r (the dK/dV pattern of a flash backward): initialised at r = 0, exponentiated at the last
r. The row bias travels as a column [Rp, 1] beside its rows; the output as [B, K, 1, Sp], so a key block is a lane
row: block_keys is a multiple of 128 lanes, or all of the (padded) keys when they fit in one block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .dispatch import MASK_VALUE, kernel_dot, mosaic_compiler_params, mosaic_interpret_params, round_up

LANES = 128  # a vreg row: the output block's width unless one block holds every key
SUBLANES = 8  # a float32 vreg tile's rows: the alignment of key and row blocks


def block_sizes(rows: int, keys: int, block_rows: int, block_keys: int) -> tuple[int, int]:
    """(block_rows, block_keys) the TPU kernel uses: rows a multiple of 8, at most all (padded) rows; keys all
    (padded) keys if they fit in block_keys rounded up to 128 lanes, else that many."""
    block_rows = min(round_up(block_rows, SUBLANES), round_up(rows, SUBLANES))
    block_keys = round_up(block_keys, LANES)
    return block_rows, min(block_keys, round_up(keys, SUBLANES))


def _kernel(q_ref, k_ref, bias_ref, o_ref, *, exp):
    """One (b, k, c, r) step. Refs: q [block_rows, H]; k [block_keys, H]; bias [block_rows, 1] float32; output
    [1, block_keys] float32, the running max until the last row block."""
    r = pl.program_id(3)

    @pl.when(r == 0)
    def _init():
        o_ref[...] = jnp.full(o_ref.shape, MASK_VALUE, jnp.float32)

    compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
    logits = kernel_dot(q_ref[...].astype(compute_dtype), k_ref[...].astype(compute_dtype), transpose_b=True)
    logits = logits + bias_ref[...]  # [block_rows, block_keys]
    o_ref[...] = jnp.maximum(o_ref[...], logits.max(axis=0, keepdims=True))

    if exp:

        @pl.when(r == pl.num_programs(3) - 1)
        def _finish():
            o_ref[...] = jnp.exp(o_ref[...])


@functools.partial(jax.jit, static_argnames=("exp", "block_keys", "block_rows", "interpret"))
def score_max_mosaic(q, k, row_bias, *, exp, block_keys, block_rows, interpret):
    """[B, K, S] float32 scores, as score_max's, for checked inputs q [B, K, R, H], k [B, K, S, H] and row_bias
    [B, K, R] with padding rows already masked (q 0, bias MASK_VALUE); block sizes from `block_sizes`; interpret: run
    in Pallas TPU interpret mode (on any host) instead of lowering to Mosaic."""
    batch, kv_heads, rows, head_dim = q.shape
    keys = k.shape[2]
    padded_rows = round_up(rows, block_rows)
    padded_keys = round_up(keys, block_keys)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [B, K, Rp, H]
    row_bias = jnp.pad(row_bias, ((0, 0), (0, 0), (0, padded_rows - rows)), constant_values=MASK_VALUE)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, padded_keys - keys), (0, 0)))  # [B, K, Sp, H]
    row_block = lambda width: pl.BlockSpec((None, None, block_rows, width), lambda b, h, c, r: (b, h, r, 0))
    scores = pl.pallas_call(
        functools.partial(_kernel, exp=exp),
        grid=(batch, kv_heads, padded_keys // block_keys, padded_rows // block_rows),
        in_specs=[
            row_block(head_dim),
            pl.BlockSpec((None, None, block_keys, head_dim), lambda b, h, c, r: (b, h, c, 0)),
            row_block(1),
        ],
        out_specs=pl.BlockSpec((None, None, 1, block_keys), lambda b, h, c, r: (b, h, 0, c)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, 1, padded_keys), jnp.float32),  # [B, K, 1, Sp]
        compiler_params=mosaic_compiler_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=mosaic_interpret_params() if interpret else False,
    )(q, k, row_bias[..., None])
    return scores[:, :, 0, :keys]
