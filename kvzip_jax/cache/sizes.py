"""Bytes of a cache: the device arrays it holds, and the pairs it holds visible (per row, per slot)."""

from __future__ import annotations

import jax
import numpy as np

from kvzip_jax.cache.layouts import KVCache, QuantizedLayerCache, kept_per_head
from kvzip_jax.quant import groups as quant


def nbytes(cache: KVCache) -> int:
    """Device bytes held by the cache arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def used_bytes(cache: KVCache) -> int:
    """Bytes of the K/V pairs held and visible (filled and, in a masked cache, kept): pairs x (a key and a value:
    head dim values, or a quantized layer's codes, scales and zero points; plus a float32 bias where the cache
    carries one); a quantized layer's window tokens at full precision and its key centres."""
    return int(row_bytes(cache).sum())


def row_bytes(cache: KVCache, to_host=np.asarray) -> np.ndarray:
    """[B] used_bytes of each batch row. to_host: fetches a device array (a multi-process run passes one that
    gathers the other processes' shards)."""
    total = np.zeros(cache.batch_size, np.int64)
    for layer, kept in zip(cache.layers, to_host(kept_per_head(cache)).sum(axis=2)):  # kept [B]
        if isinstance(layer, QuantizedLayerCache):
            window = to_host(layer.window.lengths).sum(axis=1)  # [B]
            total += window * pair_bytes(layer.window) + (kept - window) * pair_bytes(layer.store)
            if layer.key_center is not None:  # its centres: K x W per row
                total += layer.key_center[0].size * layer.key_center.dtype.itemsize
        else:
            total += kept * pair_bytes(layer)
    return total


def pair_bytes(layer) -> int:
    """Bytes one slot of a (dense or ragged) layer holds: its key, its value and its bias."""
    row = lambda x: (
        x.nbytes // int(np.prod(x.shape[:-1])) if isinstance(x, quant.Quantized) else x.shape[-1] * x.dtype.itemsize
    )
    return row(layer.k) + row(layer.v) + (0 if layer.bias is None else 4)
