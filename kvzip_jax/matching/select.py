"""Key selection for Attention Matching: which t of a head's T keys the compacted block keeps (reference §2).

Einsum legend: N reference queries, T block keys, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.matching.fit import HIGHEST, RIDGE, gram, logits, mass_features

AGGREGATIONS = ("rms", "max", "mean")
OMP_UPPER = float(np.exp(np.float32(7.0)))  # the reference code's box for OMP weights: beta <= 7


def attention_key_scores(
    q: jax.Array,
    k: jax.Array,
    scale: float,
    aggregate: str = "rms",
    key_valid: jax.Array | None = None,
    query_valid: jax.Array | None = None,
    key_bias: jax.Array | None = None,
) -> jax.Array:
    """[T] float32: each key's attention over the reference queries q [N, H] (row softmax over keys k [T, H], with
    their bias key_bias [T] if any), aggregated over the valid queries (query_valid [N], default all) by root mean
    square (the paper's choice), max or mean; invalid keys score -inf."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {aggregate!r}")
    weights = jax.nn.softmax(logits(q, k, scale, key_valid, key_bias=key_bias), axis=1)  # [N, T]
    rows = jnp.ones((q.shape[0],), bool) if query_valid is None else query_valid
    weights = jnp.where(rows[:, None], weights, 0.0)
    count = jnp.maximum(rows.sum(), 1)
    if aggregate == "rms":
        score = jnp.sqrt(jnp.sum(weights * weights, axis=0) / count)
    elif aggregate == "max":
        score = weights.max(axis=0)
    else:
        score = jnp.sum(weights, axis=0) / count
    return score if key_valid is None else jnp.where(key_valid, score, -jnp.inf)


def highest_attention_keys(
    q: jax.Array, k: jax.Array, scale: float, count: int, aggregate: str = "rms", key_valid: jax.Array | None = None
) -> jax.Array:
    """[count] int32 indices of the keys with the highest aggregated attention (HAK), in position order; count is
    static and at most T."""
    if not 0 <= count <= k.shape[0]:
        raise ValueError(f"count must be in [0, {k.shape[0]}], got {count}")
    _, chosen = jax.lax.top_k(attention_key_scores(q, k, scale, aggregate, key_valid), count)
    return jnp.sort(chosen).astype(jnp.int32)


def orthogonal_matching_pursuit(
    q: jax.Array,
    k: jax.Array,
    scale: float,
    count: int,
    key_valid: jax.Array | None = None,
    *,
    query_valid: jax.Array | None = None,
    limit: jax.Array | None = None,
    per_step: int = 1,
    refit_every: int = 1,
    key_bias: jax.Array | None = None,
) -> jax.Array:
    """[count] int32 key indices in the order Orthogonal Matching Pursuit chose them (the paper's Algorithm 1): each
    step adds the key(s) whose mass features correlate most with the residual mass, then refits the weights of all
    chosen keys by least squares clamped to [1e-12, e^7]. count is static, at most the number of valid keys.

    limit [] int (traced; default count): stop after that many keys, the entries past it are 0 (a head's budget
    below the static count; the greedy order does not depend on where it stops). per_step k and refit_every tau:
    the fast variant (AM-OMP-fast: k = 4, tau = 2) adds k keys per step and refits every tau steps; between refits
    new keys get the lower bound 1e-12. Cost: count / k steps of an [N, T] correlation, a [count, count] solve every
    tau steps. key_bias [T]: the keys' own bias (a block compacted before), part of their mass features.
    """
    if not 0 <= count <= k.shape[0]:
        raise ValueError(f"count must be in [0, {k.shape[0]}], got {count}")
    if per_step < 1 or refit_every < 1:
        raise ValueError(f"per_step and refit_every must be >= 1, got {per_step}, {refit_every}")
    if count == 0:
        return jnp.zeros((0,), jnp.int32)
    phi, mass, _ = mass_features(logits(q, k, scale, key_valid, query_valid, key_bias))  # [N, T], [N]
    T = k.shape[0]
    allowed = jnp.ones((T,), bool) if key_valid is None else key_valid
    limit = jnp.asarray(count if limit is None else limit, jnp.int32)
    ridge = RIDGE * jnp.maximum(jnp.max(jnp.sum(phi * phi, axis=0)), 1e-30)  # a fixed scale for every refit

    def refit(columns, active, used):  # clamped least squares of the chosen columns' weights (the first `used`)
        normal = gram(columns, used) + jnp.diag(jnp.where(active, ridge, 1.0))  # [count, count]
        w = jax.scipy.linalg.cho_solve(
            (jnp.linalg.cholesky(normal), True), jnp.einsum("NS,N->S", columns, mass, precision=HIGHEST)
        )
        return jnp.clip(w, 1e-12, OMP_UPPER)

    def step(state):
        s, chosen, taken, w, current = state  # [] step, [count] int32, [T] bool, [count], [N]
        correlation = jnp.einsum("NT,N->T", phi, mass - current, precision=HIGHEST)  # [T]
        _, picks = jax.lax.top_k(jnp.where(taken | ~allowed, -jnp.inf, correlation), per_step)  # [k]
        places = s * per_step + jnp.arange(per_step)  # [k]
        places = jnp.where(places < limit, places, count)  # past the budget: dropped
        chosen = chosen.at[places].set(picks.astype(jnp.int32), mode="drop")
        taken = taken.at[jnp.where(places < count, picks, T)].set(True, mode="drop")
        used = jnp.minimum((s + 1) * per_step, limit)
        active = jnp.arange(count) < used  # [count]
        columns = jnp.where(active[None, :], phi[:, chosen], 0.0)  # [N, count]; inactive columns are zero
        w = jnp.where(active, jnp.where(w > 0, w, 1e-12), 0.0)  # new keys start at the lower bound
        last = (s + 1) * per_step >= limit
        refitting = ((s + 1) % refit_every == 0) | last
        w = jax.lax.cond(refitting, lambda: jnp.where(active, refit(columns, active, used), 0.0), lambda: w)
        return s + 1, chosen, taken, w, jnp.einsum("NS,S->N", columns, w, precision=HIGHEST)

    init = (
        jnp.int32(0),
        jnp.zeros((count,), jnp.int32),
        jnp.zeros((T,), bool),
        jnp.zeros((count,), jnp.float32),
        jnp.zeros_like(mass),
    )
    _, chosen, _, _, _ = jax.lax.while_loop(lambda state: state[0] * per_step < limit, step, init)
    return chosen
