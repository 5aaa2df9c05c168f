"""The parameter tree of a model: names and shapes, the single source of truth for init, converters and restore.

Layout (all float32, einsum-ready, linear weights stored [in, out]):
  embed            [V, D]            token embedding (unscaled; Gemma's sqrt(D) is applied in the forward)
  final_norm       [D]               effective RMSNorm multiplier (Gemma's +1 already baked in)
  lm_head          [D, V]            only when the embeddings are not tied
  layers_{i}:
    attn_norm      [D]
    qkv            [D, (N + 2K) H]   fused projection: N query heads, then K key heads, then K value heads
    qkv_bias       [(N + 2K) H]      qwen2
    q_norm, k_norm [H]               qwen3, gemma3 (per-head RMSNorm before RoPE)
    o              [N H, D]
    post_attn_norm [D]               gemma3
    mlp_norm       [D]
    gate_up        [D, 2F]           gate columns first, then up
  MLA layers (deepseek) hold, in place of qkv and o (Q = q_lora_rank, R = kv_lora_rank, dn, dr, dv the per-head
  nope, rope and value widths; each head's rotary columns evens first, config.MLASpec):
    q              [D, N (dn + dr)]  without a query down-projection; else q_a [D, Q], q_a_norm [Q],
                                     q_b [Q, N (dn + dr)]
    kv_a           [D, R + dr]       the latent, then the shared RoPE key
    kv_a_norm      [R]
    kv_b           [R, N (dn + dv)]  per head: W_UK (dn columns), then W_UV (dv)
    o              [N dv, D]
    down           [F, D]
    post_mlp_norm  [D]               gemma3
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import ModelConfig


def layer_name(i: int) -> str:
    return f"layers_{i}"


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict of parameter name -> shape tuple."""
    D, F, H, N, K, V = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
    )
    layer = {
        "attn_norm": (D,),
        "qkv": (D, (N + 2 * K) * H),
        "o": (N * H, D),
        "mlp_norm": (D,),
        "gate_up": (D, 2 * F),
        "down": (F, D),
    }
    if cfg.mla is not None:
        del layer["qkv"]
        layer.update(_mla_shapes(cfg))
    if cfg.qkv_bias:
        layer["qkv_bias"] = ((N + 2 * K) * H,)
    if cfg.qk_norm:
        layer["q_norm"] = (H,)
        layer["k_norm"] = (H,)
    if cfg.sandwich_norms:
        layer["post_attn_norm"] = (D,)
        layer["post_mlp_norm"] = (D,)
    tree = {"embed": (V, D), "final_norm": (D,)}
    if not cfg.tie_embeddings:
        tree["lm_head"] = (D, V)
    for i in range(cfg.num_layers):
        tree[layer_name(i)] = dict(layer)
    return tree


def _mla_shapes(cfg: ModelConfig) -> dict:
    m, D, N = cfg.mla, cfg.hidden_size, cfg.num_heads
    q_width = N * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    shapes = (
        {"q": (D, q_width)}
        if m.q_lora_rank is None
        else {"q_a": (D, m.q_lora_rank), "q_a_norm": (m.q_lora_rank,), "q_b": (m.q_lora_rank, q_width)}
    )
    return {
        **shapes,
        "kv_a": (D, m.kv_lora_rank + m.qk_rope_head_dim),
        "kv_a_norm": (m.kv_lora_rank,),
        "kv_b": (m.kv_lora_rank, N * (m.qk_nope_head_dim + m.v_head_dim)),
        "o": (N * m.v_head_dim, D),
    }


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """The parameter tree as jax.ShapeDtypeStruct leaves (restore targets, shape checks)."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )


def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02) -> dict:
    """Random parameters (tests and benchmarks): normal weights, norms near one."""
    shapes = param_shapes(cfg)
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        name = path[-1].key
        base = 1.0 if name.endswith("norm") else 0.0
        return jnp.asarray(base + scale * rng.standard_normal(shape) * (5 if base else 1), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes, is_leaf=lambda x: isinstance(x, tuple))
