"""Key selection for Attention Matching: which t of a head's T keys the compacted block keeps (reference §2).

Einsum legend: N reference queries, T block keys, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.matching.fit import HIGHEST, RIDGE, logits, mass_features

AGGREGATIONS = ("rms", "max", "mean")
OMP_UPPER = float(jnp.exp(7.0))  # the reference code's box for OMP weights: beta <= 7


def attention_key_scores(q: jax.Array, k: jax.Array, scale: float, aggregate: str = "rms",
                         key_valid: jax.Array | None = None) -> jax.Array:
    """[T] float32: each key's attention over the reference queries q [N, H] (row softmax over keys k [T, H]),
    aggregated over queries by root mean square (the paper's choice), max or mean; invalid keys score -inf."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {aggregate!r}")
    weights = jax.nn.softmax(logits(q, k, scale, key_valid), axis=1)  # [N, T]
    if aggregate == "rms":
        score = jnp.sqrt(jnp.mean(weights * weights, axis=0))
    elif aggregate == "max":
        score = weights.max(axis=0)
    else:
        score = weights.mean(axis=0)
    return score if key_valid is None else jnp.where(key_valid, score, -jnp.inf)


def highest_attention_keys(q: jax.Array, k: jax.Array, scale: float, count: int, aggregate: str = "rms",
                           key_valid: jax.Array | None = None) -> jax.Array:
    """[count] int32 indices of the keys with the highest aggregated attention (HAK), in position order; count is
    static and at most T."""
    if not 0 <= count <= k.shape[0]:
        raise ValueError(f"count must be in [0, {k.shape[0]}], got {count}")
    _, chosen = jax.lax.top_k(attention_key_scores(q, k, scale, aggregate, key_valid), count)
    return jnp.sort(chosen).astype(jnp.int32)


def orthogonal_matching_pursuit(q: jax.Array, k: jax.Array, scale: float, count: int,
                                key_valid: jax.Array | None = None) -> jax.Array:
    """[count] int32 key indices chosen greedily to match the attention mass (the paper's Algorithm 1, exact OMP):
    each step adds the key whose mass features correlate most with the residual mass, then refits the weights of
    all chosen keys by least squares clamped to [1e-12, e^7]. count is static, at most the number of valid keys.

    Cost: count steps of an [N, T] correlation and a [count, count] solve (the fast variants that add several keys
    per step and refit every few steps are not implemented).
    """
    if not 0 <= count <= k.shape[0]:
        raise ValueError(f"count must be in [0, {k.shape[0]}], got {count}")
    if count == 0:
        return jnp.zeros((0,), jnp.int32)
    phi, mass, _ = mass_features(logits(q, k, scale, key_valid))  # [N, T], [N]
    T = k.shape[0]
    allowed = jnp.ones((T,), bool) if key_valid is None else key_valid

    def step(i, state):
        chosen, taken, current = state  # [count] int32, [T] bool, [N]
        correlation = jnp.einsum("NT,N->T", phi, mass - current, precision=HIGHEST)  # [T]
        pick = jnp.argmax(jnp.where(taken | ~allowed, -jnp.inf, correlation)).astype(jnp.int32)
        chosen, taken = chosen.at[i].set(pick), taken.at[pick].set(True)
        active = jnp.arange(count) <= i  # [count]
        columns = jnp.where(active[None, :], phi[:, chosen], 0.0)  # [N, count]; inactive columns are zero
        gram = jnp.einsum("NS,NU->SU", columns, columns, precision=HIGHEST)
        gram = gram + jnp.diag(jnp.where(active, RIDGE * jnp.maximum(jnp.trace(gram), 1e-30), 1.0))
        w = jnp.linalg.solve(gram, jnp.einsum("NS,N->S", columns, mass, precision=HIGHEST))  # [count]
        w = jnp.where(active, jnp.clip(w, 1e-12, OMP_UPPER), 0.0)
        return chosen, taken, jnp.einsum("NS,S->N", columns, w, precision=HIGHEST)

    init = (jnp.zeros((count,), jnp.int32), jnp.zeros((T,), bool), jnp.zeros_like(mass))
    chosen, _, _ = jax.lax.fori_loop(0, count, step, init)
    return jnp.sort(chosen)
