"""Compaction of a sharded masked cache with no data moving between devices: per (KV head, seq shard) segments.

    small = segments.pack_segments(masked, room=64, mesh=mesh)   # on the host, like cache.pack

Each seq shard of each head keeps its visible pairs (in their order) at the front of its own segment; every segment
has the same size `seg` (the most any (layer, row, head, shard) keeps, plus `room` in every one so the shapes are
equal, in whole blocks), so the capacity becomes seq x seg and the shards stay where they are. The result is a
masked dense cache (cache.LayerCache with keep): slots past a segment's pairs are holes (keep False), and the
lengths point into the last segment, where new tokens are written. Keys keep their original RoPE positions and
next_position is unchanged, so attention is the same; GSPMD merges attention over the seq shards through their
softmax normalisers. Without a mesh (or seq = 1) this is a dense compaction to max kept + room slots per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kvzip_jax import cache as kv
from kvzip_jax.sharding.mesh import DATA, SEQ, TENSOR, axis_size, spec_for
from kvzip_jax.sharding.rules import cache_shardings

SEGMENT_BLOCK = 16  # segment sizes are whole blocks of slots


def pack_segments(cache: kv.KVCache, room: int, mesh=None) -> kv.KVCache:
    """A masked cache of capacity seq x seg holding only the visible pairs of `cache` (dense, masked or compacted
    layers), segment by segment; see the module docstring."""
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    if any(not isinstance(layer, kv.LayerCache) for layer in cache.layers):
        raise TypeError("pack_segments takes dense (masked) layers, not ragged ones")
    S = 1 if mesh is None else axis_size(mesh, SEQ)
    C = cache.layers[0].capacity
    if any(layer.capacity != C for layer in cache.layers) or C % S:
        raise ValueError(
            f"every layer's capacity must be one multiple of seq={S}, got "
            f"{sorted({layer.capacity for layer in cache.layers})}"
        )
    counts = np.asarray(jax.jit(_segment_counts, static_argnums=1)(cache, S))  # [L, B, K, S]
    seg = -(-(int(counts.max()) + room) // SEGMENT_BLOCK) * SEGMENT_BLOCK
    layers = tuple(_pack_layer(layer, seg, S, mesh) for layer in cache.layers)
    packed = kv.KVCache(layers=layers, next_position=jnp.array(cache.next_position))
    return packed if mesh is None else jax.device_put(packed, cache_shardings(packed, mesh))


def _segment_counts(cache: kv.KVCache, S: int) -> jax.Array:
    visible = jnp.stack([kv.visible_slots(layer) for layer in cache.layers])  # [L, B, K, C]
    L, B, K, C = visible.shape
    return visible.reshape(L, B, K, S, C // S).sum(-1, dtype=jnp.int32)


def _compact(k, v, visible, bias, seg: int, last: jax.Array):
    """One shard: k, v [B, K, c, H], visible [B, K, c], bias [B, K, c] or None -> the visible pairs first, in
    [B, K, seg] slots; keep marks them, and in the last segment also the free room after them."""
    c = visible.shape[-1]
    if seg > c:  # a segment larger than the shard's slots: pad with empty ones
        pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, seg - c)] + [(0, 0)] * (x.ndim - 3))
        k, v, visible = pad(k), pad(v), pad(visible)
        bias = None if bias is None else pad(bias)
        c = seg
    order = jnp.argsort(jnp.where(visible, 0, c) + jnp.arange(c), axis=-1)[..., :seg]  # stable: visible first
    take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
    count = visible.sum(-1, dtype=jnp.int32)  # [B, K]
    slots = jnp.arange(seg, dtype=jnp.int32)
    keep = (slots < count[..., None]) | last  # the last segment's room is for new tokens
    return take(k), take(v), keep, None if bias is None else jnp.where(keep, take(bias), 0.0), count


def _pack_layer(layer: kv.LayerCache, seg: int, S: int, mesh) -> kv.LayerCache:
    visible = kv.visible_slots(layer)
    if mesh is None or S == 1:
        k, v, keep, bias, count = _compact(layer.k, layer.v, visible, layer.bias, seg, jnp.bool_(True))
        return kv.LayerCache(k=k, v=v, lengths=count, keep=keep, bias=bias)
    spec = spec_for(mesh, (DATA, TENSOR, SEQ, None), layer.k.shape)
    slot_spec = PartitionSpec(*tuple(spec)[:3])

    def local(k, v, visible, *bias):
        last = jax.lax.axis_index(SEQ) == S - 1
        k, v, keep, b, count = _compact(k, v, visible, bias[0] if bias else None, seg, last)
        return (k, v, keep, count[..., None]) + ((b,) if bias else ())

    bias = () if layer.bias is None else (layer.bias,)
    out = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec, spec, slot_spec) + (slot_spec,) * len(bias),
            out_specs=(spec, spec, slot_spec, slot_spec) + (slot_spec,) * len(bias),
            check_vma=False,
        )
    )(layer.k, layer.v, visible, *bias)
    k, v, keep, counts = out[:4]  # counts [B, K, S]: pairs of each segment
    lengths = (S - 1) * seg + counts[..., -1]  # new tokens go after the last segment's pairs
    return kv.LayerCache(k=k, v=v, lengths=lengths, keep=keep, bias=out[4] if bias else None)
