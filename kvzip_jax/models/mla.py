"""Multi-head latent attention (DeepSeek-V2/V3; reference/mla_quant.md §1-2): one latent row per token is cached
for all heads, and attention runs over it in one of two forms that give the same result.

Per token the layer caches c = RMSNorm(W_DKV h) [R] (the latent: the layer's cache `v`) and k_rope = RoPE(W_KR h)
[dr] (one RoPE key shared by the heads: the cache's `k`), so an MLA cache is a one-"KV-head" cache with k [B, 1, C,
dr] and v [B, 1, C, R], in every form the other caches have (dense, masked, compacted, ragged, quantized). kv_b holds
per head W_UK [R, dn] and W_UV [R, dv]. Head h's key of slot t is [W_UK_h^T c_t | k_rope_t], its value W_UV_h^T c_t.

A layer compacted with fitted latents (Attention Matching, matching.MatchingConfig.latent_values) holds each slot's
key latent and value latent apart: k [B, 1, C, R + dr] = [key latent | RoPE key], v [B, 1, C, R] the value latent
(2 R + dr per slot). `split` tells the two layouts apart by the key's width; new tokens are written in the layer's
own layout (their key latent is their value latent).

  naive     the cached latents up-projected per head into keys [B, N, C, dn + dr] and values [B, N, C, dv], then
            ordinary attention with N KV heads.
  absorbed  W_UK folded into the query: q_h' = [W_UK_h q_nope_h | q_rope_h] against the key [c_t | k_rope_t], the
            value c_t: multi-query attention with one KV head of width R + dr (the cache as it is), then W_UV applied
            to each head's latent output. Nothing per head is materialised over the cache.

Einsum legend: B batch, T new tokens, C cache slots, N heads, R latent width (kv_lora_rank), d per-head width (dn
nope, dr rope, dv value), D model width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.models import attention, layers, ragged_attention

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm keep their default eps, not the config's


def project(p, cfg: ModelConfig, index: int, h, positions):
    """Queries and this step's cache rows of the normed input h [B, T, D] at positions [B, T]: (q_nope [B, T, N, dn],
    q_rope [B, T, N, dr], c [B, T, R], k_rope [B, T, dr]), RoPE applied, float32."""
    m, N = cfg.mla, cfg.num_heads
    B, T, _ = h.shape
    if m.q_lora_rank is None:
        q = layers.linear(h, p("q"))
    else:
        q = layers.linear(layers.rms_norm(layers.linear(h, p("q_a")), p("q_a_norm"), LATENT_NORM_EPS), p("q_b"))
    q_nope, q_rope = jnp.split(q.reshape(B, T, N, -1), [m.qk_nope_head_dim], axis=-1)
    c, k_rope = jnp.split(layers.linear(h, p("kv_a")), [m.kv_lora_rank], axis=-1)
    c = layers.rms_norm(c, p("kv_a_norm"), LATENT_NORM_EPS)
    rope = cfg.rope_for(index)
    q_rope = layers.apply_rope(q_rope, positions, rope)
    k_rope = layers.apply_rope(k_rope[:, :, None, :], positions, rope)[:, :, 0]
    return q_nope, q_rope, c, k_rope


def up_projections(p, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(W_UK [R, N, dn], W_UV [R, N, dv]) from kv_b."""
    m = cfg.mla
    kv_b = p("kv_b").reshape(m.kv_lora_rank, cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim)
    return kv_b[..., : m.qk_nope_head_dim], kv_b[..., m.qk_nope_head_dim :]


def split(cfg: ModelConfig, layer_cache) -> bool:
    """Whether a layer's cache holds key latents apart from its value latents (k [..., R + dr]; else k [..., dr])."""
    plain = layer_cache.window if isinstance(layer_cache, kv.QuantizedLayerCache) else layer_cache  # not packed
    return plain.k.shape[-1] == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim


def split_layout(cfg: ModelConfig, layer_cache):
    """A dense layer cache in the split layout, its k the keys absorbed queries meet ([key latent | RoPE key]):
    itself when already split, else its latents copied into its keys."""
    if split(cfg, layer_cache):
        return layer_cache
    return dataclasses.replace(layer_cache, k=latent_keys(layer_cache.k, layer_cache.v))


def rows(cfg: ModelConfig, layer_cache, c, k_rope) -> tuple[jax.Array, jax.Array]:
    """This step's cache rows (k [B, 1, T, dr] or, split, [B, 1, T, R + dr]; v [B, 1, T, R]) from its latents c
    [B, T, R] and RoPE keys [B, T, dr], in the layout of the layer's cache."""
    k_new, v_new = k_rope[:, None], c[:, None]
    return (latent_keys(k_new, v_new) if split(cfg, layer_cache) else k_new), v_new


def attend(p, cfg: ModelConfig, q_nope, q_rope, layer_cache, query_slots, window: int | None):
    """Each head's attention output [B, T, N, dv] over a cache that already holds this step's rows, in cfg.mla_form.
    query_slots [B, 1, T]: the new tokens' slots."""
    w_uk, w_uv = up_projections(p, cfg)
    if cfg.mla_form == "naive":
        return _naive(cfg, q_nope, q_rope, w_uk, w_uv, layer_cache, query_slots, window)
    q = absorbed_query(q_nope, q_rope, w_uk)
    u = _latent_attention(q, layer_cache, query_slots, window, cfg.query_scale, not split(cfg, layer_cache))
    return head_outputs(u, w_uv)


def head_outputs(u, w_uv) -> jax.Array:
    """Each head's output [B, T, N, dv] from its latent output u [B, T, 1, N, R]: W_UV applied after attention."""
    return jnp.einsum("BTNR,RNv->BTNv", u[:, :, 0].astype(jnp.float32), w_uv.astype(jnp.float32))


def latent_keys(k_rope, latents) -> jax.Array:
    """The keys absorbed queries meet, [latent | RoPE key] on the last axis, from the cache's k (RoPE keys) and v
    (latents) or this step's rows."""
    return jnp.concatenate([latents, k_rope], axis=-1)


def absorbed_query(q_nope, q_rope, w_uk) -> jax.Array:
    """[B, T, 1, N, R + dr]: each head's query against keys [latent | RoPE key], W_UK folded into its nope part."""
    q_latent = jnp.einsum("BTNd,RNd->BTNR", q_nope, w_uk.astype(jnp.float32))
    return jnp.concatenate([q_latent, q_rope], axis=-1)[:, :, None]


def _latent_attention(q, layer_cache, query_slots, window, scale: float, shared: bool):
    """Multi-query attention of q [B, T, 1, N, R + dr] over keys [c | k_rope] (shared: built from the cache's pair;
    else the cache's k as it is) and values c -> [B, T, 1, N, R]."""
    if isinstance(layer_cache, kv.QuantizedLayerCache):
        store = layer_cache.store
        cached = _latent_attention_parts(q, store, query_slots, window, scale, shared)
        q_keys = q[..., store.v.shape[-1] :] if shared else q  # what meets the cache's k: shared, its RoPE part
        cached = attention.shifted(*cached, layer_cache.center_logits(q_keys, scale))
        return attention.then_window(
            q,
            *cached,
            layer_cache.window.k,
            layer_cache.window.v,
            store.lengths,
            layer_cache.window.lengths,
            query_slots,
            window,
            scale,
            latent_keys=shared,
        )[0]
    return _latent_attention_parts(q, layer_cache, query_slots, window, scale, shared)[0]


def _latent_attention_parts(q, layer, query_slots, window, scale: float, shared: bool):
    if isinstance(layer, kv.RaggedLayerCache):
        return ragged_attention.ragged_attention(
            q,
            layer.k,
            layer.v,
            layer.offsets,
            layer.lengths,
            None,
            None,
            query_slots,
            window,
            scale,
            layer.block,
            layer.bias,
            latent_keys=shared,
        )
    return attention.blocked_attention(
        q,
        layer.k,
        layer.v,
        layer.lengths,
        None,
        None,
        query_slots,
        window,
        scale,
        layer.keep,
        key_bias=layer.bias,
        latent_keys=shared,
    )


def _naive(cfg: ModelConfig, q_nope, q_rope, w_uk, w_uv, layer_cache, query_slots, window):
    """The latents of a dense cache up-projected per head, then attention with N KV heads of one query each."""
    if not isinstance(layer_cache, kv.LayerCache):
        raise ValueError("the naive MLA form reads dense (or masked) caches; use the absorbed form")
    B, _, C, _ = layer_cache.k.shape
    N, R, dr = cfg.num_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    latents = layer_cache.v[:, 0].astype(jnp.float32)  # [B, C, R]: the value latents
    key_latents = layer_cache.k[:, 0, :, :R].astype(jnp.float32) if split(cfg, layer_cache) else latents
    k_nope = jnp.einsum("BCR,RNd->BNCd", key_latents, w_uk.astype(jnp.float32))
    k_rope = jnp.broadcast_to(layer_cache.k[:, :, :, -dr:].astype(jnp.float32), (B, N, C, dr))
    keys = jnp.concatenate([k_nope, k_rope], axis=-1)  # [B, N, C, dn + dr]
    values = jnp.einsum("BCR,RNv->BNCv", latents, w_uv.astype(jnp.float32))  # [B, N, C, dv]
    per_head = lambda x: None if x is None else jnp.broadcast_to(x, (B, N) + x.shape[2:])
    q = jnp.concatenate([q_nope, q_rope], axis=-1)[:, :, :, None]  # [B, T, N, 1, dn + dr]
    out, _, _ = attention.blocked_attention(
        q,
        keys,
        values,
        per_head(layer_cache.lengths),
        None,
        None,
        per_head(query_slots),
        window,
        cfg.query_scale,
        per_head(layer_cache.keep),
        key_bias=per_head(layer_cache.bias),
    )
    return out[:, :, :, 0]  # [B, T, N, dv]
