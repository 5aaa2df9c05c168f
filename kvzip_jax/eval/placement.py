"""Where a sweep's arrays live on a (data, seq, tensor) mesh (kvzip_jax.sharding): the params whole on every device,
a batch split along its leading axis over `data`, so jit runs each device's rows where they live.

The sweep's mesh is sharding.data_mesh(), (n, 1, 1) over the local devices; simulate devices on CPU with
XLA_FLAGS=--xla_force_host_platform_device_count=N. On a mesh spanning processes (jax.distributed) every process
passes the same values (jax.device_put checks it), holds its own devices' shards, and gathers results with to_host.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvzip_jax import sharding


def replicate(tree, mesh: Mesh):
    """Every leaf whole on every device of the mesh; a tree already placed so is returned as it is (no second copy
    of the params on a one-device mesh)."""
    devices = set(mesh.devices.flat)
    placed = lambda x: isinstance(x, jax.Array) and x.sharding.device_set == devices and x.sharding.is_fully_replicated
    if all(placed(x) for x in jax.tree.leaves(tree)):
        return tree
    target = sharding.replicated(mesh)
    if not target.is_fully_addressable:  # jax moves no committed array across processes: place host copies
        tree = jax.tree.map(np.asarray, tree)
    return jax.device_put(tree, target)


def split_batch(tree, mesh: Mesh):
    """Every leaf [B, ...] split along B over the mesh's data axis (B a multiple of its size), whole over seq and
    tensor."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(sharding.DATA)))


to_host = sharding.to_host
