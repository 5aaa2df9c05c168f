"""Attention over quantized keys and values with the scales folded in, never materialising a dequantized copy: the
form a blocked or kernel attention applies block by block (reference/mla_quant.md §5).

For a key row k = z + c s per group g (zero z_g, scale s_g, codes c_g):
    q . k = sum_g s_g (q_g . c_g) + z_g sum(q_g)
and for values, the output u = sum_t p_t v_t per group g:
    u_g = sum_t (p_t s_tg) c_tg + sum_t p_t z_tg

Einsum legend: Q query rows, T key rows, N groups per row, g elements per group, H = N g head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvzip_jax.quant.groups import Quantized, per_element, unpack_int4


def folded_logits(queries: jax.Array, keys: Quantized) -> jax.Array:
    """queries [Q, H] float, keys quantized rows [T, H] -> [Q, T] float32 queries . dequantized keys."""
    if keys.along == "tokens":  # KIVI keys: a scale and zero per (token group, channel)
        codes = (unpack_int4(keys.codes) if keys.bits == 4 else keys.codes).astype(jnp.float32)  # [T, H]
        scale = per_element(keys, keys.scale.astype(jnp.float32))  # [T, H]
        zero = per_element(keys, keys.zero.astype(jnp.float32))
        q = queries.astype(jnp.float32)
        return jnp.einsum("qh,th,th->qt", q, scale, codes) + jnp.einsum("qh,th->qt", q, zero)
    return _folded_logits_per_token(queries, keys)


def grouped_codes(q: Quantized) -> jax.Array:
    """[..., N, g] float32 codes of a Quantized (int4 unpacked)."""
    codes = unpack_int4(q.codes) if q.bits == 4 else q.codes
    return codes.astype(jnp.float32).reshape(codes.shape[:-1] + (q.scale.shape[-1], -1))


def _folded_logits_per_token(queries: jax.Array, keys: Quantized) -> jax.Array:
    codes = grouped_codes(keys)  # [T, N, g]
    N, g = codes.shape[-2:]
    qg = queries.astype(jnp.float32).reshape(queries.shape[0], N, g)  # [Q, N, g]
    dots = jnp.einsum("qng,tng->qtn", qg, codes)  # [Q, T, N] per-group code dots
    scale, zero = keys.scale.astype(jnp.float32), keys.zero.astype(jnp.float32)  # [T, N]
    return jnp.einsum("qtn,tn->qt", dots, scale) + jnp.einsum("qn,tn->qt", qg.sum(-1), zero)


def folded_values(probs: jax.Array, values: Quantized) -> jax.Array:
    """probs [Q, T] float, values quantized rows [T, H] (per token, as KIVI and QServe both store values) -> [Q, H]
    float32 probs @ dequantized values."""
    if values.along != "head_dim":
        raise ValueError("values are quantized per token (along head_dim)")
    codes = grouped_codes(values)  # [T, N, g]
    scale, zero = values.scale.astype(jnp.float32), values.zero.astype(jnp.float32)  # [T, N]
    p = probs.astype(jnp.float32)
    weighted = jnp.einsum("qt,tn,tng->qng", p, scale, codes)  # [Q, N, g]
    out = weighted + jnp.einsum("qt,tn->qn", p, zero)[..., None]
    return out.reshape(out.shape[0], -1)
