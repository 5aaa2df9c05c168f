"""Fast KVzip gates: one low-rank sink-attention gate per layer, predicting a KV pair's KVzip score in (0, 1) from
the hidden state entering its attention layer (after the input RMSNorm), one token at a time.

For each token, query group member g of KV head h attends over its own key and S learned sink keys; the gate is the
attention weight its own key receives, averaged over the group:

  z[t, h, g] = <K[t, h], Q[t, h, g]> / sqrt(R) + b[h, g] - logsumexp_s <k_base[h, s], Q[t, h, g]> / sqrt(R)
  score[h, t] = mean_g sigmoid(z[t, h, g])

Einsum legend: L layers, N tokens, T positions, D model width, H KV heads, G query heads per KV head, R rank,
S sinks.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ACC_THRESHOLD = 0.05  # gate_accuracy: a pair counts as kept when its score is at least this


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Sizes of a model's gates. layers L, hidden D (model width), kv_heads H, group G (query heads per KV head),
    rank R (the gate's query/key width), sinks S (learned sink keys per KV head), eps (the gate's RMSNorm epsilon)."""

    layers: int
    hidden: int
    kv_heads: int
    group: int
    rank: int = 16
    sinks: int = 16
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("layers", "hidden", "kv_heads", "group", "rank", "sinks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GateConfig.{name} must be a positive integer, got {value!r}")
        if not self.eps > 0:
            raise ValueError(f"GateConfig.eps must be positive, got {self.eps!r}")


def param_shapes(cfg: GateConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of one layer's gate."""
    D, H, G, R, S = cfg.hidden, cfg.kv_heads, cfg.group, cfg.rank, cfg.sinks
    return {
        "q_w": (D, H * G * R),
        "q_b": (H * G * R,),
        "k_w": (D, H * R),
        "q_norm": (R,),
        "k_norm": (R,),
        "k_base": (H, S, R),
        "b": (H, G),
    }


def init_gates(cfg: GateConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Initial float32 gates of every layer, each leaf stacked over layers (leading axis L): q_w and k_w normal with
    std 1/sqrt(D), q_b, k_base and b zero, the RMSNorm weights one."""
    L, D = cfg.layers, cfg.hidden
    shapes = param_shapes(cfg)
    kq, kk = jax.random.split(key)
    std = 1.0 / math.sqrt(D)
    return {
        "q_w": std * jax.random.normal(kq, (L, *shapes["q_w"]), jnp.float32),  # [L, D, H*G*R]
        "q_b": jnp.zeros((L, *shapes["q_b"]), jnp.float32),  # [L, H*G*R]
        "k_w": std * jax.random.normal(kk, (L, *shapes["k_w"]), jnp.float32),  # [L, D, H*R]
        "q_norm": jnp.ones((L, *shapes["q_norm"]), jnp.float32),  # [L, R]
        "k_norm": jnp.ones((L, *shapes["k_norm"]), jnp.float32),  # [L, R]
        "k_base": jnp.zeros((L, *shapes["k_base"]), jnp.float32),  # [L, H, S, R]
        "b": jnp.zeros((L, *shapes["b"]), jnp.float32),  # [L, H, G]
    }


def _rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis."""
    return weight * x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def gate_logits(params: dict, cfg: GateConfig, hidden: jax.Array) -> jax.Array:
    """z [..., T, H, G] of one layer's gate (params without the layer axis) for hidden [..., T, D], in float32: each
    query's own-key logit minus the logsumexp of its sink logits, so that its gate is sigmoid(z)."""
    H, G, R = cfg.kv_heads, cfg.group, cfg.rank
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    h = jnp.asarray(hidden, jnp.float32)  # [..., T, D]
    q = h @ p["q_w"] + p["q_b"]  # [..., T, H*G*R]
    q = _rmsnorm(q.reshape(*q.shape[:-1], H, G, R), p["q_norm"], cfg.eps)  # [..., T, H, G, R]
    k = h @ p["k_w"]  # [..., T, H*R]
    k = _rmsnorm(k.reshape(*k.shape[:-1], H, R), p["k_norm"], cfg.eps)  # [..., T, H, R]
    scale = 1.0 / math.sqrt(R)
    own = jnp.einsum("...thr,...thgr->...thg", k, q) * scale + p["b"]  # [..., T, H, G]
    sinks = jnp.einsum("hsr,...thgr->...thgs", p["k_base"], q) * scale  # [..., T, H, G, S]
    return own - jax.nn.logsumexp(sinks, axis=-1)  # [..., T, H, G]


def gate_scores(params: dict, cfg: GateConfig, hidden: jax.Array) -> jax.Array:
    """Scores [..., H, T] in (0, 1) of one layer's gate (params without the layer axis) for hidden [..., T, D]."""
    z = gate_logits(params, cfg, hidden)  # [..., T, H, G]
    return jnp.swapaxes(jnp.mean(jax.nn.sigmoid(z), axis=-1), -1, -2)  # [..., H, T]


def _log_scores(params: dict, cfg: GateConfig, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p, log(1 - p)) [..., T, H] of one layer's gate, computed from the logits without overflow:
    log mean_g sigmoid(z_g) = logsumexp_g log_sigmoid(z_g) - log G, and likewise with -z for 1 - p."""
    z = gate_logits(params, cfg, hidden)  # [..., T, H, G]
    log_g = math.log(cfg.group)
    log_p = jax.nn.logsumexp(jax.nn.log_sigmoid(z), axis=-1) - log_g  # [..., T, H]
    log_q = jax.nn.logsumexp(jax.nn.log_sigmoid(-z), axis=-1) - log_g  # [..., T, H]
    return log_p, log_q


def _layer_loss(params: dict, cfg: GateConfig, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """One layer's loss: the sum over heads of the mean over tokens of BCE(p, y); hidden [N, D], targets [N, H]."""
    log_p, log_q = _log_scores(params, cfg, hidden)  # [N, H]
    y = jnp.asarray(targets, jnp.float32)  # [N, H]
    bce = -(y * log_p + (1.0 - y) * log_q)  # [N, H]
    return jnp.sum(jnp.mean(bce, axis=0))


def gate_loss(params: dict, cfg: GateConfig, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """Training loss (scalar): over layers, the sum of each layer's sum over heads of the mean over tokens of the
    binary cross-entropy between its gate and the KVzip scores. params stacked over L; hidden [L, N, D], targets
    [L, N, H] in [0, 1]."""
    per_layer = jax.vmap(_layer_loss, in_axes=(0, None, 0, 0))(params, cfg, hidden, targets)  # [L]
    return jnp.sum(per_layer)


def gate_accuracy(params: dict, cfg: GateConfig, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """Fraction (scalar) of (layer, token, head) whose gate and target agree on being >= ACC_THRESHOLD. params
    stacked over L; hidden [L, N, D], targets [L, N, H]."""
    scores = jax.vmap(gate_scores, in_axes=(0, None, 0))(params, cfg, hidden)  # [L, H, N]
    pred = jnp.swapaxes(scores, -1, -2) >= ACC_THRESHOLD  # [L, N, H]
    return jnp.mean((pred == (jnp.asarray(targets) >= ACC_THRESHOLD)).astype(jnp.float32))
