"""KVzip's per-key score reduction: the max over reread query rows of a key's (log-)attention probability.

Einsum legend:
  B batch rows, K KV heads, R reread rows per KV head (the G query heads x T reread positions of one KV head,
  stacked), S key slots (the chunk's cached keys), H head dim, Rp / Sp = R / S padded to whole blocks.

score[b, k, s] = max_r (q[b, k, r] . k[b, k, s] + row_bias[b, k, r]), then exp. With q pre-scaled and
row_bias = -lse_r this is the largest softmax probability key s receives from any reread row; taking the max before
the exp runs one exp per key instead of one per (row, key). No causal mask: the chunk's keys precede every reread
row.

The kernel never materialises [R, S]: grid (B, K, Sp / block_keys); each program loads its key block once and loops
over row blocks of block_rows, keeping a running max [block_keys] (the dK/dV half of a flash backward, with a max
in place of the matmuls). On a TPU (dispatch.lowering() "mosaic") score_max_tpu.py's kernel runs instead, its row
blocks a grid axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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
from .score_max_tpu import block_sizes, score_max_mosaic


def _check_inputs(q, k, row_bias) -> None:
    """Raise KernelInputError on inconsistent shapes (see score_max)."""
    if q.ndim != 4 or k.ndim != 4:
        raise KernelInputError(f"q must be [B, K, R, H] and k [B, K, S, H], got {q.shape} and {k.shape}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise KernelInputError(f"k {k.shape} does not match q {q.shape} (batch, KV heads, head dim)")
    if row_bias.shape != q.shape[:3]:
        raise KernelInputError(f"row_bias {row_bias.shape} must be [B, K, R] = {q.shape[:3]}")


def _mask_padding_rows(q: jax.Array, row_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Zero the query of padding rows (row_bias <= MASK_VALUE, whatever q holds there, NaN included).

    q [B, K, R, H], row_bias [B, K, R] -> the same shapes; padding rows get q = 0 and bias MASK_VALUE.
    """
    real = row_bias > MASK_VALUE  # [B, K, R]
    return jnp.where(real[..., None], q, 0), jnp.where(real, row_bias.astype(jnp.float32), MASK_VALUE)


def score_max(
    q: jax.Array,
    k: jax.Array,
    row_bias: jax.Array,
    *,
    exp: bool = True,
    impl: str = "auto",
    block_keys: int = 64,
    block_rows: int = 64,
) -> jax.Array:
    """Per-key max over rows of q . k + row_bias, exponentiated once per key.

    Args:
      q: [B, K, R, H] scaled query rows (float32 or bfloat16).
      k: [B, K, S, H] the chunk's cached keys (float32 or bfloat16).
      row_bias: [B, K, R] float32 per-row offset (-lse of the row); rows with row_bias <= MASK_VALUE are padding
        and ignored, whatever their q holds.
      exp: return exp(max) (a probability) if True, else the max logit itself.
      impl: "auto" | "xla" | "pallas" (see dispatch.resolve_impl); "pallas" needs H a power of two >= 16.
      block_keys, block_rows: keys per program and rows per loop step, powers of two >= 16 (shrunk to fit small
        S and R; on a TPU keys rounded up to 128 lanes, see score_max_tpu.block_sizes).

    Returns:
      [B, K, S] float32 scores; a key no real row sees scores exp(MASK_VALUE) = 0 (MASK_VALUE with exp=False).
    """
    _check_inputs(q, k, row_bias)
    if resolve_impl(impl) == "xla":
        return score_max_reference(q, k, row_bias, exp=exp)
    check_power_of_two("head dim H", q.shape[3])
    check_power_of_two("block_keys", block_keys)
    check_power_of_two("block_rows", block_rows)
    if lowering() == "mosaic":
        q, row_bias = _mask_padding_rows(q, row_bias)
        rows, keys = block_sizes(q.shape[2], k.shape[2], block_rows, block_keys)
        return score_max_mosaic(q, k, row_bias, exp=exp, block_keys=keys, block_rows=rows, interpret=False)
    block_keys = min(block_keys, max(16, next_power_of_two(k.shape[2])))
    block_rows = min(block_rows, max(16, next_power_of_two(q.shape[2])))
    return _score_max_pallas(
        q, k, row_bias, exp=exp, block_keys=block_keys, block_rows=block_rows, interpret=interpret_mode()
    )


def _score_max_kernel(q_ref, k_ref, bias_ref, o_ref, *, exp, block_rows):
    """One (b, k, key block) program: running max over all row blocks.

    Refs: q [Rp, H]; k [block_keys, H]; bias [Rp] float32; output [block_keys] float32.
    """
    compute_dtype = jnp.promote_types(q_ref.dtype, k_ref.dtype)
    keys = k_ref[...].astype(compute_dtype)  # [block_keys, H]

    def body(i, best):
        rows = pl.ds(pl.multiple_of(i * block_rows, block_rows), block_rows)
        logits = kernel_dot(q_ref[rows, :].astype(compute_dtype), keys, transpose_b=True)  # [block_rows, block_keys]
        logits = logits + bias_ref[rows][:, None]
        return jnp.maximum(best, logits.max(axis=0))

    best = jax.lax.fori_loop(
        0, q_ref.shape[0] // block_rows, body, jnp.full((keys.shape[0],), MASK_VALUE, jnp.float32)
    )  # [block_keys]
    o_ref[...] = jnp.exp(best) if exp else best


@functools.partial(jax.jit, static_argnames=("exp", "block_keys", "block_rows", "interpret"))
def _score_max_pallas(q, k, row_bias, *, exp, block_keys, block_rows, interpret):
    """The pallas_call on padded inputs; arguments as score_max's, already checked."""
    batch, kv_heads, rows, head_dim = q.shape
    keys = k.shape[2]
    padded_rows = pl.cdiv(rows, block_rows) * block_rows
    padded_keys = pl.cdiv(keys, block_keys) * block_keys
    q, row_bias = _mask_padding_rows(q, row_bias)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))  # [B, K, Rp, H]
    row_bias = jnp.pad(row_bias, ((0, 0), (0, 0), (0, padded_rows - rows)), constant_values=MASK_VALUE)  # [B, K, Rp]
    k = jnp.pad(k, ((0, 0), (0, 0), (0, padded_keys - keys), (0, 0)))  # [B, K, Sp, H]
    scores = pl.pallas_call(
        functools.partial(_score_max_kernel, exp=exp, block_rows=block_rows),
        grid=(batch, kv_heads, padded_keys // block_keys),
        in_specs=[
            pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, block_keys, head_dim), lambda b, h, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, padded_rows), lambda b, h, j: (b, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_keys), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, padded_keys), jnp.float32),  # [B, K, Sp]
        compiler_params=compiler_params(interpret),
        interpret=interpret,
    )(q, k, row_bias)
    return scores[:, :, :keys]


def score_max_reference(q: jax.Array, k: jax.Array, row_bias: jax.Array, *, exp: bool = True) -> jax.Array:
    """The plain jnp oracle of score_max (same arguments and result); materialises [B, K, R, S] in float32."""
    _check_inputs(q, k, row_bias)
    q, row_bias = _mask_padding_rows(q, row_bias)
    logits = jnp.einsum(
        "BKRH,BKSH->BKRS", q.astype(jnp.float32), k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )  # [B, K, R, S]
    best = jnp.max(logits + row_bias[..., None], axis=2, initial=MASK_VALUE)  # [B, K, S]
    return jnp.exp(best) if exp else best
