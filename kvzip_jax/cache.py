"""The KV cache: an explicit pytree passed into the forward and returned from it, plus its pure operations.

Per layer, `k, v: [B, K, C, H]` hold post-norm, post-RoPE keys and values at their original absolute positions
(RoPE is never re-applied), left-aligned: slots [0, lengths[b, k]) are filled. `lengths: [B, K]` is per KV head
so that compressed caches can keep a different number of pairs per head. `next_position: [B]` is the logical
position the next token gets; it equals the filled length until a compression evicts pairs.

Einsum legend: B batch, K KV heads, C cache capacity (slots), H head dim, T new tokens.
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

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerCache, ...]
    next_position: jax.Array  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per KV head of the smallest layer (compressed caches may size each layer on its own)."""
        return min(layer.capacity for layer in self.layers)

    def lengths(self) -> jax.Array:
        """[L, B, K] filled slots of every layer and KV head."""
        return jnp.stack([layer.lengths for layer in self.layers])

    def room(self) -> jax.Array:
        """[B] tokens every layer and KV head of a row can still take."""
        return jnp.min(jnp.stack([layer.capacity - layer.lengths for layer in self.layers]), axis=(0, 2))


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


def write(layer: LayerCache, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array) -> LayerCache:
    """Writes the first num_new [B] of k_new, v_new [B, K, T, H] at each head's filled length.

    Padding rows (t >= num_new) are dropped, never written, so neither a finished row of a batch nor a cache
    with less spare room than the padded width loses pairs.
    """
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
    return LayerCache(
        k=write_all(layer.k, k_new, layer.lengths, num_new),
        v=write_all(layer.v, v_new, layer.lengths, num_new),
        lengths=layer.lengths + num_new[:, None].astype(jnp.int32),
        keep=layer.keep,  # slots past the context are kept (True) in a masked cache
    )


def nbytes(cache: KVCache) -> int:
    """Device bytes held by the cache arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def used_bytes(cache: KVCache) -> int:
    """Bytes of the K/V pairs actually filled (sum of lengths x head dim x 2 tensors)."""
    total = 0
    for layer in cache.layers:
        per_slot = 2 * layer.k.shape[-1] * layer.k.dtype.itemsize
        total += int(jnp.sum(layer.lengths)) * per_slot
    return total


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
    layers = tuple(dataclasses.replace(layer, lengths=lengths) for layer, lengths in zip(cache.layers, to.lengths))
    return KVCache(layers=layers, next_position=to.next_position)


def grow(cache: KVCache, extra: int) -> KVCache:
    """The same cache with `extra` more empty slots per KV head (a copy)."""
    pad = ((0, 0), (0, 0), (0, extra), (0, 0))
    grow_keep = lambda keep: None if keep is None else jnp.pad(keep, pad[:3], constant_values=True)
    layers = tuple(dataclasses.replace(layer, k=jnp.pad(layer.k, pad), v=jnp.pad(layer.v, pad),
                                       keep=grow_keep(layer.keep)) for layer in cache.layers)
    return dataclasses.replace(cache, layers=layers)


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


def pack(cache: KVCache, room: int) -> KVCache:
    """A ragged compressed cache from a masked one: each (layer, KV head) keeps only its visible filled slots,
    moved to the front in their original order, plus `room` free slots for tokens appended later (question,
    answer). Keys keep their original RoPE positions; next_position is unchanged. Runs on the host (the kept
    counts set the shapes)."""
    capacities = ragged_capacities(cache, room)
    layers = []
    for layer, capacity in zip(cache.layers, capacities):
        visible = _visible(layer)  # [B, K, C]
        k, v = layer.k, layer.v
        if capacity > layer.capacity:
            pad = ((0, 0), (0, 0), (0, capacity - layer.capacity), (0, 0))
            k, v, visible = jnp.pad(k, pad), jnp.pad(v, pad), jnp.pad(visible, pad[:3])
        order = jnp.argsort(~visible, axis=-1, stable=True)[..., :capacity, None]  # [B, K, capacity, 1]
        kept = jnp.minimum(visible.sum(-1), capacity).astype(jnp.int32)  # [B, K]
        in_use = (jnp.arange(capacity) < kept[..., None])[..., None]  # unused slots are zeroed
        gather = lambda x: jnp.where(in_use, jnp.take_along_axis(x, order, axis=2), 0).astype(x.dtype)
        layers.append(LayerCache(k=gather(k), v=gather(v), lengths=kept))
    return KVCache(layers=tuple(layers), next_position=jnp.array(cache.next_position))  # a copy: donation-safe


def ragged_capacities(cache: KVCache, room: int, multiple: int = 16) -> tuple[int, ...]:
    """Per-layer capacities for pack: the most pairs a head of the layer keeps, plus room, rounded up."""
    most = np.asarray(kept_per_head(cache)).max(axis=(1, 2))  # [L]
    return tuple(int(-(-(n + room) // multiple) * multiple) for n in most)


def kept_per_head(cache: KVCache) -> jax.Array:
    """[L, B, K] visible filled slots of every head (what pack needs room for)."""
    return jnp.stack([_visible(layer).sum(-1) for layer in cache.layers]).astype(jnp.int32)


def _visible(layer: LayerCache) -> jax.Array:
    """[B, K, C] bool: filled slots that are not evicted."""
    visible = jnp.arange(layer.capacity) < layer.lengths[..., None]
    return visible if layer.keep is None else visible & layer.keep
