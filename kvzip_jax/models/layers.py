"""Stateless building blocks: RMSNorm, rotary embedding, MLP and grouped-query attention over a cache.

Einsum legend: B batch, T query positions, S key slots, D model width, K KV heads, G query heads per KV head,
H head dim, F MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import RopeSpec

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, so an all-masked row never gives inf - inf


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., E] * rsqrt(mean(x^2) + eps) * weight [E], in float32 (weight is the effective multiplier)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """[H/2] float32 inverse frequencies, with linear or llama3 scaling as HF computes them."""
    inv_freq = 1.0 / (np.float32(spec.theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                                  / np.float32(head_dim)))
    inv_freq = inv_freq.astype(np.float32)
    if spec.kind == "linear":
        return (inv_freq / np.float32(spec.factor)).astype(np.float32)
    if spec.kind == "llama3":
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Half-split rotary embedding of x [B, T, heads, H] at integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str) -> jax.Array:
    """Gated MLP: act(x W_gate) * (x W_up) W_down. x [B, T, D], gate_up [D, 2F], down [F, D]."""
    gate, up = jnp.split(x @ gate_up, 2, axis=-1)  # [B, T, F] each
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return (act * up) @ down


def attention_mask(query_slots: jax.Array, num_slots: int, window: int | None,
                   key_keep: jax.Array | None = None) -> jax.Array:
    """[B, K, T, S] bool: key slot s is visible to the query in slot q iff s <= q (and q - s < window, and the
    slot is kept in a masked cache: key_keep [B, K, S])."""
    key_slots = jnp.arange(num_slots, dtype=jnp.int32)  # [S]
    q = query_slots[..., None]  # [B, K, T, 1]
    visible = key_slots <= q
    if window is not None:
        visible &= (q - key_slots) < window
    if key_keep is not None:
        visible &= key_keep[:, :, None, :]
    return visible


@dataclasses.dataclass(frozen=True)
class AttentionView:
    """What one attention layer saw, handed to an observer. Arrays are float32 unless noted.

    layer: layer index. hidden: the normed attention input [B, T, D]. q: post-norm, post-RoPE queries
    [B, T, K, G, H]. k, v: the cache keys/values after this step's write [B, K, S, H]. mask: [B, K, T, S] bool.
    probs: the softmax attention weights used [B, K, G, T, S]. query_slots: [B, K, T] int32 cache slot of each
    query. o_proj: the output projection [N H, D]. scale: the model's attention scale on q.k.
    """

    layer: int
    hidden: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    mask: jax.Array
    probs: jax.Array
    query_slots: jax.Array
    o_proj: jax.Array
    scale: float


Observer = Callable[[AttentionView], Any]


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float):
    """Softmax attention of q [B, T, K, G, H] over k, v [B, K, S, H] with mask [B, K, T, S].

    Returns (out [B, T, K, G, H], probs [B, K, G, T, S] float32). Scores and softmax in float32.
    """
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, :, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)  # [B, K, G, T, S]
    out = jnp.einsum("BKGTS,BKSH->BTKGH", probs.astype(v.dtype), v)
    return out, probs


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, query_slots: jax.Array, window: int | None,
                      scale: float, key_keep: jax.Array | None = None, block: int = 256) -> jax.Array:
    """Same result as grouped_attention, without materialising scores over the whole cache.

    Loops over key blocks of `block` slots up to the furthest query slot only (a dynamic trip count, so a short
    context in a large cache costs what its length costs) with an online softmax in float32.
    q [B, T, K, G, H], k, v [B, K, C, H], query_slots [B, K, T], key_keep [B, K, C] (masked caches) or None.
    Returns [B, T, K, G, H].
    """
    B, T, K, G, H = q.shape
    C = k.shape[2]
    block = math.gcd(C, block)
    qm = (q.astype(jnp.float32) * scale).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)  # [B, K, M=G T, H]
    last_slot = jnp.max(query_slots)
    first_block = 0
    if window is not None:
        first_block = jnp.maximum(jnp.min(query_slots) - window + 1, 0) // block
    num_blocks = last_slot // block + 1

    def visit(j, carry):
        m, l, acc = carry  # [B, K, M], [B, K, M], [B, K, M, H]
        kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=2)  # [B, K, S=block, H]
        vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=2)
        s = jnp.einsum("BKMH,BKSH->BKMS", qm, kb, preferred_element_type=jnp.float32)
        key_slots = j * block + jnp.arange(block, dtype=jnp.int32)  # [S]
        visible = key_slots <= query_slots[..., None]  # [B, K, T, S]
        if window is not None:
            visible &= (query_slots[..., None] - key_slots) < window
        if key_keep is not None:
            visible &= jax.lax.dynamic_slice_in_dim(key_keep, j * block, block, axis=2)[:, :, None, :]
        s = jnp.where(visible[:, :, None], s.reshape(B, K, G, T, block), MASK_VALUE).reshape(B, K, G * T, block)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])  # [B, K, M, S]
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("BKMS,BKSH->BKMH", p, vb.astype(jnp.float32))
        return m_new, l, acc

    init = (jnp.full((B, K, G * T), MASK_VALUE, jnp.float32), jnp.zeros((B, K, G * T), jnp.float32),
            jnp.zeros((B, K, G * T, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first_block, num_blocks, visit, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # [B, K, M, H]; a row that saw nothing stays zero
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).astype(q.dtype)
