"""Data parallelism for sweeps: contexts (the batch axis) split over every local device with jax.sharding.

Params are replicated; every cache leaf is split along its leading batch axis. jit then runs each device's rows
where they live. Simulate devices on CPU with XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def data_mesh() -> Mesh:
    """A one-axis mesh over all local devices."""
    return Mesh(jax.local_devices(), (DATA_AXIS,))


def batch_multiple(mesh: Mesh) -> int:
    """Batches are padded to a multiple of this (the number of devices)."""
    return mesh.devices.size


def replicate(tree, mesh: Mesh):
    """Every leaf whole on every device of the mesh; leaves already there are used as they are (no second copy
    of the params on a one-device mesh)."""
    devices = set(mesh.devices.flat)
    placed = lambda x: (isinstance(x, jax.Array) and x.sharding.device_set == devices
                        and x.sharding.is_fully_replicated)
    if all(placed(x) for x in jax.tree.leaves(tree)):
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def split_batch(tree, mesh: Mesh):
    """Every leaf split along axis 0 (the batch) over the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(DATA_AXIS)))
