"""Budgets in exact integers: how many pairs a ratio keeps, and which ones (the highest scores).

Every method (KVzip's eviction levels, the baselines' layer budgets, head-level mode) counts its kept pairs with
`kept_count`: floor(ratio x candidates), computed in int32 arithmetic, exact for any number of candidates below
2^31 (float32 cannot count past 2^24, and a float product nudged up to survive rounding overshoots by one once the
count passes ~1e5). The ratio enters once, as a whole number of millionths: round(ratio x 10^6). So a ratio
written with six decimals or fewer (0.3, 0.125, 0.333333) is taken exactly, whether it comes as a Python float or
as a float32 array under jit (float32 carries a ratio in (0, 1] to within 0.1 millionth); a finer ratio is rounded
to the nearest millionth first (1/3 keeps floor(333,333 n / 10^6) of n).

Einsum legend: R rows of independent budgets, M candidates per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.errors import KvzipError
from kvzip_jax.sharding.mesh import current_mesh, spec_for
from kvzip_jax.sharding.select import SCORES, top_counts_sharded

RATIO_UNITS = 1_000_000  # a ratio is counted in millionths
MAX_CANDIDATES = 2**31 - 1  # int32 counts


class RatioError(KvzipError, ValueError):
    """A compression ratio outside (0, 1]."""


def check_ratio(ratio) -> None:
    """Raises RatioError for a concrete ratio outside (0, 1]; traced ratios are left to the caller."""
    if isinstance(ratio, jax.core.Tracer):
        return
    if not 0 < float(ratio) <= 1:
        raise RatioError(f"ratio is the fraction of context pairs kept and must lie in (0, 1], got {ratio}")


def ratio_units(ratio) -> jax.Array:
    """[] int32: the ratio in millionths, round(ratio x 10^6)."""
    return jnp.round(jnp.asarray(ratio, jnp.float32) * RATIO_UNITS).astype(jnp.int32)


def kept_count(ratio, candidates) -> jax.Array:
    """floor(ratio x candidates) as int32 [...] for candidates int [...] in [0, 2^31), in exact integer arithmetic.

    With u = ratio_units(ratio) <= 10^6 and candidates n = w 10^6 + r: u n / 10^6 = u w + u r / 10^6, and u r is
    split into thousands (u = u1 10^3 + u0, r = r1 10^3 + r0) so that no partial product reaches 2^31.
    """
    u = ratio_units(ratio)
    n = jnp.asarray(candidates, jnp.int32)
    whole, rest = n // RATIO_UNITS, n % RATIO_UNITS
    u1, u0 = u // 1000, u % 1000
    r1, r0 = rest // 1000, rest % 1000
    low = (u1 * r0 + u0 * r1) * 1000 + u0 * r0  # < 2^31: u1 <= 999 whenever u0 > 0
    return u * whole + u1 * r1 + low // RATIO_UNITS


def check_candidates(count: int) -> None:
    """Raises ValueError when a (static) number of candidates cannot be counted in int32."""
    if count > MAX_CANDIDATES:
        raise ValueError(f"{count} candidate pairs exceed the {MAX_CANDIDATES} an int32 budget can count")


def top_counts(scores: jax.Array, counts: jax.Array) -> jax.Array:
    """keep [..., M] bool: the counts [...] highest of scores [..., M], ties broken by lower index (so budgets are
    exact and deterministic); a count above M keeps all M."""
    M = scores.shape[-1]
    check_candidates(M)
    flat = scores.reshape(-1, M)  # [R, M]
    order = jnp.argsort(-flat, axis=-1, stable=True)  # [R, M] entries by rank
    rows = jnp.arange(flat.shape[0])[:, None]
    places = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), flat.shape)
    ranks = jnp.zeros_like(places).at[rows, order].set(places, unique_indices=True)  # the inverse permutation
    return ranks.reshape(scores.shape) < counts[..., None]


def select_top(scores: jax.Array, counts: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """keep (bool, shaped as scores [L, B, K, n]): per row the counts highest along `axes` (counts: scores' shape
    with size 1 on `axes`), ties broken by the lower row-major index over `axes`.

    Under a mesh (jax.set_mesh) this is the exact distributed selection (sharding.select: no gather of the scores,
    the scores laid out (-, data, tensor, seq)); otherwise a stable sort (top_counts). Both keep the same pairs.
    """
    mesh = current_mesh()
    if mesh is not None:
        return top_counts_sharded(scores, counts, axes, mesh, spec_for(mesh, SCORES, scores.shape))
    order = tuple(d for d in range(scores.ndim) if d not in axes) + tuple(axes)  # rows first, competing last
    moved = scores.transpose(order)
    row_shape = moved.shape[: scores.ndim - len(axes)]
    row_counts = jnp.broadcast_to(counts, [1 if d in axes else n for d, n in enumerate(scores.shape)])
    keep = top_counts(moved.reshape(row_shape + (-1,)), row_counts.transpose(order).reshape(row_shape))
    return keep.reshape(moved.shape).transpose(tuple(np.argsort(order)))
