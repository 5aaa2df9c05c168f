"""The device mesh: axes (data, seq, tensor), and activation constraints that hold on every platform.

    mesh = sharding.make_mesh(data=2, seq=1, tensor=4)     # 8 devices
    sharding.check_mesh(cfg, mesh)                           # tensor divides the KV heads, or MeshError
    with jax.set_mesh(mesh):
        masked, scores = compress(params, cfg, cache, reread, 0.3)

data splits the batch (contexts of a sweep), seq the cache slots, tensor the heads (KV heads are never replicated:
every tensor shard holds whole KV heads and their query heads, so it scores them completely). data is the outermost
axis so it can span hosts.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import KvzipError

DATA, SEQ, TENSOR = "data", "seq", "tensor"
AXES = (DATA, SEQ, TENSOR)


class MeshError(KvzipError, ValueError):
    """A mesh that does not fit the devices or the model (tensor must divide the KV heads)."""


def make_mesh(data: int = 1, seq: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, seq, tensor) mesh over `devices` (default: every device of every process when their count is
    data x seq x tensor, else the first that many local ones). Axes are Auto: GSPMD propagates shardings and
    shard_map is used where the code must be explicit."""
    shape = (data, seq, tensor)
    if any(int(n) < 1 for n in shape):
        raise MeshError(f"mesh axes must be positive, got data={data}, seq={seq}, tensor={tensor}")
    size = data * seq * tensor
    if devices is None:
        devices = jax.devices() if jax.device_count() == size else jax.local_devices()[:size]
    devices = list(devices)
    if len(devices) != size:
        raise MeshError(
            f"a ({data}, {seq}, {tensor}) mesh needs {size} devices, {len(devices)} available "
            f"(simulate CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count={size})"
        )
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def data_mesh() -> Mesh:
    """(n, 1, 1) over every local device: the batch split, parameters and heads whole on each device."""
    return make_mesh(data=len(jax.local_devices()))


def axis_size(mesh, name: str) -> int:
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)


def check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
    """Raises MeshError unless `tensor` divides the model's KV heads (so no KV head is split or replicated)."""
    tensor = axis_size(mesh, TENSOR)
    if cfg.num_kv_heads % tensor:
        raise MeshError(
            f"tensor={tensor} does not divide the model's {cfg.num_kv_heads} KV heads: every tensor shard must hold "
            f"whole KV heads; put the other devices on seq or data"
        )


def batch_multiple(mesh: Mesh) -> int:
    """Batches are padded to a multiple of this (the data axis)."""
    return axis_size(mesh, DATA)


def current_mesh():
    """The mesh set by `jax.set_mesh` (abstract under jit), or None when there is none or it has one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def spec_on(mesh, *names) -> PartitionSpec:
    """PartitionSpec(*names) with the axes `mesh` lacks (or of size 1) dropped."""
    present = {n for n, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1}
    return PartitionSpec(*(n if n in present else None for n in names))


def spec_for(mesh, names, shape) -> PartitionSpec:
    """PartitionSpec(*names) for an array of `shape`, keeping only the axes `mesh` has (size > 1) that divide their
    dimension."""
    spec = spec_on(mesh, *names)
    return PartitionSpec(*(n if n is None or dim % axis_size(mesh, n) == 0 else None for n, dim in zip(spec, shape)))


def constrain(x: jax.Array, *names) -> jax.Array:
    """x laid out as PartitionSpec(*names) over the current mesh (jax.lax.with_sharding_constraint); unchanged
    without a mesh. Unlike flax's logical constraints this is not a no-op on CPU, so tests see it."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(mesh, names, x.shape))


def to_host(x) -> np.ndarray:
    """x as a numpy array; an array split over other processes' devices is gathered from them first (a collective:
    every process calls it at the same point)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
