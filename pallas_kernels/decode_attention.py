"""Decode attention over a dense per-head cache, run as a ragged store.

Einsum legend:
  B batch rows, K KV heads, G query heads per KV head, T new tokens per step, M = G T query rows per KV head (row
  r = g T + t), C cache capacity (slots per head), H head dim.

A dense cache k, v [B, K, C, H] reshaped to [B, K C, H] (free: contiguous) is a flat store in which head k owns the
slots [k C, k C + lengths[b, k]); an optional keep mask [B, K, C] becomes the per-slot bias 0 / -inf. So one kernel,
ragged_decode, serves both caches, and the cost follows the filled lengths, not the capacity C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import online_softmax
from . import quantized_rows as qrows
from .dispatch import KernelInputError
from .ragged_decode import ragged_decode


def _check_inputs(q, k, v, lengths, keep, num_tokens, bias=None) -> None:
    """Raise KernelInputError on inconsistent shapes (see decode_attention)."""
    if isinstance(k, qrows.QuantizedRows) or isinstance(v, qrows.QuantizedRows):
        if not (isinstance(k, qrows.QuantizedRows) and isinstance(v, qrows.QuantizedRows)):
            raise KernelInputError("k and v must both be arrays or both be QuantizedRows")
        if k.codes.shape[:3] != v.codes.shape[:3]:
            raise KernelInputError(f"v codes {v.codes.shape} must hold k's slots {k.codes.shape[:3]}")
        qrows.bits_of(k, q.shape[-1])  # keys and values may differ in bits and groups (k8v4)
        qrows.bits_of(v, q.shape[-1])
        k = v = jax.ShapeDtypeStruct(k.codes.shape[:3] + (q.shape[-1],), jnp.float32)  # the rows they stand for
    if q.ndim != 4 or k.ndim != 4:
        raise KernelInputError(f"q must be [B, K, M, H] and k [B, K, C, H], got {q.shape} and {k.shape}")
    batch, kv_heads, rows, head_dim = q.shape
    if k.shape[:2] != (batch, kv_heads) or k.shape[3] != head_dim:
        raise KernelInputError(f"k {k.shape} does not match q {q.shape} (batch, KV heads, head dim)")
    if v.shape != k.shape:
        raise KernelInputError(f"v {v.shape} must have k's shape {k.shape}")
    if lengths.shape != (batch, kv_heads):
        raise KernelInputError(f"lengths {lengths.shape} must be [B, K] = {(batch, kv_heads)}")
    if keep is not None and keep.shape != k.shape[:3]:
        raise KernelInputError(f"keep {keep.shape} must be [B, K, C] = {k.shape[:3]}")
    if bias is not None and bias.shape != k.shape[:3]:
        raise KernelInputError(f"bias {bias.shape} must be [B, K, C] = {k.shape[:3]}")
    if num_tokens < 1 or rows % num_tokens:
        raise KernelInputError(f"num_tokens {num_tokens} must be >= 1 and divide the query rows M = {rows}")


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    keep: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    scale: float,
    num_tokens: int = 1,
    impl: str = "auto",
    block_k: int = 64,
    num_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of each KV head's query rows over the filled slots of its dense cache.

    Args:
      q: [B, K, M, H] query rows per KV head, any float dtype; M = G T, row r = g T + t.
      k, v: [B, K, C, H] dense cache (bfloat16 or float32), or both QuantizedRows of [B, K, C, .] (ragged_decode's,
        each in its own bits and groups);
        slots >= lengths may hold anything (NaN).
      lengths: [B, K] integer filled slots per head, clipped to [0, C]; the T new tokens are the last ones written.
      keep: [B, K, C] bool or None; False slots are invisible (a masked compressed cache).
      bias: [B, K, C] float32 additive logit per slot or None (Attention Matching's beta); -inf hides a slot.
      scale, num_tokens, impl, block_k, num_splits: as ragged_decode's.

    Returns:
      out [B, K, M, H] float32 (0 where no key is visible) and lse [B, K, M] float32 (MASK_VALUE there).
    """
    _check_inputs(q, k, v, lengths, keep, num_tokens, bias)
    batch, kv_heads, capacity = lengths.shape + (_rows_shape(k)[2],)
    offsets = jnp.broadcast_to(jnp.arange(kv_heads, dtype=jnp.int32) * capacity, (batch, kv_heads))  # [B, K]
    slot_bias = None if bias is None else bias.astype(jnp.float32)  # [B, K, C]
    if keep is not None:
        hidden = jnp.where(keep, 0.0, -jnp.inf).astype(jnp.float32)  # [B, K, C]
        slot_bias = hidden if slot_bias is None else jnp.where(keep, slot_bias, -jnp.inf)
    if slot_bias is not None:
        slot_bias = slot_bias.reshape(batch, kv_heads * capacity)  # [B, K C]
    flat = lambda x: x.reshape((batch, kv_heads * capacity) + x.shape[3:])  # [B, K C, .]
    as_store = lambda x: qrows.QuantizedRows(*map(flat, x)) if isinstance(x, qrows.QuantizedRows) else flat(x)
    return ragged_decode(
        q,
        as_store(k),
        as_store(v),
        offsets,
        jnp.clip(lengths, 0, capacity).astype(jnp.int32),
        slot_bias,
        scale=scale,
        num_tokens=num_tokens,
        impl=impl,
        block_k=block_k,
        num_splits=num_splits,
    )


def _rows_shape(x) -> tuple[int, ...]:
    return x.codes.shape if isinstance(x, qrows.QuantizedRows) else x.shape


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    keep: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    scale: float,
    num_tokens: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """The dense jnp oracle of decode_attention (same arguments and results), float32 with HIGHEST precision."""
    _check_inputs(q, k, v, lengths, keep, num_tokens, bias)
    if isinstance(k, qrows.QuantizedRows):
        k, v = (qrows.dequantize_rows(x, q.shape[-1]) for x in (k, v))
    rows, capacity = q.shape[2], k.shape[2]
    lengths = jnp.clip(lengths, 0, capacity)
    slot = jnp.arange(capacity)  # [C]
    filled = slot < lengths[..., None]  # [B, K, C]
    if keep is not None:
        filled = filled & keep
    lag = num_tokens - 1 - jnp.arange(rows) % num_tokens  # [M]
    visible = filled[:, :, None, :] & (slot < (lengths[..., None] - lag)[..., None])  # [B, K, M, C]
    k32 = jnp.where((slot < lengths[..., None])[..., None], k.astype(jnp.float32), 0.0)  # [B, K, C, H]
    v32 = jnp.where((slot < lengths[..., None])[..., None], v.astype(jnp.float32), 0.0)  # [B, K, C, H]
    logits = scale * jnp.einsum(
        "BKMH,BKCH->BKMC", q.astype(jnp.float32), k32, precision=jax.lax.Precision.HIGHEST
    )  # [B, K, M, C]
    if bias is not None:
        logits = logits + jnp.where(filled, bias.astype(jnp.float32), 0.0)[:, :, None, :]
    m, p = online_softmax.exp_from_row_max(jnp.where(visible, logits, -jnp.inf))  # [B, K, M], [B, K, M, C]
    o = jnp.einsum("BKMC,BKCH->BKMH", p, v32, precision=jax.lax.Precision.HIGHEST)  # [B, K, M, H]
    return online_softmax.finish(m, p.sum(axis=-1), o)
