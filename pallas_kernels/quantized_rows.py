"""Group-quantized key or value rows as the decode kernels read them, and their dequantization inside a kernel.

A row of H elements is stored as codes (uint8: one per element for int8; two per byte for int4, element 2i in the
low nibble and 2i + 1 in the high one) with a scale and a zero point per group of g consecutive elements (N = H / g
groups): element = zero + code x scale (kvzip_jax.quant writes this format; this package reads it without importing
it). The bits follow from the shapes: codes [..., H] are int8, [..., H / 2] int4.

Inside a kernel a block of rows is dequantized part by part, each part a static column range of one group: int8 has
one part per group; int4 two, the group's even elements (low nibbles) then its odd ones (high nibbles), read from the
same bytes without any interleaving. So the kernel works in that column order: the queries are permuted into it
before the kernel and the outputs permuted back after it (column_order).

Einsum legend: S rows (store slots), H head dim, N groups per row, g elements per group.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .dispatch import KernelInputError


class QuantizedRows(NamedTuple):
    """codes [..., S, H or H / 2] uint8; scale, zero [..., S, N] float (bfloat16, float16 or float32)."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array


class Part(NamedTuple):
    """One static column range of a dequantized row in the kernel's column order."""

    column: int  # first column in the kernel's order
    width: int  # columns
    byte: int  # first byte (code column) it is read from
    nibble: int | None  # None: int8 codes; 0: low nibbles; 1: high nibbles
    group: int  # the group whose scale and zero apply


def bits_of(rows: QuantizedRows, head_dim: int) -> int:
    """8 or 4, from the codes' width; KernelInputError if it is neither or the groups do not split the row."""
    width, groups = rows.codes.shape[-1], rows.scale.shape[-1]
    if width not in (head_dim, head_dim // 2) or head_dim % 2:
        raise KernelInputError(
            f"codes of width {width} are neither int8 ({head_dim}) nor packed int4 "
            f"({head_dim // 2}) rows of head dim {head_dim}"
        )
    if rows.zero.shape != rows.scale.shape or rows.scale.shape[:-1] != rows.codes.shape[:-1]:
        raise KernelInputError(
            f"scale {rows.scale.shape} and zero {rows.zero.shape} must be [..., S, N] beside codes {rows.codes.shape}"
        )
    if groups < 1 or head_dim % groups or (head_dim // groups) % 2:
        raise KernelInputError(f"{groups} groups do not split a row of {head_dim} into even groups")
    return 8 if width == head_dim else 4


def parts(head_dim: int, groups: int, bits: int) -> tuple[Part, ...]:
    """The static parts of a row in the kernel's column order."""
    g = head_dim // groups
    if bits == 8:
        return tuple(Part(n * g, g, n * g, None, n) for n in range(groups))
    return tuple(Part(n * g + half * g // 2, g // 2, n * g // 2, half, n) for n in range(groups) for half in (0, 1))


def column_order(head_dim: int, groups: int, bits: int) -> np.ndarray:
    """[H] the element each kernel column holds: identity for int8; per group its even elements, then its odd ones,
    for int4."""
    if bits == 8:
        return np.arange(head_dim)
    g = head_dim // groups
    return np.concatenate([n * g + np.arange(half, g, 2) for n in range(groups) for half in (0, 1)])


def load_part(rows_refs, start, size: int, part: Part) -> jax.Array:
    """Inside a kernel: the dequantized float32 block [size, width] of `part` for rows [start, start + size) of a
    store whose refs are (codes [S, .], scale [S, N], zero [S, N])."""
    codes_ref, scale_ref, zero_ref = rows_refs
    codes = codes_ref[pl.ds(start, size), pl.ds(part.byte, part.width)]  # [size, width] uint8
    if part.nibble == 0:
        codes = codes & 0xF
    elif part.nibble == 1:
        codes = codes >> 4
    scale = scale_ref[pl.ds(start, size), pl.ds(part.group, 1)].astype(jnp.float32)  # [size, 1]
    zero = zero_ref[pl.ds(start, size), pl.ds(part.group, 1)].astype(jnp.float32)
    return zero + codes.astype(jnp.float32) * scale


def dequantize_rows(rows: QuantizedRows, head_dim: int) -> jax.Array:
    """The jnp oracle: [..., S, H] float32 rows."""
    codes = rows.codes
    if bits_of(rows, head_dim) == 4:
        codes = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[:-1] + (head_dim,))
    g = head_dim // rows.scale.shape[-1]
    per_element = lambda a: jnp.repeat(a.astype(jnp.float32), g, axis=-1)  # [..., S, H]
    return per_element(rows.zero) + codes.astype(jnp.float32) * per_element(rows.scale)
