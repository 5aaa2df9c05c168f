"""The last step of an attention softmax, shared by the kernels' merges and their oracles.

Einsum legend: M query rows, S keys, H head dim (leading batch and head axes pass through).

A softmax kept as (m, l, o): m [..., M] a finite per-row offset (the running max), l [..., M] the sum of
exp(logits - m) over visible keys, o [..., M, H] the values weighted by those exps. Empty softmax (l = 0: no visible
key): out = 0 and lse = MASK_VALUE (finite, so merging it with another segment's (out, lse) gives that segment's
result exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .dispatch import MASK_VALUE


def exp_from_row_max(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(m [..., M], p [..., M, S]): the row max of logits [..., M, S] (-inf for hidden keys; 0 for a row with none
    visible) and p = exp(logits - m), 0 at hidden keys."""
    m = logits.max(axis=-1)  # [..., M]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # [..., M]
    return m, jnp.exp(logits - m[..., None])


def finish(m: jax.Array, l: jax.Array, o: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out [..., M, H], lse [..., M]) from (m, l, o): out = o / l and lse = m + log(l), or 0 and MASK_VALUE for an
    empty softmax."""
    nonempty = l > 0  # [..., M]
    l_safe = jnp.where(nonempty, l, 1.0)  # [..., M]
    out = jnp.where(nonempty[..., None], o / l_safe[..., None], 0.0)  # [..., M, H]
    lse = jnp.where(nonempty, m + jnp.log(l_safe), MASK_VALUE)  # [..., M]
    return out, lse
