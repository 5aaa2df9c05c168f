"""Builds the parameter tree of params.py from source tensors, shared by the GGUF and safetensors converters.

A converter names, for each source tensor, the Slot it fills: a parameter path plus, for fused parameters, the part
(`qkv` <- q, k, v; `qkv_bias` <- q, k, v; `gate_up` <- gate, up). Source tensors are in the torch / GGUF-numpy
layout: linear weights [out, in], embedding [V, D], vectors [n]. `assemble_params` checks every tensor's shape and
that each slot is filled exactly once before reading any, then reads one parameter at a time: transposes linear
weights to [in, out], fuses parts along the output axis and hands the result to `place` (placer: a dtype cast and,
with a mesh, the parameter's devices, so a sharded conversion never holds the model on one host). Tensors keep the
source's precision (dtypes.storage: bf16 stays bf16, so an 8B model is never written as 32 GB of float32); a
transform (un-permute, +1) runs and stores in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import numpy as np

from kvzip_jax import dtypes, sharding
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import WeightShapeError
from kvzip_jax.models.params import param_shapes

FUSED_PARTS = {"qkv": ("q", "k", "v"), "qkv_bias": ("q", "k", "v"), "gate_up": ("gate", "up")}
NOT_TRANSPOSED = ("embed",)  # [V, D] in the source already


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one source tensor goes: a parameter path like ('layers_3', 'qkv') and, for fused params, its part."""

    path: tuple[str, ...]
    part: str | None = None

    def __str__(self) -> str:
        return "/".join(self.path) + (f"[{self.part}]" if self.part else "")


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """One tensor read from a checkpoint. `load()` returns it in the source layout; `transform` maps the source
    value to our convention (un-permute, +1) and runs after the shape check."""

    name: str
    slot: Slot
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    transform: Callable[[np.ndarray], np.ndarray] | None = None


def flat_param_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """param_shapes flattened to path -> shape."""
    flat = {}
    for key, value in param_shapes(cfg).items():
        if isinstance(value, dict):
            flat.update({(key, name): shape for name, shape in value.items()})
        else:
            flat[(key,)] = value
    return flat


def _part_width(cfg: ModelConfig, part: str) -> int:
    widths = {
        "q": cfg.num_heads * cfg.head_dim,
        "k": cfg.num_kv_heads * cfg.head_dim,
        "v": cfg.num_kv_heads * cfg.head_dim,
        "gate": cfg.intermediate_size,
        "up": cfg.intermediate_size,
    }
    return widths[part]


def source_shape(cfg: ModelConfig, slot: Slot, shapes: dict) -> tuple[int, ...]:
    """Expected shape of the source tensor for `slot`, in the source layout ([out, in] for linear weights)."""
    shape = shapes[slot.path]
    if slot.part is not None:
        shape = shape[:-1] + (_part_width(cfg, slot.part),)
    return shape[::-1] if len(shape) == 2 and slot.path[-1] not in NOT_TRANSPOSED else shape


def assemble_params(
    cfg: ModelConfig, tensors: Iterable[SourceTensor], place: Callable[[tuple[str, ...], np.ndarray], Any] | None = None
) -> dict:
    """Nested parameter tree of `param_shapes(cfg)` from source tensors, in their storage dtypes.

    Every slot and header shape is checked, and every missing parameter or part listed, before any tensor is read
    (WeightShapeError naming the tensor). Then one parameter at a time: its tensors are read, transformed, transposed,
    fused and handed to place(path, value [param shape]), whose result becomes the leaf (default: the numpy value).
    A `place` that moves the value off the host (placer) keeps at most one parameter on the host.
    """
    shapes = flat_param_shapes(cfg)
    filled: dict[Slot, SourceTensor] = {}
    for tensor in tensors:
        slot = tensor.slot
        if (
            slot.path not in shapes
            or (slot.part is not None) != (slot.path[-1] in FUSED_PARTS)
            or (slot.part is not None and slot.part not in FUSED_PARTS[slot.path[-1]])
        ):
            raise WeightShapeError(f"tensor {tensor.name!r} maps to {slot}, which this model config does not have")
        if slot in filled:
            raise WeightShapeError(f"tensors {filled[slot].name!r} and {tensor.name!r} both fill {slot}")
        expected = source_shape(cfg, slot, shapes)
        if tuple(tensor.shape) != expected:
            raise WeightShapeError(
                f"tensor {tensor.name!r} has shape {tuple(tensor.shape)}, expected {expected} for {slot}"
            )
        filled[slot] = tensor
    slots = {
        path: [Slot(path, part) for part in FUSED_PARTS[path[-1]]] if path[-1] in FUSED_PARTS else [Slot(path)]
        for path in shapes
    }
    missing = [str(s) for path in shapes for s in slots[path] if s not in filled]
    if missing:
        raise WeightShapeError(
            f"checkpoint lacks {len(missing)} parameter(s): {', '.join(missing[:12])}"
            + (" ..." if len(missing) > 12 else "")
        )
    place = place or (lambda path, value: value)
    tree: dict = {}
    for path in shapes:
        values = [_read(filled[s], source_shape(cfg, s, shapes)) for s in slots[path]]
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = place(path, values[0] if len(values) == 1 else np.concatenate(values, axis=-1))
    return tree


def _read(tensor: SourceTensor, expected: tuple[int, ...]) -> np.ndarray:
    """One source tensor in our layout ([in, out] for linear weights) and its storage dtype."""
    value = np.asarray(tensor.load())
    value = value.astype(dtypes.storage(value), copy=False)
    if value.shape != expected:
        raise WeightShapeError(f"tensor {tensor.name!r} holds {value.shape} values, expected {expected}")
    if tensor.transform is not None:
        value = np.asarray(tensor.transform(value.astype(np.float32)), np.float32)
    if value.ndim == 2 and tensor.slot.path[-1] not in NOT_TRANSPOSED:
        value = value.T
    return np.ascontiguousarray(value)


def placer(cfg: ModelConfig, dtype=None, mesh=None) -> Callable[[tuple[str, ...], np.ndarray], Any]:
    """place(path, value) for assemble_params: value cast to `dtype` ("float32" / "bfloat16"; None: kept), then,
    given a (data, seq, tensor) mesh, a jax array laid out by sharding.param_shardings, each device taking only
    its own slice (jax.make_array_from_callback: in a multi-host run each process keeps its devices' shards)."""
    dtype = None if dtype is None else dtypes.resolve(dtype)
    shardings = None
    if mesh is not None:
        sharding.check_mesh(cfg, mesh)  # MeshError before any read
        shardings = sharding.param_shardings(param_shapes(cfg), mesh)

    def place(path, value):
        value = value if dtype is None else value.astype(dtype, copy=False)
        if shardings is None:
            return value
        target = functools.reduce(dict.__getitem__, path, shardings)
        return jax.make_array_from_callback(value.shape, target, lambda index: value[index])

    return place
