"""PyramidKV: SnapKV's scores with linearly decreasing layer budgets, as KVCache-Factory's PyramidKVCluster sets them.

Per head, a uniform budget C = ratio x context pays for the observation window w (kept in every layer) and C - w
pairs chosen by score. PyramidKV spreads the chosen part over the layers along a line, with beta = 20 (both from
KVCache-Factory pyramidkv/pyramidkv_utils.py, PyramidKVCluster.update_kv):
  min = (C - w) / beta,  max = 2 (C - w) - min          (the line's mean stays C - w)
  if max > n - w: max = n - w, min = 2 (C - w) - max   (no layer chooses more than its n - w non-window pairs)
  layer l chooses max - l (max - min) / (L - 1) pairs per head, plus its window;
and when the context is shorter than 2 (C - w) the pyramid is not used: every layer gets the uniform budget, as
there. The per-layer pair counts (K heads each) are integers summing exactly to L x floor(ratio x K x n), the total
of uniform layer budgets at that ratio; budgets.keep_by_layer then shares each layer's count among its heads.

Einsum legend: B batch, K KV heads, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.baselines.snapkv import window_sizes
from kvzip_jax.kvzip.budget import kept_count

BETA = 20.0  # KVCache-Factory PyramidKVCluster's default beta


def pyramid_budgets(
    ratio,
    context_len: jax.Array,
    num_layers: int,
    num_kv_heads: int,
    window: jax.Array | None = None,
    beta: float = BETA,
) -> jax.Array:
    """counts [L, B] int32 per layer and row (module docstring): non-increasing over layers, each <= K x
    context_len, summing to L x floor(ratio x K x context_len). window [B]: the observation window (default
    snapkv.window_sizes). ratio may be traced."""
    if beta < 1:
        raise ValueError(f"beta must be >= 1 (budgets decrease over layers), got {beta}")
    n = context_len.astype(jnp.int32)
    window = window_sizes(n) if window is None else jnp.asarray(window, jnp.int32)
    uniform = kept_count(ratio, num_kv_heads * n)  # [B] pairs per layer
    row = lambda u, n, w: _row_budgets(u, n, w, num_layers, num_kv_heads, beta)
    return jax.vmap(row, out_axes=1)(uniform, n, window)


def _row_budgets(uniform: jax.Array, n: jax.Array, window: jax.Array, L: int, K: int, beta: float) -> jax.Array:
    """[L] int32 budgets of one row: n context tokens, `uniform` pairs per layer, an observation window."""
    total = L * uniform  # exact: what uniform budgets spend
    w = jnp.minimum(window, n).astype(jnp.float32)
    chosen = uniform.astype(jnp.float32) / K - w  # C - w per head
    low = chosen / beta
    high = 2 * chosen - low
    clamped = high > n - w
    high = jnp.where(clamped, n - w, high)
    low = jnp.where(clamped, 2 * chosen - high, low)
    line = high - jnp.arange(L, dtype=jnp.float32) * ((high - low) / max(L - 1, 1))  # [L] chosen per head
    pyramid = (n.astype(jnp.float32) >= 2 * chosen) & (chosen > 0)  # else KVCache-Factory's uniform fallback
    real = jnp.where(pyramid, K * (line + w), uniform.astype(jnp.float32))  # [L] pairs per layer
    cap = K * n
    real = jnp.clip(real, 0, cap)
    counts = jnp.floor(real).astype(jnp.int32)  # [L]

    def step(counts):  # one pair towards the total, on the layer furthest from its real budget that stays ordered
        above = jnp.concatenate([cap[None], counts[:-1]])  # [L] the previous layer's count (the cap for the first)
        below = jnp.concatenate([counts[1:], jnp.zeros(1, jnp.int32)])  # [L] the next layer's count
        gap = real - counts  # [L]
        grow = jnp.argmax(jnp.where(counts < above, gap, -jnp.inf))
        shrink = jnp.argmax(jnp.where(counts > below, -gap, -jnp.inf))
        return jnp.where(counts.sum() < total, counts.at[grow].add(1), counts.at[shrink].add(-1))

    return jax.lax.while_loop(lambda counts: counts.sum() != total, step, counts)
