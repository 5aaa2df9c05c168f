"""Builds the parameter tree of params.py from source tensors, shared by the GGUF and safetensors converters.

A converter names, for each source tensor, the Slot it fills: a parameter path plus, for fused parameters, the part
(`qkv` <- q, k, v; `qkv_bias` <- q, k, v; `gate_up` <- gate, up). Source tensors are in the torch / GGUF-numpy
layout: linear weights [out, in], embedding [V, D], vectors [n]. `assemble_params` checks every tensor's shape before
touching it, fills each slot exactly once, transposes linear weights to [in, out], fuses parts along the output axis
and finally checks that nothing is missing. Tensors keep the source's precision (dtypes.storage: bf16 stays bf16, so
an 8B model is never written as 32 GB of float32); a transform (un-permute, +1) runs and stores in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import numpy as np

from kvzip_jax import dtypes
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
    widths = {"q": cfg.num_heads * cfg.head_dim, "k": cfg.num_kv_heads * cfg.head_dim,
              "v": cfg.num_kv_heads * cfg.head_dim, "gate": cfg.intermediate_size, "up": cfg.intermediate_size}
    return widths[part]


def source_shape(cfg: ModelConfig, slot: Slot, shapes: dict) -> tuple[int, ...]:
    """Expected shape of the source tensor for `slot`, in the source layout ([out, in] for linear weights)."""
    shape = shapes[slot.path]
    if slot.part is not None:
        shape = shape[:-1] + (_part_width(cfg, slot.part),)
    return shape[::-1] if len(shape) == 2 and slot.path[-1] not in NOT_TRANSPOSED else shape


def assemble_params(cfg: ModelConfig, tensors: Iterable[SourceTensor]) -> dict:
    """Nested numpy parameter tree of `param_shapes(cfg)` from source tensors, in their storage dtypes.

    Raises WeightShapeError naming the tensor on a wrong shape, an unknown or duplicate slot, and listing every
    missing parameter or part at the end.
    """
    shapes = flat_param_shapes(cfg)
    filled: dict[Slot, tuple[str, np.ndarray]] = {}
    for tensor in tensors:
        slot = tensor.slot
        if slot.path not in shapes or (slot.part is not None) != (slot.path[-1] in FUSED_PARTS) or (
                slot.part is not None and slot.part not in FUSED_PARTS[slot.path[-1]]):
            raise WeightShapeError(f"tensor {tensor.name!r} maps to {slot}, which this model config does not have")
        if slot in filled:
            raise WeightShapeError(f"tensors {filled[slot][0]!r} and {tensor.name!r} both fill {slot}")
        expected = source_shape(cfg, slot, shapes)
        if tuple(tensor.shape) != expected:
            raise WeightShapeError(f"tensor {tensor.name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                                   f"for {slot}")
        value = np.asarray(tensor.load())
        value = value.astype(dtypes.storage(value), copy=False)
        if value.shape != expected:
            raise WeightShapeError(f"tensor {tensor.name!r} holds {value.shape} values, expected {expected}")
        if tensor.transform is not None:
            value = np.asarray(tensor.transform(value.astype(np.float32)), np.float32)
        if value.ndim == 2 and slot.path[-1] not in NOT_TRANSPOSED:
            value = value.T
        filled[slot] = (tensor.name, np.ascontiguousarray(value))

    missing, flat = [], {}
    for path in shapes:
        parts = FUSED_PARTS.get(path[-1])
        slots = [Slot(path, part) for part in parts] if parts else [Slot(path)]
        absent = [str(s) for s in slots if s not in filled]
        if absent:
            missing += absent
            continue
        values = [filled.pop(s)[1] for s in slots]
        flat[path] = values[0] if len(values) == 1 else np.concatenate(values, axis=-1)
    if missing:
        raise WeightShapeError(f"checkpoint lacks {len(missing)} parameter(s): {', '.join(missing[:12])}"
                               + (" ..." if len(missing) > 12 else ""))
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
