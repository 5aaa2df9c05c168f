"""Attention over a ragged layer: a flat per-layer store [B, S, H] of per-head segments, with the online softmax of
attention.py, so that work follows the stored pairs rather than the most-kept head.

Einsum legend: B batch, T query positions, S store slots, K KV heads, G query heads per KV head, M = G T query rows
per KV head, H head dim, N blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvzip_jax.models import attention
from kvzip_jax.models.attention import MASK_VALUE
from kvzip_jax.quant import groups as quant

RAGGED_CHUNK_SLOTS = 4096  # store slots a quantized ragged layer dequantizes at a time


def ragged_attention(
    q,
    k,
    v,
    offsets,
    filled,
    k_new,
    v_new,
    query_slots,
    window: int | None,
    scale: float,
    block: int,
    key_bias=None,
    latent_keys: bool = False,
) -> jax.Array:
    """blocked_attention's result over a ragged layer: k, v [B, S, H] hold per-head segments that start at
    offsets [B, K] (multiples of `block`); head k's slot i lives at offsets[:, k] + i; filled [B, K]; k_new, v_new
    as in blocked_attention (None: already written); key_bias [B, S]: a logit added per store slot, or None;
    latent_keys as in blocked_attention.

    Each block of the flat store belongs to one head, so work is proportional to the stored pairs, not to the
    most-kept head: every block is scored against its head's queries, the blocks are reduced to per-head
    online-softmax states, then the new keys are visited. Quantized k, v (quant.Quantized rows) go in chunks of
    blocks, each dequantized when it is visited, so no float copy of the whole store exists. Returns
    blocked_attention's triple (no subset).
    """
    B, T, K, G, H = q.shape
    num_blocks = k.shape[1] // block
    qm = attention.query_rows(q, scale)  # [B, K, M, H]
    quantized = isinstance(k, quant.Quantized)
    per_chunk = math.gcd(num_blocks, max(RAGGED_CHUNK_SLOTS // block, 1)) if quantized else num_blocks
    chunk = lambda c: _ragged_chunk(
        qm, k, v, offsets, filled, query_slots, window, block, key_bias, c * per_chunk, per_chunk, latent_keys
    )
    if per_chunk == num_blocks:
        state = chunk(0)
    else:
        state = jax.lax.fori_loop(1, num_blocks // per_chunk, lambda c, st: _merged(st, chunk(c)), chunk(0))
    if k_new is not None:
        state = attention.visit_new_keys(state, qm, k_new, v_new, filled, query_slots, window)
    return attention.finished(state, q)


def _ragged_chunk(
    qm,
    k,
    v,
    offsets,
    filled,
    query_slots,
    window,
    block: int,
    key_bias,
    first: int,
    count: int,
    latent_keys: bool = False,
):
    """The per-head online-softmax state [B, K, M] (max, normaliser, subset normaliser) and [B, K, M, H] (weighted
    values) of qm [B, K, M, H] over the ragged store's blocks [first, first + count)."""
    B, K, M, H = qm.shape
    T = query_slots.shape[2]
    G = M // T
    take = lambda x: attention.dequantized(
        jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first * block, count * block, axis=1), x)
    )
    starts = (first + jnp.arange(count, dtype=jnp.int32)) * block  # [N]
    owner = jnp.clip(jax.vmap(lambda o: jnp.searchsorted(o, starts, side="right"))(offsets) - 1, 0, K - 1)  # [B, N]
    one_hot = jax.nn.one_hot(owner, K, dtype=jnp.float32)  # [B, N, K]
    q_of_block = jnp.take_along_axis(qm, owner[:, :, None, None], axis=1)  # [B, N, M, H]
    qs_of_block = jnp.take_along_axis(query_slots, owner[:, :, None], axis=1)  # [B, N, T]
    local = starts[None, :, None] + jnp.arange(block) - jnp.take_along_axis(offsets, owner, 1)[..., None]  # [B,N,b]
    visible = local < jnp.take_along_axis(filled, owner, 1)[..., None]  # [B, N, block]
    visible = attention.attention_mask(qs_of_block, local, visible, window)  # [B, N, T, block]
    kb = take(k).reshape(B, count, block, -1)
    vb = take(v).reshape(B, count, block, -1)
    if latent_keys:
        kb = jnp.concatenate([vb, kb.astype(vb.dtype)], axis=-1)  # [B, N, block, R + dr]
    s = jnp.einsum("BNMH,BNSH->BNMS", q_of_block, kb, preferred_element_type=jnp.float32)
    if key_bias is not None:  # a -inf bias makes a key as masked as MASK_VALUE does (a block's max stays finite)
        bias = jax.lax.dynamic_slice_in_dim(key_bias, first * block, count * block, axis=1)
        s = jnp.maximum(s + bias.reshape(B, count, 1, block), MASK_VALUE)
    s = jnp.where(visible[:, :, None], s.reshape(B, count, G, T, block), MASK_VALUE).reshape(B, count, M, block)
    m_block = s.max(axis=-1)  # [B, N, M]
    p = jnp.exp(s - m_block[..., None])
    l_block = p.sum(axis=-1)  # [B, N, M]
    acc_block = jnp.einsum("BNMS,BNSH->BNMH", p, vb.astype(jnp.float32))
    m_head = jnp.where(one_hot[..., None] > 0, m_block[:, :, None, :], MASK_VALUE).max(axis=1)  # [B, K, M]
    weight = jnp.exp(m_block - jnp.take_along_axis(m_head, owner[:, :, None], axis=1))  # [B, N, M]
    l_head = jnp.einsum("BNK,BNM->BKM", one_hot, l_block * weight)
    acc_head = jnp.einsum("BNK,BNMH->BKMH", one_hot, acc_block * weight[..., None])
    return m_head, l_head, acc_head, l_head


def _merged(a, b):
    """One online-softmax state from two over disjoint key sets."""
    m = jnp.maximum(a[0], b[0])
    wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None], a[3] * wa + b[3] * wb
