"""The KV cache: an explicit pytree passed into the forward and returned from it, plus its pure operations.

Per layer, `k, v: [B, K, C, H]` hold post-norm, post-RoPE keys and values at their original absolute positions
(RoPE is never re-applied), left-aligned: slots [0, lengths[b, k]) are filled. `lengths: [B, K]` is per KV head
so that compressed caches can keep a different number of pairs per head. `next_position: [B]` is the logical
position the next token gets; it equals the filled length until a compression evicts pairs.

Compressed forms: a masked cache is the same arrays plus `keep: [B, K, C]` (mask_context); a ragged cache
(pack) stores each layer as one flat `[B, S, H]` store of per-KV-head segments with `offsets: [B, K]`
(RaggedLayerCache), so its bytes follow the pairs each head keeps.

A full cache: every head has a fixed room (the capacity of a dense layer, its segment of a ragged one). `write`
stores what fits and drops the rest, so `lengths` never exceed a head's room and no head writes into another's
segment. Callers check first: prefill and ask raise ContextTooLongError before writing tokens that do not fit,
and the decode loop ends a row whose cache is full (room() == 0) while the other rows go on.

Einsum legend: B batch, K KV heads, C cache capacity (slots), S ragged store slots, H head dim, T new tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: jax.Array  # [B, K, C, H]
    v: jax.Array  # [B, K, C, H]
    lengths: jax.Array  # [B, K] int32, filled slots per KV head
    keep: jax.Array | None = None  # [B, K, C] bool in a masked compressed cache: False slots are evicted
    bias: jax.Array | None = None  # [B, K, C] float32 logit added per slot (Attention Matching's beta; 0 elsewhere)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


RAGGED_BLOCK = 16  # slots per block of a ragged layer; every head's segment is a whole number of blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedLayerCache:
    """A compressed layer storing only kept pairs: one flat store per row holding every KV head's segment.

    Head k's slot i of row b is k[b, offsets[b, k] + i]; its segment runs to the next head's offset (the last to S),
    so the room left for appended tokens is per head. Segments start on multiples of `block`.
    """

    k: jax.Array  # [B, S, H]
    v: jax.Array  # [B, S, H]
    lengths: jax.Array  # [B, K] int32, filled slots per KV head
    offsets: jax.Array  # [B, K] int32, first store slot of each head's segment
    bias: jax.Array | None = None  # [B, S] float32 logit added per store slot (Attention Matching's beta)
    block: int = dataclasses.field(default=RAGGED_BLOCK, metadata=dict(static=True))

    def head_capacity(self) -> jax.Array:
        """[B, K] slots of each head's segment."""
        ends = jnp.concatenate([self.offsets[:, 1:], jnp.full_like(self.offsets[:, :1], self.k.shape[1])], axis=1)
        return ends - self.offsets


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerCache | RaggedLayerCache, ...]
    next_position: jax.Array  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per KV head of the smallest dense layer."""
        return min(layer.capacity for layer in self.layers if isinstance(layer, LayerCache))

    def lengths(self) -> jax.Array:
        """[L, B, K] filled slots of every layer and KV head."""
        return jnp.stack([layer.lengths for layer in self.layers])

    def room(self) -> jax.Array:
        """[B] tokens every layer and KV head of a row can still take."""
        return jnp.min(jnp.stack([_room(layer) for layer in self.layers]), axis=(0, 2))


def _room(layer) -> jax.Array:
    """[B, K] free slots of every head."""
    if isinstance(layer, RaggedLayerCache):
        return layer.head_capacity() - layer.lengths
    return layer.capacity - layer.lengths


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for `capacity` tokens per KV head in every layer."""
    shape = (batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)  # [B, K, C, H]
    layer = lambda: LayerCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size, cfg.num_kv_heads), jnp.int32),
    )
    return KVCache(layers=tuple(layer() for _ in range(cfg.num_layers)),
                   next_position=jnp.zeros((batch_size,), jnp.int32))


def write(layer, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array):
    """Writes the first num_new [B] of k_new, v_new [B, K, T, H] at each head's filled length.

    Padding rows (t >= num_new) are dropped, never written, so neither a finished row of a batch nor a cache
    with less spare room than the padded width loses pairs. Rows past a head's room are dropped too, and the
    lengths count only what was stored (at most the head's room; see the module docstring on full caches).
    """
    if isinstance(layer, RaggedLayerCache):
        return _write_ragged(layer, k_new, v_new, num_new)
    T = k_new.shape[2]

    def write_head(cache_kh, new_kh, start, count):  # [C, H], [T, H], [], []
        C = cache_kh.shape[0]
        new_kh = new_kh.astype(cache_kh.dtype)
        rows = jnp.arange(T)
        if T > C:  # a padded block wider than the whole cache: scatter the real rows
            target = jnp.where(rows < count, start + rows, C)  # padding aims past the end: dropped
            return cache_kh.at[target].set(new_kh, mode="drop")
        base = jnp.minimum(start, C - T)  # a block that fits; the real rows go to start within it
        shift = start - base
        old = jax.lax.dynamic_slice_in_dim(cache_kh, base, T, axis=0)  # [T, H]
        moved = jnp.roll(new_kh, shift, axis=0)
        real = ((rows >= shift) & (rows - shift < count))[:, None]
        return jax.lax.dynamic_update_slice_in_dim(cache_kh, jnp.where(real, moved, old), base, axis=0)

    write_all = jax.vmap(jax.vmap(write_head, in_axes=(0, 0, 0, None)))
    return written(layer, write_all(layer.k, k_new, layer.lengths, num_new),
                   write_all(layer.v, v_new, layer.lengths, num_new), num_new)


def written(layer: LayerCache, k: jax.Array, v: jax.Array, num_new: jax.Array) -> LayerCache:
    """A dense layer after a write of num_new [B] pairs per head whose K, V [B, K, C, H] are already stored: the
    lengths grow by what fits (at most the capacity); the keep mask and the bias are unchanged (slots past the
    context are kept, and new tokens get no bias)."""
    lengths = jnp.minimum(layer.lengths + num_new[:, None].astype(jnp.int32), layer.capacity)
    return LayerCache(k=k, v=v, lengths=lengths, keep=layer.keep, bias=layer.bias)


def _write_ragged(layer: RaggedLayerCache, k_new, v_new, num_new) -> RaggedLayerCache:
    B, K, T, H = k_new.shape
    rows = jnp.arange(T, dtype=jnp.int32)
    room = layer.head_capacity() - layer.lengths  # [B, K]
    stored = jnp.minimum(num_new[:, None].astype(jnp.int32), room)  # [B, K] new pairs each head can take
    slots = layer.offsets[..., None] + layer.lengths[..., None] + rows  # [B, K, T] store slot of each new pair
    slots = jnp.where(rows < stored[..., None], slots, layer.k.shape[1])  # padding and overflow aim past the end
    batch = jnp.arange(B)[:, None, None]
    put = lambda store, new: store.at[batch, slots].set(new.astype(store.dtype), mode="drop")
    return dataclasses.replace(layer, k=put(layer.k, k_new), v=put(layer.v, v_new), lengths=layer.lengths + stored)


def nbytes(cache: KVCache) -> int:
    """Device bytes held by the cache arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def used_bytes(cache: KVCache) -> int:
    """Bytes of the K/V pairs held and visible (filled and, in a masked cache, kept): pairs x (2 x head dim values,
    plus a float32 bias where the cache carries one)."""
    per_slot = [2 * layer.k.shape[-1] * layer.k.dtype.itemsize + (0 if layer.bias is None else 4)
                for layer in cache.layers]
    return int(sum(int(n) * size for n, size in zip(np.asarray(kept_per_head(cache)).sum(axis=(1, 2)), per_slot)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMark:
    """The filled lengths of a cache at one moment, to drop everything appended after it."""

    lengths: tuple[jax.Array, ...]  # per layer [B, K]
    next_position: jax.Array  # [B]


def mark(cache: KVCache) -> CacheMark:
    return CacheMark(tuple(jnp.array(layer.lengths) for layer in cache.layers), jnp.array(cache.next_position))


def rewind(cache: KVCache, to: CacheMark) -> KVCache:
    """The cache as it was at `to`: pairs appended since then are dropped (their slots get overwritten later).

    Valid while the cache has only grown since the mark (left-aligned slots before it are untouched).
    """
    layers = tuple(dataclasses.replace(layer, lengths=jnp.array(lengths))  # copies: the mark outlives donation
                   for layer, lengths in zip(cache.layers, to.lengths))
    return KVCache(layers=layers, next_position=jnp.array(to.next_position))


def mask_context(cache: KVCache, keep: jax.Array, prefix_len: jax.Array, context_len: jax.Array) -> KVCache:
    """A masked compressed cache: context slots [prefix_len, prefix_len + context_len) follow keep [L, B, K, n]
    (n >= context_len); every other slot (the prefix, anything appended later) stays visible. Nothing is moved;
    memory is unchanged."""
    L, B, K, n = keep.shape
    layers = []
    for layer, layer_keep in zip(cache.layers, keep):
        slots = jnp.arange(layer.capacity, dtype=jnp.int32)  # [C]
        offset = slots[None, :] - prefix_len[:, None]  # [B, C] context offset of each slot
        in_context = (offset >= 0) & (offset < context_len[:, None])
        gathered = jnp.take_along_axis(layer_keep, jnp.clip(offset, 0, n - 1)[:, None, :], axis=-1)  # [B, K, C]
        layers.append(dataclasses.replace(layer, keep=jnp.where(in_context[:, None, :], gathered, True)))
    return dataclasses.replace(cache, layers=tuple(layers))


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
    bias = None if layer.bias is None else jnp.zeros((B, size), jnp.float32).at[batch, slots].set(
        layer.bias, mode="drop")  # [B, S]
    return RaggedLayerCache(k=store(layer.k), v=store(layer.v), lengths=visible.sum(-1, dtype=jnp.int32),
                            offsets=offsets, bias=bias, block=block)


def defragment(cache: KVCache) -> KVCache:
    """A dense cache from a masked (or compacted) one of the same capacity: each head's visible filled slots move
    to the front, in their order, with their bias; the evicted slots become free room for new tokens. Keys keep their
    original RoPE and next_position is unchanged, so attention is the same. Jittable (shapes do not change)."""
    return dataclasses.replace(cache, layers=tuple(_defragment_layer(layer) for layer in cache.layers),
                               next_position=jnp.array(cache.next_position))


def _defragment_layer(layer):
    if not isinstance(layer, LayerCache):
        raise TypeError("defragment takes dense (masked) layers; a ragged layer stores only its kept pairs already")
    if layer.keep is None:
        return layer
    visible = visible_slots(layer)  # [B, K, C]
    # A stable order that puts the visible slots first: slot index, offset by C for the others.
    order = jnp.argsort(jnp.where(visible, 0, layer.capacity) + jnp.arange(layer.capacity), axis=-1)  # [B, K, C]
    gather = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
    return LayerCache(k=gather(layer.k), v=gather(layer.v), lengths=visible.sum(-1, dtype=jnp.int32),
                      bias=None if layer.bias is None else gather(layer.bias))


def grown(cache: KVCache, extra: int) -> KVCache:
    """A copy of a dense cache with `extra` more slots per head (room for a pass on top of a full cache)."""
    if extra < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")

    def grow(layer):
        if not isinstance(layer, LayerCache):
            raise TypeError("grown takes a dense cache, not a ragged one")
        pad = lambda x, value=0: None if x is None else jnp.pad(
            x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3), constant_values=value)
        return LayerCache(k=pad(layer.k), v=pad(layer.v), lengths=jnp.copy(layer.lengths), keep=pad(layer.keep, True),
                          bias=pad(layer.bias))

    return KVCache(layers=tuple(grow(layer) for layer in cache.layers), next_position=jnp.copy(cache.next_position))


def tiled_rows(cache: KVCache, copies: int) -> KVCache:
    """`copies` copies of a cache's batch (or a layer's) stacked along it: row c B + b is row b. New arrays, even
    for one copy (the result may be donated)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return jax.tree.map(lambda x: jnp.concatenate([x] * copies, axis=0) if copies > 1 else jnp.copy(x), cache)


def kept_per_head(cache: KVCache) -> jax.Array:
    """[L, B, K] visible filled slots of every head (what pack needs room for)."""
    return jnp.stack([visible_slots(layer).sum(-1) if isinstance(layer, LayerCache) else layer.lengths
                      for layer in cache.layers]).astype(jnp.int32)


def visible_slots(layer: LayerCache) -> jax.Array:
    """[B, K, C] bool: filled slots that are not evicted."""
    visible = jnp.arange(layer.capacity) < layer.lengths[..., None]
    return visible if layer.keep is None else visible & layer.keep
