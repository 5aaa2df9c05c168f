"""Marks: a cache's filled lengths at one moment, and the cache rewound to them (dropping what was appended since)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax.cache.layouts import KVCache, LayerCache, QuantizedLayerCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMark:
    """The filled lengths of a cache at one moment, to drop everything appended after it; for a quantized layer
    also its window as it was (a flush since then moved those tokens into the store, quantized)."""

    lengths: tuple[jax.Array, ...]  # per layer [B, K]
    next_position: jax.Array  # [B]
    windows: tuple[QuantizedLayerCache | None, ...] | None = None  # per layer: the store's lengths and the window


def mark(cache: KVCache) -> CacheMark:
    windows = tuple(
        QuantizedLayerCache(
            store=LayerCache(k=None, v=None, lengths=jnp.array(layer.store.lengths)),
            window=jax.tree.map(jnp.array, layer.window),
        )
        if isinstance(layer, QuantizedLayerCache)
        else None
        for layer in cache.layers
    )
    return CacheMark(
        tuple(jnp.array(layer.lengths) for layer in cache.layers),
        jnp.array(cache.next_position),
        windows if any(w is not None for w in windows) else None,
    )


def rewind(cache: KVCache, to: CacheMark) -> KVCache:
    """The cache as it was at `to` (or `to` moved on by tokens written since, answering.py): pairs appended after it
    are dropped (their slots get overwritten later).

    Valid while the cache has only grown since the mark (left-aligned slots before it are untouched). A quantized
    layer gets its window back exactly when the mark lies in it; a point past the mark's window that a flush has
    since moved into the store stays there, quantized (as if the cache had been filled to it)."""
    windows = to.windows or (None,) * len(cache.layers)
    layers = tuple(
        _rewound(layer, jnp.array(lengths), then)  # copies: the mark outlives donation
        for layer, lengths, then in zip(cache.layers, to.lengths, windows)
    )
    return KVCache(layers=layers, next_position=jnp.array(to.next_position))


def _rewound(layer, lengths: jax.Array, then: QuantizedLayerCache | None):
    if not isinstance(layer, QuantizedLayerCache):
        return dataclasses.replace(layer, lengths=lengths)
    if then is None:
        raise ValueError("a mark taken before the cache was quantized cannot rewind it")
    stored_then, stored_now = then.store.lengths, layer.store.lengths  # [B, K]
    in_old_window = (stored_now > stored_then) & (lengths <= then.lengths)  # flushed since; back in the old window
    stored = jnp.where(in_old_window, stored_then, jnp.clip(lengths, stored_then, stored_now))
    pick = lambda old, new: jnp.where(in_old_window[..., None, None], old, new)
    window = LayerCache(
        k=pick(then.window.k, layer.window.k), v=pick(then.window.v, layer.window.v), lengths=lengths - stored
    )
    return QuantizedLayerCache(
        store=dataclasses.replace(layer.store, lengths=stored), window=window, key_center=layer.key_center
    )
