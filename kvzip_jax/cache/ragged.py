"""Packing a masked cache into a ragged one: each head's visible pairs in its segment of a bucketed flat store.

Einsum legend: B batch, K KV heads, C cache capacity (slots), S ragged store slots, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.cache.layouts import RAGGED_BLOCK, KVCache, RaggedLayerCache, _dense_only, kept_per_head, visible_slots

STORE_STEPS = 8  # store sizes per octave (power of two): a bucket wastes at most 1/8 of the slots


def store_bucket(slots: int, minimum: int = 64) -> int:
    """The ragged store size for `slots` needed slots: the smallest m 2^e >= slots with m in [STORE_STEPS,
    2 STORE_STEPS) and a multiple of RAGGED_BLOCK, at least `minimum`. Nearby sizes share a bucket, so a new context
    or ratio usually reuses the compiled decode step; past 128 slots the slack is at most 1/STORE_STEPS."""
    slots = max(slots, minimum)
    step = max(1 << max(slots.bit_length() - STORE_STEPS.bit_length(), 0), RAGGED_BLOCK)  # slots / step in [8, 16)
    return -(-slots // step) * step


def pack(cache: KVCache, room: int, multiple: int = 64) -> KVCache:
    """A ragged compressed cache from a masked one: each (layer, KV head) keeps only its visible filled slots, in
    their original order, in a segment of the layer's flat store with `room` free slots for tokens appended later
    (question, answer). Keys keep their original RoPE positions; next_position is unchanged.

    Runs on the host: the kept counts set the shapes. Each layer's store size is a bucket (store_bucket, at least
    `multiple` slots), so the device bytes are about ratio x the filled full cache plus the room (1/8 more at most,
    past 128 slots), and nearby contexts and ratios share compiled steps.
    """
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    _dense_only(cache, "pack")
    kept = np.asarray(kept_per_head(cache))  # [L, B, K]
    layers = []
    for layer, kept_l in zip(cache.layers, kept):
        block = RAGGED_BLOCK
        segments = -(-(kept_l + room) // block) * block  # [B, K] slots per head, whole blocks
        offsets = np.cumsum(segments, axis=1) - segments  # [B, K]
        size = store_bucket(int(segments.sum(axis=1).max()), multiple)
        # Placed as the layer is (committed to its sharding, or not), so the packed cache and the caches a jitted
        # step returns from it look alike to jit: one compile.
        offsets = jax.device_put(offsets.astype(np.int32), layer.k.sharding if layer.k.committed else None)
        layers.append(_pack_layer(layer, offsets, size, block))
    return KVCache(layers=tuple(layers), next_position=jnp.array(cache.next_position))  # a copy: donation-safe


def _pack_layer(layer, offsets: jax.Array, size: int, block: int) -> RaggedLayerCache:
    visible = visible_slots(layer)  # [B, K, C]
    B = visible.shape[0]
    rank = jnp.cumsum(visible, axis=-1, dtype=jnp.int32) - 1  # [B, K, C] place of each kept slot in its segment
    slots = jnp.where(visible, offsets[..., None] + rank, size)  # evicted and empty slots aim past the end
    batch = jnp.arange(B)[:, None, None]
    store = lambda x: jnp.zeros((B, size, x.shape[-1]), x.dtype).at[batch, slots].set(x, mode="drop")
    bias = (
        None if layer.bias is None else jnp.zeros((B, size), jnp.float32).at[batch, slots].set(layer.bias, mode="drop")
    )  # [B, S]
    return RaggedLayerCache(
        k=store(layer.k),
        v=store(layer.v),
        lengths=visible.sum(-1, dtype=jnp.int32),
        offsets=offsets,
        bias=bias,
        block=block,
    )
