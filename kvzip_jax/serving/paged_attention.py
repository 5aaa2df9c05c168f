"""Attention of new tokens over an export's pages, written plainly: the oracle for both layouts.

As a paged engine computes it: a sequence's T new tokens are the last T of its kv_lens + T slots, their keys and
values written at slots kv_lens + t, each query seeing the slots at or before its own (and, with a sliding window,
fewer than `window` slots back, counted over the pages' slots).

Einsum legend: B batch, T new tokens, S slots per sequence (pages and new tokens), K KV heads, G query heads per KV
head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.models.attention import MASK_VALUE
from kvzip_jax.serving.pages import PagedExport, read_pages


def paged_decode_attention(
    q: jax.Array,
    export: PagedExport,
    layer: int,
    scale: float,
    k_new: jax.Array,
    v_new: jax.Array,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Attention [B, T, N, H] of queries q [B, T, N, H] over layer `layer`'s pages and the new tokens' own keys and
    values k_new, v_new [B, T, K, H] (query head n reads KV head n // G), softmax in float32; soft_cap: logits
    become soft_cap tanh(logits / soft_cap)."""
    k, v = read_pages(export, layer)  # [B, S0, K, H]
    B, T, N, H = q.shape
    K = k.shape[2]
    S0 = k.shape[1]
    lens = export.kv_lens  # [B]
    keys = jnp.concatenate([k, k_new.astype(k.dtype)], axis=1)  # [B, S, K, H]
    values = jnp.concatenate([v, v_new.astype(v.dtype)], axis=1)
    new_slots = lens[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T], also the queries' slots
    slots = jnp.concatenate([jnp.broadcast_to(jnp.arange(S0, dtype=jnp.int32), (B, S0)), new_slots], axis=1)
    filled = jnp.concatenate([jnp.arange(S0) < lens[:, None], jnp.ones((B, T), bool)], axis=1)  # [B, S]
    mask = filled[:, None, :] & (slots[:, None, :] <= new_slots[:, :, None])  # [B, T, S]
    if window is not None:
        mask &= (new_slots[:, :, None] - slots[:, None, :]) < window
    qg = q.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, keys, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, K, G, T, S]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, values.astype(jnp.float32))
    return out.reshape(B, T, N, H).astype(q.dtype)
