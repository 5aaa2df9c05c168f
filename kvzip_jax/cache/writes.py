"""Appending tokens to a layer of any layout: each head's new pairs go after its filled slots.

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

from kvzip_jax.cache.layouts import LayerCache, QuantizedLayerCache, RaggedLayerCache, _room
from kvzip_jax.quant import groups as quant


def write(layer, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array):
    """Writes the first num_new [B] of k_new, v_new [B, K, T, H] at each head's filled length.

    Padding rows (t >= num_new) are dropped, never written, so neither a finished row of a batch nor a cache
    with less spare room than the padded width loses pairs. Rows past a head's room are dropped too, and the
    lengths count only what was stored (at most the head's room; see the module docstring on full caches).
    """
    if isinstance(layer, QuantizedLayerCache):
        return _write_quantized(layer, k_new, v_new, num_new)
    if isinstance(layer, RaggedLayerCache):
        return _write_ragged(layer, k_new, v_new, num_new)
    count = jnp.broadcast_to(num_new[:, None], layer.lengths.shape)
    return written(
        layer,
        _write_dense(layer.k, k_new, layer.lengths, count),
        _write_dense(layer.v, v_new, layer.lengths, count),
        num_new,
    )


def _write_dense(store: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """store [B, K, C, ...] with the first count [B, K] rows of new [B, K, T, ...] at slots start [B, K] (rows past
    C dropped)."""
    T = new.shape[2]

    def write_head(cache_kh, new_kh, start, count):  # [C, ...], [T, ...], [], []
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

    return jax.vmap(jax.vmap(write_head))(store, new, start, count)


def written(layer: LayerCache, k: jax.Array, v: jax.Array, num_new: jax.Array) -> LayerCache:
    """A dense layer after a write of num_new [B] pairs per head whose K, V [B, K, C, H] are already stored: the
    lengths grow by what fits (at most the capacity); the keep mask and the bias are unchanged (slots past the
    context are kept, and new tokens get no bias)."""
    lengths = jnp.minimum(layer.lengths + num_new[:, None].astype(jnp.int32), layer.capacity)
    return LayerCache(k=k, v=v, lengths=lengths, keep=layer.keep, bias=layer.bias)


def _write_ragged(layer: RaggedLayerCache, k_new, v_new, num_new) -> RaggedLayerCache:
    count = jnp.broadcast_to(num_new[:, None].astype(jnp.int32), layer.lengths.shape)
    stored = jnp.minimum(count, layer.head_capacity() - layer.lengths)  # [B, K] new pairs each head can take
    put = lambda store, new: _put_ragged(store, new, layer.offsets + layer.lengths, stored)
    return dataclasses.replace(layer, k=put(layer.k, k_new), v=put(layer.v, v_new), lengths=layer.lengths + stored)


def _put_ragged(store: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """store [B, S, ...] with the first count [B, K] rows of head k's new [B, K, T, ...] at store slots start [B, K]
    onward (the caller keeps them within the head's segment)."""
    B, T = new.shape[0], new.shape[2]
    rows = jnp.arange(T, dtype=jnp.int32)
    slots = jnp.where(rows < count[..., None], start[..., None] + rows, store.shape[1])  # [B, K, T]; rest dropped
    return store.at[jnp.arange(B)[:, None, None], slots].set(new.astype(store.dtype), mode="drop")


def _write_quantized(layer: QuantizedLayerCache, k_new, v_new, num_new) -> QuantizedLayerCache:
    """[window | new] -> the store (all but the last ((n - 1) mod R) + 1, quantized) and the window (the rest)."""
    window, store = layer.window, layer.store
    R, T = window.capacity, k_new.shape[2]
    grow = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, T), (0, 0)])
    both = write(LayerCache(k=grow(window.k), v=grow(window.v), lengths=window.lengths), k_new, v_new, num_new)
    total = both.lengths  # [B, K] rows of [window | new]
    flushed = jnp.where(total > R, (total - 1) // R * R, 0)  # [B, K] a multiple of R
    stored = jnp.minimum(flushed, _room(store))  # rows past the store's room are dropped (callers check room())
    if isinstance(store, RaggedLayerCache):
        put = lambda old, new: jax.tree.map(
            lambda o, n: _put_ragged(o, n, store.offsets + store.lengths, stored), old, new
        )
    else:
        put = lambda old, new: jax.tree.map(lambda o, n: _write_dense(o, n, store.lengths, stored), old, new)
    keys = both.k if layer.key_center is None else both.k - layer.key_center[:, :, None, :].astype(jnp.float32)
    store = dataclasses.replace(
        store,
        k=put(store.k, quant.quantize(keys, store.k.format)),  # each in its own format (k8v4;
        v=put(store.v, quant.quantize(both.v, store.v.format)),  # MLA: k and v differ in width)
        lengths=store.lengths + stored,
    )
    rest = jnp.minimum(flushed[..., None] + jnp.arange(R), R + T - 1)  # [B, K, R] rows left in the window
    keep = lambda x: jnp.take_along_axis(x, rest[..., None], axis=2)
    return QuantizedLayerCache(
        store=store,
        window=LayerCache(k=keep(both.k), v=keep(both.v), lengths=total - flushed),
        key_center=layer.key_center,
    )
