"""Quantizing a cache: every layer's stored keys and values in int8 / packed int4 groups, each in its own format
(keys centred per channel first), beside an empty full-precision window.

Einsum legend: B batch, K KV heads, C cache capacity (slots), S ragged store slots, W key width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax.cache.layouts import WINDOW, KVCache, LayerCache, QuantizedLayerCache, RaggedLayerCache, visible_slots
from kvzip_jax.quant import groups as quant


def quantized(
    cache: KVCache,
    fmt: quant.QuantFormat = quant.QuantFormat(),
    window: int = WINDOW,
    center: bool = True,
    value_fmt: quant.QuantFormat | None = None,
) -> KVCache:
    """The cache with every layer's stored keys quantized in fmt and its values in value_fmt (None: fmt), per token in
    groups along the head dim, and an empty full-precision window of `window` tokens per KV head for what is appended
    next; keep masks, offsets and biases (float32) are kept as they are. center: each head's keys are first centred
    per channel on the midpoint of their visible pairs' range, rounded to the scale dtype (key_center; exact:
    attention adds the centre's logit back). Any form (dense, masked, compacted, ragged); jittable."""
    value_fmt = fmt if value_fmt is None else value_fmt
    if fmt.along != "head_dim" or value_fmt.along != "head_dim":
        raise ValueError(
            "a cache quantizes its pairs per token (along='head_dim'); per-channel (KIVI) keys need "
            "token groups that flushes of the window would split"
        )
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def layer_of(layer):
        if isinstance(layer, QuantizedLayerCache):
            raise TypeError("the cache is quantized already")
        copied = jax.tree.map(jnp.copy, dataclasses.replace(layer, k=None, v=None))  # new arrays: donation-safe
        key_center = _key_center(layer).astype(fmt.scale_dtype) if center else None
        keys = layer.k if key_center is None else layer.k - _per_slot(layer, key_center.astype(jnp.float32))
        store = dataclasses.replace(copied, k=quant.quantize(keys, fmt), v=quant.quantize(layer.v, value_fmt))
        B, K = layer.lengths.shape
        empty = lambda x: jnp.zeros((B, K, window, x.shape[-1]), x.dtype)  # k and v widths (MLA: they differ)
        return QuantizedLayerCache(
            store=store,
            window=LayerCache(k=empty(layer.k), v=empty(layer.v), lengths=jnp.zeros_like(layer.lengths)),
            key_center=key_center,
        )

    return KVCache(layers=tuple(layer_of(layer) for layer in cache.layers), next_position=jnp.copy(cache.next_position))


def _key_center(layer) -> jax.Array:
    """[B, K, W] float32: per channel, the midpoint of (the smallest, the largest) key over each head's visible
    pairs; 0 for a head with none."""
    keys = layer.k.astype(jnp.float32)
    if isinstance(layer, RaggedLayerCache):  # [B, S, W] -> per head segment
        head, filled = _slot_heads(layer)  # [B, S]
        K = layer.offsets.shape[1]
        segment = jnp.where(filled, head, K)  # empty slots: a segment of their own, dropped
        reduce = lambda op: jax.vmap(lambda x, s: op(x, s, num_segments=K + 1))(keys, segment)[:, :K]
        high, low = reduce(jax.ops.segment_max), reduce(jax.ops.segment_min)
    else:
        visible = visible_slots(layer)[..., None]  # [B, K, C, 1]
        high = jnp.where(visible, keys, -jnp.inf).max(axis=2)
        low = jnp.where(visible, keys, jnp.inf).min(axis=2)
    return jnp.where(high >= low, (high + low) / 2, 0.0)


def _slot_heads(layer: RaggedLayerCache) -> tuple[jax.Array, jax.Array]:
    """([B, S] the head whose segment holds each store slot, [B, S] whether that slot is filled)."""
    slots = jnp.arange(layer.k.shape[1], dtype=jnp.int32)
    head = jax.vmap(lambda o: jnp.searchsorted(o, slots, side="right") - 1)(layer.offsets)  # [B, S]
    start = jnp.take_along_axis(layer.offsets, head, axis=1)
    return head, slots - start < jnp.take_along_axis(layer.lengths, head, axis=1)


def _per_slot(layer, per_head: jax.Array) -> jax.Array:
    """per_head [B, K, W] laid out as the layer's k: [B, K, 1, W] (dense) or [B, S, W] (ragged, by segment)."""
    if isinstance(layer, RaggedLayerCache):
        return jnp.take_along_axis(per_head, _slot_heads(layer)[0][..., None], axis=1)
    return per_head[:, :, None, :]
