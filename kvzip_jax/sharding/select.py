"""Exact top-k across shards: the same pairs a single-device stable sort keeps, with no gather of the scores.

The k highest of scores along some axes, ties broken by the lower flat index over those axes (row-major), is the
set {key > t} plus the `need` tied keys {key == t} of lowest index. Both cut points are found by bisection on bits,
each step one count summed over the shards (a scalar psum per row), so the scores never leave their devices:
  1. float32 -> uint32 keys in the same order; the largest t with count(key >= t) >= k, bit by bit (32 steps);
  2. need = k - count(key > t); the largest index bound j with count(key == t, index < j) <= need (31 steps).
On one device, kvzip_jax.kvzip.budget.top_counts (a stable argsort) is the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

SIGN = np.uint32(0x80000000)
SCORES = (None, "data", "tensor", "seq")  # the layout of scores [L, B, K, n]


def ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of float32 x (NaN aside; -0.0 counts as 0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32) + 0.0, jnp.uint32)
    return jnp.where(bits >= SIGN, ~bits, bits | SIGN)  # negatives reversed below positives


def top_counts_sharded(scores: jax.Array, counts: jax.Array, axes: tuple[int, ...], mesh, spec: PartitionSpec):
    """keep (bool, shaped as scores): per row, the counts highest of scores along `axes`, ties to the lower
    row-major index over `axes`. counts: int, scores' shape with size 1 on `axes`. spec: the scores' layout on
    `mesh` (every named axis must divide its dimension); counts take it with `axes` dropped."""
    spec = tuple(spec) + (None,) * (scores.ndim - len(tuple(spec)))
    count_spec = PartitionSpec(*(None if d in axes else s for d, s in enumerate(spec)))
    summed = tuple(spec[d] for d in axes if spec[d] is not None)  # mesh axes splitting a competing dimension
    strides, stride = {}, 1
    for d in reversed(axes):
        strides[d] = stride
        stride *= scores.shape[d]
    if stride >= 2**31:
        raise ValueError(f"{stride} candidates exceed the int32 index of the distributed selection")

    def local(x, c):  # x [...local], c [...local with 1 on axes]
        keys = ordered_keys(x)

        def total(mask):  # [...rows, 1 on axes] count over the competing axes of every shard
            count = mask.sum(axis=axes, keepdims=True, dtype=jnp.int32)
            return jax.lax.psum(count, summed) if summed else count

        index = jnp.zeros(x.shape, jnp.int32)  # global row-major index over `axes`
        for d in axes:
            start = jax.lax.axis_index(spec[d]) * x.shape[d] if spec[d] is not None else 0
            coord = jax.lax.broadcasted_iota(jnp.int32, x.shape, d) + start
            index = index + coord * strides[d]

        def threshold_bit(i, t):  # the largest t with count(keys >= t) >= c
            candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
            return jnp.where(total(keys >= candidate) >= c, candidate, t)

        t = jax.lax.fori_loop(0, 32, threshold_bit, jnp.zeros(c.shape, jnp.uint32))
        need = c - total(keys > t)
        ties = keys == t

        def index_bit(i, j):  # the largest j with count(ties & index < j) <= need
            candidate = j | (jnp.int32(1) << (30 - i))
            return jnp.where(total(ties & (index < candidate)) <= need, candidate, j)

        j = jax.lax.fori_loop(0, 31, index_bit, jnp.zeros(c.shape, jnp.int32))
        return (keys > t) | (ties & (index < j))

    return jax.shard_map(
        local, mesh=mesh, in_specs=(PartitionSpec(*spec), count_spec), out_specs=PartitionSpec(*spec), check_vma=False
    )(scores, counts.astype(jnp.int32))
