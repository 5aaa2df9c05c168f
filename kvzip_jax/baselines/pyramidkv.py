"""PyramidKV: SnapKV's scores with linearly decreasing layer budgets.

PyramidKV's rule with beta = 20: layer budgets fall linearly from avg (2 - 1/beta) at the first layer to avg / beta
at the last, avg = ratio x K x context_len (the uniform budget). Budgets are capped at a layer's K x context_len;
what capped layers cannot take is spread evenly over the others (water filling), and the integer budgets sum to
exactly floor(ratio x L x K x context_len), the total of uniform budgets at that ratio.

Einsum legend: B batch, K KV heads, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.kvzip.budget import kept_count

BETA = 20.0


def pyramid_budgets(ratio, context_len: jax.Array, num_layers: int, num_kv_heads: int,
                    beta: float = BETA) -> jax.Array:
    """counts [L, B] int32 per layer and row: non-increasing over layers, each <= K x context_len, summing to
    floor(ratio x L x K x context_len). ratio may be traced."""
    if beta < 1:
        raise ValueError(f"beta must be >= 1 (budgets decrease over layers), got {beta}")
    ratio = jnp.asarray(ratio, jnp.float32)
    row = lambda n: _row_budgets(ratio, n, num_layers, num_kv_heads, beta)
    return jax.vmap(row, out_axes=1)(context_len.astype(jnp.int32))


def _row_budgets(ratio: jax.Array, n: jax.Array, L: int, K: int, beta: float) -> jax.Array:
    """[L] int32 budgets of one row with n context tokens."""
    cap = K * n  # pairs of one layer
    total = jnp.minimum(kept_count(ratio, L * K * n), L * cap)  # keep_mask "pair"'s total
    avg = ratio * cap.astype(jnp.float32)
    top, bottom = avg * (2 - 1 / beta), avg / beta
    ideal = top - jnp.arange(L, dtype=jnp.float32) * ((top - bottom) / max(L - 1, 1))  # [L] non-increasing

    def shift(capped):  # the common increment that brings the uncapped layers to the total
        free = ~capped
        rest = total - capped.sum() * cap - jnp.where(free, ideal, 0.0).sum()
        return rest / jnp.maximum(free.sum(), 1)

    # Each pass caps the layers pushed over their cap; the shift only grows, so L passes reach the fixed point.
    capped = jax.lax.fori_loop(0, L, lambda _, c: c | (ideal + shift(c) >= cap), jnp.zeros(L, bool))
    real = jnp.where(capped, cap, jnp.clip(ideal + shift(capped), 0, cap))  # [L] non-increasing
    counts = jnp.floor(real).astype(jnp.int32)  # [L]

    def step(counts):  # one pair towards the total, on the layer furthest from its real budget that stays ordered
        above = jnp.concatenate([cap[None], counts[:-1]])  # [L] the previous layer's count (the cap for the first)
        below = jnp.concatenate([counts[1:], jnp.zeros(1, jnp.int32)])  # [L] the next layer's count
        gap = real - counts  # [L]
        grow = jnp.argmax(jnp.where(counts < above, gap, -jnp.inf))
        shrink = jnp.argmax(jnp.where(counts > below, -gap, -jnp.inf))
        return jnp.where(counts.sum() < total, counts.at[grow].add(1), counts.at[shrink].add(-1))

    return jax.lax.while_loop(lambda counts: counts.sum() != total, step, counts)
