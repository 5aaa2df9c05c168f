"""KVzap linear scorers: per layer, a Linear(D -> H) with bias predicting the log of each KV head's KVzip+ score from
the hidden state entering the attention layer (after its input RMSNorm), one token at a time.

Fitted in closed form as scikit-learn's Ridge(alpha) with an intercept: X and Y centred, the intercept not
penalised, (Xc^T Xc + alpha I) W = Xc^T Yc, b = mean(Y) - mean(X) @ W. The normal equations are accumulated and
solved in float64 with numpy on the host, since squaring X squares its condition number and float32 then loses the
small directions of correlated hidden states.

Einsum legend: L layers, N tokens, T positions, D model width, H KV heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 8192  # rows of X converted to float64 at a time while accumulating the normal equations


def fit_ridge(x, y, alpha: float = 1.0) -> dict[str, jax.Array]:
    """Ridge regression of y [N, H] on x [N, D] with an unpenalised intercept: {"w": [D, H], "b": [H]} in float32."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"fit_ridge needs x [N, D] and y [N, H] with the same N, got {x.shape} and {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("fit_ridge needs at least one row")
    if alpha < 0:
        raise ValueError(f"alpha must be non-negative, got {alpha}")
    N, D = x.shape
    x_mean = np.mean(x, axis=0, dtype=np.float64)  # [D]
    y_mean = np.mean(y, axis=0, dtype=np.float64)  # [H]
    gram = np.zeros((D, D), np.float64)  # Xc^T Xc
    cross = np.zeros((D, y.shape[1]), np.float64)  # Xc^T Yc
    for start in range(0, N, CHUNK):
        xc = x[start : start + CHUNK].astype(np.float64) - x_mean  # [n, D]
        yc = y[start : start + CHUNK].astype(np.float64) - y_mean  # [n, H]
        gram += xc.T @ xc
        cross += xc.T @ yc
    gram[np.diag_indices(D)] += alpha
    w = np.linalg.solve(gram, cross)  # [D, H]
    b = y_mean - x_mean @ w  # [H]
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def fit_linear_scorers(x, y, alpha: float = 1.0) -> dict[str, jax.Array]:
    """One ridge fit per layer: x [L, N, D], y [L, N, H] (log scores) -> {"w": [L, D, H], "b": [L, H]}."""
    if np.ndim(x) != 3 or np.ndim(y) != 3 or np.shape(x)[:2] != np.shape(y)[:2]:
        raise ValueError(f"fit_linear_scorers needs x [L, N, D] and y [L, N, H], got {np.shape(x)} and {np.shape(y)}")
    fits = [fit_ridge(x[layer], y[layer], alpha) for layer in range(np.shape(x)[0])]
    return {name: jnp.stack([fit[name] for fit in fits]) for name in ("w", "b")}


def linear_scores(params: dict, hidden: jax.Array) -> jax.Array:
    """Predicted log scores [..., H, T] of one layer (params without the layer axis) for hidden [..., T, D]."""
    h = jnp.asarray(hidden, jnp.float32)  # [..., T, D]
    return jnp.einsum("...td,dh->...ht", h, params["w"]) + params["b"][:, None]  # [..., H, T]


def linear_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error (scalar) over layers, tokens and heads: params stacked over L, x [L, N, D], y [L, N, H]."""
    pred = jax.vmap(linear_scores)(params, x)  # [L, H, N]
    return jnp.mean(jnp.square(jnp.swapaxes(pred, -1, -2) - jnp.asarray(y, jnp.float32)))
