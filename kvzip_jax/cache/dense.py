"""Dense caches: an empty one, the keep mask of a masked one, and copies defragmented, grown or tiled along the batch.

Einsum legend: B batch, K KV heads, C cache capacity (slots), H head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax.cache.layouts import KVCache, LayerCache, _dense_only, visible_slots
from kvzip_jax.config import ModelConfig


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for `capacity` tokens per KV head in every layer."""
    k_width, v_width = cfg.cache_widths()  # H and H; an MLA cache's RoPE key and latent
    shape = lambda width: (batch_size, cfg.num_kv_heads, capacity, width)  # [B, K, C, H]
    layer = lambda: LayerCache(
        k=jnp.zeros(shape(k_width), dtype),
        v=jnp.zeros(shape(v_width), dtype),
        lengths=jnp.zeros((batch_size, cfg.num_kv_heads), jnp.int32),
    )
    return KVCache(
        layers=tuple(layer() for _ in range(cfg.num_layers)), next_position=jnp.zeros((batch_size,), jnp.int32)
    )


def mask_context(cache: KVCache, keep: jax.Array, prefix_len: jax.Array, context_len: jax.Array) -> KVCache:
    """A masked compressed cache: context slots [prefix_len, prefix_len + context_len) follow keep [L, B, K, n]
    (n >= context_len); every other slot (the prefix, anything appended later) stays visible. Nothing is moved;
    memory is unchanged."""
    L, B, K, n = keep.shape
    _dense_only(cache, "mask_context")
    layers = []
    for layer, layer_keep in zip(cache.layers, keep):
        slots = jnp.arange(layer.capacity, dtype=jnp.int32)  # [C]
        offset = slots[None, :] - prefix_len[:, None]  # [B, C] context offset of each slot
        in_context = (offset >= 0) & (offset < context_len[:, None])
        gathered = jnp.take_along_axis(layer_keep, jnp.clip(offset, 0, n - 1)[:, None, :], axis=-1)  # [B, K, C]
        layers.append(dataclasses.replace(layer, keep=jnp.where(in_context[:, None, :], gathered, True)))
    return dataclasses.replace(cache, layers=tuple(layers))


def defragment(cache: KVCache) -> KVCache:
    """A dense cache from a masked (or compacted) one of the same capacity: each head's visible filled slots move
    to the front, in their order, with their bias; the evicted slots become free room for new tokens. Keys keep their
    original RoPE and next_position is unchanged, so attention is the same. Jittable (shapes do not change)."""
    return dataclasses.replace(
        cache,
        layers=tuple(_defragment_layer(layer) for layer in cache.layers),
        next_position=jnp.array(cache.next_position),
    )


def _defragment_layer(layer):
    if not isinstance(layer, LayerCache):
        raise TypeError("defragment takes dense (masked) layers; a ragged layer stores only its kept pairs already")
    if layer.keep is None:
        return layer
    visible = visible_slots(layer)  # [B, K, C]
    # A stable order that puts the visible slots first: slot index, offset by C for the others.
    order = jnp.argsort(jnp.where(visible, 0, layer.capacity) + jnp.arange(layer.capacity), axis=-1)  # [B, K, C]
    gather = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
    return LayerCache(
        k=gather(layer.k),
        v=gather(layer.v),
        lengths=visible.sum(-1, dtype=jnp.int32),
        bias=None if layer.bias is None else gather(layer.bias),
    )


def grown(cache: KVCache, extra: int) -> KVCache:
    """A copy of a dense cache with `extra` more slots per head (room for a pass on top of a full cache)."""
    if extra < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")

    def grow(layer):
        if not isinstance(layer, LayerCache):
            raise TypeError("grown takes a dense cache, not a ragged one")
        pad = lambda x, value=0: (
            None
            if x is None
            else jnp.pad(x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3), constant_values=value)
        )
        return LayerCache(
            k=pad(layer.k),
            v=pad(layer.v),
            lengths=jnp.copy(layer.lengths),
            keep=pad(layer.keep, True),
            bias=pad(layer.bias),
        )

    return KVCache(layers=tuple(grow(layer) for layer in cache.layers), next_position=jnp.copy(cache.next_position))


def tiled_rows(cache: KVCache, copies: int) -> KVCache:
    """`copies` copies of a cache's batch (or a layer's) stacked along it: row c B + b is row b. New arrays, even
    for one copy (the result may be donated)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return jax.tree.map(lambda x: jnp.concatenate([x] * copies, axis=0) if copies > 1 else jnp.copy(x), cache)
