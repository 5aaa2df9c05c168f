"""Stateless building blocks: linear maps, RMSNorm, rotary embedding and the gated MLP (attention lives in
attention.py).

Mixed precision: activations (the residual stream) stay float32 whatever the weights' dtype; a linear map multiplies
in the weights' dtype (bfloat16 runs on the matrix units) and accumulates in float32.

Einsum legend: B batch, T query positions, D model width, H head dim, F MLP width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import RopeSpec


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., E] @ w [E, F] in w's dtype, accumulated and returned in float32."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., E] * rsqrt(mean(x^2) + eps) * weight [E], in float32 (weight is the effective multiplier)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight).astype(x.dtype)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """[H/2] float32 inverse frequencies, with linear, llama3 or YaRN scaling as HF computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(spec.theta) ** exponents)).astype(np.float32)
    if spec.kind == "linear":
        return (inv_freq / np.float32(spec.factor)).astype(np.float32)
    if spec.kind == "llama3":
        low_wavelen = spec.original_max_position / spec.low_freq_factor
        high_wavelen = spec.original_max_position / spec.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if spec.kind == "yarn":
        return _yarn_inv_freq(spec, head_dim, inv_freq)
    return inv_freq


def _yarn_inv_freq(spec: RopeSpec, head_dim: int, inv_freq: np.ndarray) -> np.ndarray:
    """YaRN: dimensions rotating more than beta_fast times over the original context keep their frequency, those
    rotating fewer than beta_slow times are divided by the factor, and a linear ramp joins the two."""
    yarn = spec.yarn

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(spec.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = dimension(yarn.beta_fast), dimension(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = (1 - ramp).astype(np.float32)  # 1: the dimension keeps its frequency
    interpolated = (inv_freq / np.float32(spec.factor)).astype(np.float32)
    return (interpolated * (1 - extrapolated) + inv_freq * extrapolated).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, spec: RopeSpec) -> jax.Array:
    """Half-split rotary embedding of x [B, T, heads, H] at integer positions [B, T] (YaRN: cos and sin scaled by
    its attention factor)."""
    inv_freq = rope_inv_freq(spec, x.shape[-1])
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    factor = 1.0 if spec.yarn is None else spec.yarn.attention_factor
    cos = (jnp.cos(angles) * factor)[:, :, None, :]  # [B, T, 1, H/2]
    sin = (jnp.sin(angles) * factor)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


MLP_TOKEN_BLOCK = 512  # most tokens per MLP block of a long input: its [T, 2F] intermediate is a forward's largest


def mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str) -> jax.Array:
    """Gated MLP: act(x W_gate) * (x W_up) W_down. x [B, T, D], gate_up [D, 2F], down [F, D].

    Inputs longer than MLP_TOKEN_BLOCK run in a loop over equal token blocks of at most that many tokens, so the
    [B, T, 2F] intermediate of a 2,048-token chunk never exists whole (written out, XLA CPU computes every block's
    first product before any second one)."""
    B, T, D = x.shape
    n = -(-T // MLP_TOKEN_BLOCK)
    if n == 1:
        return _gated(x, gate_up, down, activation)
    size = -(-T // n)
    x = jnp.pad(x, [(0, 0), (0, n * size - T), (0, 0)])  # [B, n size, D]

    def block(i, out):
        xb = jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)  # [B, size, D]
        return jax.lax.dynamic_update_slice_in_dim(out, _gated(xb, gate_up, down, activation), i * size, axis=1)

    return jax.lax.fori_loop(0, n, block, zeros_from(x))[:, :T]


def zeros_from(x: jax.Array) -> jax.Array:
    """float32 zeros shaped like x, computed from x (x * 0; XLA does not fold a float product by 0), not as a
    constant: XLA CPU computes a constant's broadcast at the start of the program, so a buffer every layer starts
    from (a loop's initial output or accumulator) would be live for all layers at once."""
    return x.astype(jnp.float32) * 0.0


def _gated(x, gate_up, down, activation: str):
    gate, up = jnp.split(linear(x, gate_up), 2, axis=-1)  # [B, T, F] each
    act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return linear(act * up, down)
