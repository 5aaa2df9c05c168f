"""Scaling past one device: the (data, seq, tensor) mesh, partition rules, exact distributed selection.

mesh = sharding.make_mesh(data=2, tensor=4)
params = sharding.shard_params(params, cfg, mesh)
cache = sharding.shard_cache(cache, mesh)
with jax.set_mesh(mesh):
    masked, scores = jax.jit(kvzip.score_and_evict)(params, cfg, cache, reread, 0.3)   # same masks as one device
"""

from kvzip_jax.sharding import memory, segments
from kvzip_jax.sharding.mesh import (
    AXES,
    DATA,
    SEQ,
    TENSOR,
    MeshError,
    batch_multiple,
    check_mesh,
    constrain,
    current_mesh,
    data_mesh,
    make_mesh,
    replicated,
    to_host,
)
from kvzip_jax.sharding.rules import (
    bytes_per_device,
    cache_shardings,
    constrain_cache,
    param_shardings,
    param_spec,
    scores_sharding,
    shard_cache,
    shard_params,
)
from kvzip_jax.sharding.select import top_counts_sharded

__all__ = [
    "AXES",
    "DATA",
    "SEQ",
    "TENSOR",
    "MeshError",
    "batch_multiple",
    "bytes_per_device",
    "cache_shardings",
    "check_mesh",
    "constrain",
    "constrain_cache",
    "current_mesh",
    "data_mesh",
    "make_mesh",
    "memory",
    "param_shardings",
    "param_spec",
    "replicated",
    "scores_sharding",
    "segments",
    "shard_cache",
    "shard_params",
    "to_host",
    "top_counts_sharded",
]
