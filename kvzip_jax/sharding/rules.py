"""Partition rules: where every parameter and cache array lives on a (data, seq, tensor) mesh.

Parameters (params.py layout, linear weights [in, out]) are split over `tensor` along their head or MLP-width
dimension and replicated over data and seq; norms are replicated:

    embed [V, D]          (tensor, -)        lm_head [D, V]   (-, tensor)
    qkv [D, (N+2K)H]      (-, tensor)        o [NH, D]        (tensor, -)
    gate_up [D, 2F]       (-, tensor)        down [F, D]      (tensor, -)
    MLA: q, q_b, kv_b [., N d] (-, tensor); q_a, kv_a (the shared down-projections) replicated

A dimension the axis does not divide stays whole. Caches: dense layers k, v [B, K, C, H] over
(data, tensor, seq, -), lengths [B, K] over (data, tensor), keep and bias [B, K, C] like k; ragged layers split
only their batch (their per-head segments have data-dependent sizes). Scores [L, B, K, n]: (-, data, tensor, seq).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.quant import groups as quant
from kvzip_jax.sharding.mesh import DATA, SEQ, TENSOR, check_mesh, constrain, spec_for
from kvzip_jax.sharding.select import SCORES

PARAM_RULES = (  # (regex on the parameter's path, mesh axis per dimension)
    (r"^embed$", (TENSOR, None)),
    (r"^lm_head$", (None, TENSOR)),
    (r"(^|/)(qkv|gate_up)$", (None, TENSOR)),
    (r"(^|/)(o|down)$", (TENSOR, None)),
    (r"(^|/)qkv_bias$", (TENSOR,)),
    (r"(^|/)(q|q_b|kv_b)$", (None, TENSOR)),  # MLA: per-head columns
    (r"(^|/)(q_a|kv_a)$", None),  # MLA: the shared down-projections
    (r"norm$", None),  # every norm: replicated
)


def _path(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def param_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of parameter `name` ("layers_3/qkv") of `shape` on `mesh`."""
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, name):
            break
    else:
        raise KeyError(f"no partition rule for parameter {name!r}")
    if axes is None:
        return PartitionSpec()
    return spec_for(mesh, axes, shape)


def param_shardings(shapes: dict, mesh: Mesh) -> dict:
    """NamedSharding tree matching `shapes`, a tree of parameter shape tuples (models.params.param_shapes(cfg)),
    for jit in/out shardings and orbax restore targets. The caller checks the model against the mesh (check_mesh)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, shape: NamedSharding(mesh, param_spec(_path(path), shape, mesh)),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """params placed by the partition rules (each device receives only its shards); MeshError when `tensor` does
    not divide the model's KV heads."""
    check_mesh(cfg, mesh)
    return jax.device_put(params, param_shardings(jax.tree.map(np.shape, params), mesh))


def _map_cache(cache: kv.KVCache, fn) -> kv.KVCache:
    """cache with every array x replaced by fn(x, its mesh axes per dimension); None leaves stay None."""

    def on(x, axes):
        if isinstance(x, quant.Quantized):  # codes, scales and zero points laid out as the rows they stand for
            return jax.tree.map(lambda a: fn(a, axes), x)
        return None if x is None else fn(x, axes)

    def layer(lc):
        if isinstance(lc, kv.QuantizedLayerCache):
            heads = None if isinstance(lc.store, kv.RaggedLayerCache) else TENSOR  # key_center [B, K, W] as the store
            return kv.QuantizedLayerCache(
                store=layer(lc.store), window=layer(lc.window), key_center=on(lc.key_center, (DATA, heads, None))
            )
        if isinstance(lc, kv.RaggedLayerCache):  # per-head segments of data-dependent size: only rows are split
            row = lambda x: on(x, (DATA,) + (None,) * (x.ndim - 1 if x is not None else 0))
            return kv.RaggedLayerCache(
                k=row(lc.k),
                v=row(lc.v),
                lengths=row(lc.lengths),
                offsets=row(lc.offsets),
                bias=row(lc.bias),
                block=lc.block,
            )
        return kv.LayerCache(
            k=on(lc.k, (DATA, TENSOR, SEQ, None)),
            v=on(lc.v, (DATA, TENSOR, SEQ, None)),
            lengths=on(lc.lengths, (DATA, TENSOR)),
            keep=on(lc.keep, (DATA, TENSOR, SEQ)),
            bias=on(lc.bias, (DATA, TENSOR, SEQ)),
        )

    return kv.KVCache(layers=tuple(layer(lc) for lc in cache.layers), next_position=fn(cache.next_position, (DATA,)))


def cache_shardings(cache: kv.KVCache, mesh: Mesh) -> kv.KVCache:
    """A tree of NamedSharding matching `cache` (None leaves stay None)."""
    return _map_cache(cache, lambda x, axes: _named(mesh, axes, x.shape))


def constrain_cache(cache: kv.KVCache) -> kv.KVCache:
    """Inside jit: cache laid out by the rules over the current mesh (unchanged without one)."""
    return _map_cache(cache, lambda x, axes: constrain(x, *axes))


def _named(mesh: Mesh, axes, shape) -> NamedSharding:
    return NamedSharding(mesh, spec_for(mesh, axes, shape))


def shard_cache(cache: kv.KVCache, mesh: Mesh) -> kv.KVCache:
    """cache placed by the partition rules."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


def scores_sharding(shape, mesh: Mesh) -> NamedSharding:
    return _named(mesh, SCORES, shape)


def bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s shards held there}."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + int(np.prod(shard.data.shape)) * leaf.dtype.itemsize
    return held
