"""Attention over a cache whose slots are split over the mesh's seq axis: each seq shard writes and attends over its
own slots, and the shards' results merge through their log-sum-exp. No key or value leaves its device.

    split = seq_split(layer_cache)      # None: no mesh, seq = 1, seq does not divide the slots, or ragged
    layer_cache = split_write(layer_cache, k_new, v_new, num_new, split)
    out, lse, subset_lse = merged_attention(q, layer_cache, query_slots, window, scale, split)

Left to GSPMD, cache.write's update at a run-time offset of the sharded slot axis gathers each layer's K and V for
a prefill chunk; split_write has each shard store the new rows that fall in its own slots (a scatter dropping the
rest), with cache.write's rules: padding rows and rows past the capacity are never stored.

Likewise, the online softmax's loop over key blocks slices the slot axis at run-time offsets, and XLA gathers
every layer's whole K and V onto each device at every decode step. Here each shard runs blocked_attention on its
C / S slots (lengths and query slots shifted to its first slot; masks compare slot differences, so they hold),
giving out_s and lse_s per query row; then with m = max_s lse_s (pmax over seq):

    out = sum_s out_s exp(lse_s - m) / sum_s exp(lse_s - m)        (two psums of [B, K, G, T] rows and the outputs)

and lse = m + log sum_s exp(lse_s - m) (the subset normaliser likewise). A shard whose slots a row cannot see has
lse_s = MASK_VALUE (finite), so its weight is exp(MASK_VALUE - m) = 0; a row no shard can see gets out 0, as on one
device. Observed passes (the KVzip reread) attend to new keys outside the cache: attention.then_new_keys continues
the merged result with them.

Einsum legend: B batch, T query positions, K KV heads, G query heads per KV head, H head dim, C cache slots.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from kvzip_jax import cache as kv
from kvzip_jax.models.attention import MASK_VALUE, blocked_attention
from kvzip_jax.sharding.mesh import DATA, SEQ, TENSOR, current_mesh, spec_for


class SeqSplit(typing.NamedTuple):
    """The current mesh and the cache's layout on it, PartitionSpec(data | None, tensor | None, seq, None)."""

    mesh: typing.Any
    spec: PartitionSpec


def seq_split(layer_cache: kv.LayerCache | kv.RaggedLayerCache) -> SeqSplit | None:
    """How a dense layer's k [B, K, C, H] is laid out by the partition rules on the current mesh, when its slots are
    split over seq (seq > 1 divides C); else None (and always for ragged layers, split by row only)."""
    mesh = current_mesh()
    if mesh is None or not isinstance(layer_cache, kv.LayerCache):
        return None
    spec = spec_for(mesh, (DATA, TENSOR, SEQ, None), layer_cache.k.shape)
    return SeqSplit(mesh, spec) if spec[2] == SEQ else None


def merged_attention(
    q, layer_cache: kv.LayerCache, query_slots, window: int | None, scale: float, split: SeqSplit, in_subset=None
):
    """blocked_attention of q [B, T, K, G, H] over a dense cache's visible slots, one seq shard at a time, merged
    exactly; query_slots [B, K, T]; in_subset [B, K, C] bool marks the slots of the subset normaliser (None: all).
    -> (out [B, T, K, G, H] in q's dtype, lse, subset_lse [B, K, G, T]) as blocked_attention returns them."""
    data, tensor = split.spec[0], split.spec[1]
    rows, slots = PartitionSpec(data, tensor, None, None), PartitionSpec(data, tensor, SEQ)
    query_spec = PartitionSpec(data, None, tensor, None, None)
    optional = {
        name: x
        for name, x in (("keep", layer_cache.keep), ("bias", layer_cache.bias), ("in_subset", in_subset))
        if x is not None
    }

    def local(q, k, v, filled, query_slots, *arrays):  # this shard's C / S slots
        extra = dict(zip(optional, arrays))
        width = k.shape[2]
        first = jax.lax.axis_index(SEQ) * width  # the shard's first slot
        subset = None
        if "in_subset" in extra:
            subset = lambda slots: jnp.take_along_axis(extra["in_subset"], slots, axis=2)  # noqa: E731
        out, lse, subset_lse = blocked_attention(
            q,
            k,
            v,
            jnp.clip(filled - first, 0, width),
            None,
            None,
            query_slots - first,
            window,
            scale,
            extra.get("keep"),
            subset=subset,
            key_bias=extra.get("bias"),
        )  # out [B, T, K, G, H], lse [B, K, G, T]
        top = jax.lax.pmax(lse, SEQ)
        weight = jnp.exp(lse - top)  # [B, K, G, T]
        total = jax.lax.psum(weight, SEQ)  # >= 1: the shard holding the max contributes exp(0)
        share = (weight / total).transpose(0, 3, 1, 2)[..., None]  # [B, T, K, G, 1]
        out = jax.lax.psum(out.astype(jnp.float32) * share, SEQ).astype(q.dtype)
        subset_total = jax.lax.psum(jnp.exp(subset_lse - top), SEQ)  # 0: no visible key of the subset
        saw = top > MASK_VALUE / 2  # the row sees a key on some shard (as attention._finish marks it)
        log = lambda x: jnp.where(saw, top + jnp.log(jnp.where(saw, x, 1.0)), MASK_VALUE)  # noqa: E731
        return out, log(total), log(subset_total)

    in_specs = (query_spec, split.spec, split.spec, PartitionSpec(data, tensor), PartitionSpec(data, tensor, None))
    return jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=in_specs + (slots,) * len(optional),
        out_specs=(query_spec, rows, rows),
        check_vma=False,
    )(q, layer_cache.k, layer_cache.v, layer_cache.lengths, query_slots, *optional.values())


def split_write(layer: kv.LayerCache, k_new, v_new, num_new, split: SeqSplit) -> kv.LayerCache:
    """cache.write of the first num_new [B] of k_new, v_new [B, K, T, H] at each head's filled length, on a dense
    cache whose slots are split over seq: each shard scatters the rows that land in its own slots."""
    data, tensor = split.spec[0], split.spec[1]
    new_spec = PartitionSpec(data, tensor, None, None)  # the new rows, on every seq shard

    def local(k, v, filled, k_new, v_new, count):
        B, K, width, _ = k.shape
        rows = jnp.arange(k_new.shape[2], dtype=jnp.int32)
        target = (filled - jax.lax.axis_index(SEQ) * width)[..., None] + rows  # [B, K, T] slots of this shard
        stored = (rows < count[:, None, None]) & (target >= 0) & (target < width)
        target = jnp.where(stored, target, width)  # past the end: dropped
        batch, head = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
        put = lambda cache, new: cache.at[batch, head, target].set(new.astype(cache.dtype), mode="drop")  # noqa: E731
        return put(k, k_new), put(v, v_new)

    k, v = jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=(split.spec, split.spec, PartitionSpec(data, tensor), new_spec, new_spec, PartitionSpec(data)),
        out_specs=(split.spec, split.spec),
        check_vma=False,
    )(layer.k, layer.v, layer.lengths, k_new, v_new, num_new.astype(jnp.int32))
    return kv.written(layer, k, v, num_new)
