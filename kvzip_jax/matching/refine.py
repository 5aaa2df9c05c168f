"""Gradient refinement of a closed-form compacted head with optax (issue 16 item 3): how far the closed form is from a
local optimum of the matching objective, and what the extra steps cost.

    c_k, beta, c_v, losses = refine_head(q, k, v, c_k, beta, c_v, scale, steps=300)

The objective is the one the closed form fits in two stages, on the same reference queries: the relative squared
error of the attention output plus the squared error of the log attention mass (lse), both over the valid queries;
Adam (optax) moves beta (unless train_bias=False) and C_v (and C_k with train_keys) from the closed-form start.
losses [steps + 1] is the objective before each step and after the last, so losses[0] is the closed form's own.
MatchingConfig.refine_steps runs it on every compacted head.

Einsum legend: N reference queries, T block keys, S kept keys, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from kvzip_jax.matching.fit import HIGHEST, logits
from kvzip_jax.models.attention import MASK_VALUE


def matching_loss(
    q,
    k,
    v,
    c_k,
    beta,
    c_v,
    scale: float,
    key_valid=None,
    query_valid=None,
    active=None,
    mass_weight: float = 1.0,
    key_bias=None,
) -> jax.Array:
    """[] relative output error + mass_weight x mean squared lse error of the compacted head (c_k, beta, c_v [S])
    against the block (k, v [T], with its own bias key_bias [T] if any) for queries q [N] (query_valid [N]: others
    weigh nothing; active [S]: kept keys)."""
    z = logits(q, k, scale, key_valid, key_bias=key_bias)  # [N, T]
    lse = jax.nn.logsumexp(z, axis=1)  # [N]
    out = jnp.einsum("NT,TH->NH", jnp.exp(z - lse[:, None]), v.astype(jnp.float32), precision=HIGHEST)
    zc = jnp.einsum("NH,SH->NS", q.astype(jnp.float32), c_k, precision=HIGHEST) * scale + beta[None, :]
    if active is not None:
        zc = jnp.where(active[None, :], zc, MASK_VALUE)
    lse_c = jax.nn.logsumexp(zc, axis=1)
    out_c = jnp.einsum("NS,SH->NH", jnp.exp(zc - lse_c[:, None]), c_v, precision=HIGHEST)
    weight = jnp.ones(q.shape[0], jnp.float32) if query_valid is None else query_valid.astype(jnp.float32)
    weight = weight * (lse > MASK_VALUE / 2)  # a query that sees no key weighs nothing
    rows = jnp.maximum(weight.sum(), 1.0)
    output_error = jnp.sum(weight * jnp.sum((out_c - out) ** 2, -1)) / jnp.maximum(
        jnp.sum(weight * jnp.sum(out**2, -1)), 1e-30
    )
    mass_error = jnp.sum(weight * (lse_c - jnp.where(weight > 0, lse, 0.0)) ** 2) / rows
    return output_error + mass_weight * mass_error


def refine_head(
    q,
    k,
    v,
    c_k,
    beta,
    c_v,
    scale: float,
    key_valid=None,
    *,
    query_valid=None,
    active=None,
    steps: int = 300,
    learning_rate: float = 1e-2,
    train_keys: bool = False,
    train_bias: bool = True,
    key_bias=None,
):
    """(c_k, beta, c_v, losses [steps + 1]) after `steps` Adam steps on matching_loss from the given start. Inactive
    kept slots (active False) stay as they were. key_bias [T]: the block's own bias, as in matching_loss."""
    trainable = {"c_v": c_v} | ({"beta": beta} if train_bias else {}) | ({"c_k": c_k} if train_keys else {})
    loss_of = lambda p: matching_loss(
        q,
        k,
        v,
        p.get("c_k", c_k),
        p.get("beta", beta),
        p["c_v"],
        scale,
        key_valid,
        query_valid,
        active,
        key_bias=key_bias,
    )
    optimizer = optax.adam(learning_rate)

    def step(state, _):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = jax.lax.scan(step, (trainable, optimizer.init(trainable)), None, length=steps)
    losses = jnp.concatenate([losses, loss_of(params)[None]])
    if active is not None:  # dropped slots keep their (ignored) start values
        params = {
            name: jnp.where(active.reshape(active.shape + (1,) * (x.ndim - 1)), x, trainable[name])
            for name, x in params.items()
        }
    return params.get("c_k", c_k), params.get("beta", beta), params["c_v"], losses
