"""The decoder: Flax linen modules used purely through `apply`, with an explicit cache pytree in and out.

    logits, cache, aux = forward(params, tokens, positions, cache, cfg, observer)

A block's attention may be done elsewhere (Block.attend: a serving engine's kernel over its own pages, serving/);
the projections, RoPE, norms and MLP stay these.

Einsum legend: B batch, T query positions, S key slots, D model width, N query heads, K KV heads,
G query heads per KV head, H head dim, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.models import attention, layers, mla, ragged_attention
from kvzip_jax.models.cached_attention import decode_kernel, decode_kernel_applies, quantized_attention
from kvzip_jax.models.observer import AttentionView, Observer, hidden_only
from kvzip_jax.models.params import layer_name, param_shapes
from kvzip_jax.models.seq_attention import merged_attention, seq_split, split_write
from kvzip_jax.sharding.mesh import DATA, TENSOR, constrain
from kvzip_jax.sharding.rules import constrain_cache

LOGITS_CHOICES = ("last", "all", "at", None)


def _declare(module: nn.Module, shapes: dict):
    """Returns name -> param for a module whose params are declared in params.py (Flax checks the shapes)."""
    return lambda name: module.param(name, nn.initializers.zeros_init(), shapes[name], jnp.float32)


class Block(nn.Module):
    """One pre-norm decoder layer: attention over the cache, then the gated MLP.

    attend: None, or attention done elsewhere over a layer state of the caller's (a serving engine's pages):
    attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], layer_state, window, scale) -> (out [B, T, N, H], the
    layer state with the new keys and values), q and k after RoPE (query head n reads KV head n // G); the block
    passes layer_state through in place of a cache."""

    cfg: ModelConfig
    index: int
    observer: Observer | None = None
    attend: Callable | None = None

    @nn.compact
    def __call__(self, x, positions, layer_cache: kv.LayerCache, num_new):
        cfg, i = self.cfg, self.index
        p = _declare(self, param_shapes(cfg)[layer_name(i)])
        h = layers.rms_norm(x, p("attn_norm"), cfg.rms_norm_eps)  # [B, T, D]
        if self.attend is not None and (cfg.mla is not None or self.observer is not None):
            raise ValueError("attention done elsewhere (attend) takes grouped-query heads and no observer")
        if cfg.mla is not None:
            attn, layer_cache, observed = self._latent(p, h, positions, layer_cache, num_new)
        else:
            attn, layer_cache, observed = self._heads(p, h, positions, layer_cache, num_new)

        if cfg.sandwich_norms:
            attn = layers.rms_norm(attn, p("post_attn_norm"), cfg.rms_norm_eps)
        x = x + attn
        h = layers.rms_norm(x, p("mlp_norm"), cfg.rms_norm_eps)
        ffn = layers.mlp(h, p("gate_up"), p("down"), cfg.activation)
        if cfg.sandwich_norms:
            ffn = layers.rms_norm(ffn, p("post_mlp_norm"), cfg.rms_norm_eps)
        return constrain(x + ffn, DATA, None, None), layer_cache, observed

    def _heads(self, p, h, positions, layer_cache, num_new):
        """Grouped-query attention of h [B, T, D] over [cache | new tokens] -> (its output [B, T, D], the cache with
        this step's pairs, the observer's output)."""
        cfg, i = self.cfg, self.index
        B, T, _ = h.shape
        N, K, G, H = cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
        qkv = layers.linear(h, p("qkv"))  # [B, T, (N + 2K) H] float32
        if cfg.qkv_bias:
            qkv = qkv + p("qkv_bias").astype(jnp.float32)
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        q = q.reshape(B, T, N, H)
        k = k.reshape(B, T, K, H)
        v = v.reshape(B, T, K, H)
        if cfg.qk_norm:
            q = layers.rms_norm(q, p("q_norm"), cfg.rms_norm_eps)
            k = layers.rms_norm(k, p("k_norm"), cfg.rms_norm_eps)
        rope = cfg.rope_for(i)
        q = constrain(layers.apply_rope(q, positions, rope), DATA, None, TENSOR, None)  # heads on tensor
        k = constrain(layers.apply_rope(k, positions, rope), DATA, None, TENSOR, None)
        v = constrain(v, DATA, None, TENSOR, None)
        if self.attend is not None:
            out, layer_cache = self.attend(q, k, v, layer_cache, cfg.window_for(i), cfg.query_scale)  # [B, T, N, H]
            return layers.linear(out.reshape(B, T, N * H), p("o")), layer_cache, None

        filled = layer_cache.lengths  # [B, K] slots in use before this step
        k_new, v_new = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        query_slots = filled[:, :, None] + jnp.arange(T, dtype=jnp.int32)  # [B, K, T]
        q = q.reshape(B, T, K, G, H)
        o_proj = p("o")  # [N H, D]
        window = cfg.window_for(i)
        if self.observer is None or hidden_only(self.observer):  # write first: XLA updates a donated cache in place
            layer_cache = _write(layer_cache, k_new, v_new, num_new)
            out = self._attend_written(q, layer_cache, query_slots, window)
            observed = None if self.observer is None else self.observer.of_hidden(i, h)
        else:
            out, observed = self._observe(q, h, layer_cache, k_new, v_new, query_slots, window, o_proj)
            layer_cache = _write(layer_cache, k_new, v_new, num_new)
        attn = layers.linear(out.reshape(B, T, N * H), o_proj)  # [B, T, D]
        return attn, layer_cache, observed

    def _latent(self, p, h, positions, layer_cache, num_new):
        """Multi-head latent attention (models/mla.py): _heads' triple; the cache's pair is (RoPE key, latent)."""
        cfg = self.cfg
        B, T, _ = h.shape
        q_nope, q_rope, c, k_rope = mla.project(p, cfg, self.index, h, positions)
        o_proj = p("o")  # [N dv, D]
        query_slots = layer_cache.lengths[:, :, None] + jnp.arange(T, dtype=jnp.int32)  # [B, 1, T]
        window = cfg.window_for(self.index)
        k_new, v_new = mla.rows(cfg, layer_cache, c, k_rope)  # [B, 1, T, dr] (split: R + dr), [B, 1, T, R]
        if self.observer is None:
            layer_cache = _write(layer_cache, k_new, v_new, num_new)
            out, observed = mla.attend(p, cfg, q_nope, q_rope, layer_cache, query_slots, window), None
        else:  # the absorbed form shown to the observer as one KV head of N queries, keys [latent | RoPE key]
            if not isinstance(layer_cache, kv.LayerCache):
                raise ValueError("observers read dense caches; a ragged or quantized cache cannot be observed")
            w_uk, w_uv = mla.up_projections(p, cfg)
            q = mla.absorbed_query(q_nope, q_rope, w_uk)  # [B, T, 1, N, R + dr]
            latent_o = jnp.einsum(
                "RNv,NvD->NRD",
                w_uv.astype(jnp.float32),  # W_UV then o, per head: [N, R, D]
                o_proj.reshape(cfg.num_heads, cfg.mla.v_head_dim, -1).astype(jnp.float32),
            )
            keys_new = k_new if mla.split(cfg, layer_cache) else mla.latent_keys(k_new, v_new)
            u, observed = self._observe(
                q,
                h,
                mla.split_layout(cfg, layer_cache),
                keys_new,
                v_new,
                query_slots,
                window,
                latent_o.reshape(-1, latent_o.shape[-1]),
            )
            out = mla.head_outputs(u, w_uv)
            layer_cache = _write(layer_cache, k_new, v_new, num_new)
        return layers.linear(out.reshape(B, T, -1), o_proj), layer_cache, observed

    def _attend_written(self, q, layer_cache, query_slots, window):
        """Attention over a cache that already holds this step's keys -> out [B, T, K, G, H]."""
        scale, filled = self.cfg.query_scale, layer_cache.lengths
        split = seq_split(layer_cache)
        if split is not None:  # slots over the mesh's seq axis: per shard, merged through the log-sum-exp
            return merged_attention(q, layer_cache, query_slots, window, scale, split)[0]
        if isinstance(layer_cache, kv.QuantizedLayerCache):
            kernel = self.cfg.attention_impl if decode_kernel_applies(self.cfg, q, window) else None
            return quantized_attention(q, layer_cache, query_slots, window, scale, kernel)
        if decode_kernel_applies(self.cfg, q, window):
            return decode_kernel(q, layer_cache, scale, self.cfg.attention_impl)
        if isinstance(layer_cache, kv.RaggedLayerCache):
            out, _, _ = ragged_attention.ragged_attention(
                q,
                layer_cache.k,
                layer_cache.v,
                layer_cache.offsets,
                filled,
                None,
                None,
                query_slots,
                window,
                scale,
                layer_cache.block,
                layer_cache.bias,
            )
        else:
            out, _, _ = attention.blocked_attention(
                q,
                layer_cache.k,
                layer_cache.v,
                filled,
                None,
                None,
                query_slots,
                window,
                scale,
                layer_cache.keep,
                key_bias=layer_cache.bias,
            )
        return out

    def _observe(self, q, h, layer_cache, k_new, v_new, query_slots, window, o_proj):
        """Attention over [cache before this step | new tokens], shown to the observer; -> (out, observer output)."""
        cfg = self.cfg
        filled = layer_cache.lengths
        if not isinstance(layer_cache, kv.LayerCache):
            raise ValueError("observers read dense caches; a ragged or quantized cache cannot be observed")
        subset = getattr(self.observer, "normaliser_subset", None)  # keys the observer wants a normaliser over
        split = seq_split(layer_cache)
        if split is None:
            out, lse, subset_lse = attention.blocked_attention(
                q,
                layer_cache.k,
                layer_cache.v,
                filled,
                k_new,
                v_new,
                query_slots,
                window,
                cfg.query_scale,
                layer_cache.keep,
                subset=subset,
                key_bias=layer_cache.bias,
            )
        else:  # the cache per seq shard, merged through the log-sum-exp; then the new keys
            slots = jnp.broadcast_to(
                jnp.arange(layer_cache.capacity, dtype=jnp.int32), filled.shape + (layer_cache.capacity,)
            )  # [B, K, C]
            cached = merged_attention(
                q, layer_cache, query_slots, window, cfg.query_scale, split, None if subset is None else subset(slots)
            )
            out, lse, subset_lse = attention.then_new_keys(
                q, *cached, k_new, v_new, filled, query_slots, window, cfg.query_scale
            )
        # Dense weights for the observer; XLA drops them if it never reads them.
        keys, values, key_slots, mask = attention.dense_keys(
            layer_cache.k, layer_cache.v, k_new, v_new, filled, query_slots, window, layer_cache.keep
        )
        bias = None if layer_cache.bias is None else jnp.pad(layer_cache.bias, [(0, 0), (0, 0), (0, k_new.shape[2])])
        _, logits, probs = attention.dense_attention(q, keys, values, mask, cfg.query_scale, bias)  # new keys: 0
        observed = self.observer(
            AttentionView(
                layer=self.index,
                hidden=h,
                q=q,
                k=layer_cache.k,
                v=layer_cache.v,
                k_new=k_new,
                v_new=v_new,
                key_slots=key_slots,
                query_slots=query_slots,
                mask=mask,
                logits=logits,
                probs=probs,
                lse=lse,
                subset_lse=subset_lse,
                o_proj=o_proj,
                scale=cfg.query_scale,
            )
        )
        return out, observed


def _write(layer_cache: kv.LayerCache, k_new, v_new, num_new) -> kv.LayerCache:
    """cache.write, shard by shard where a dense cache's slots are split over seq (seq_attention.split_write)."""
    split = seq_split(layer_cache)
    if split is None:
        return kv.write(layer_cache, k_new, v_new, num_new)
    return split_write(layer_cache, k_new, v_new, num_new, split)


class Transformer(nn.Module):
    """Embedding, the layer stack and the (optionally tied) LM head."""

    cfg: ModelConfig
    observer: Observer | None = None
    logits: str | None = "last"

    @nn.compact
    def __call__(self, tokens, positions, cache: kv.KVCache, num_new, at=None):
        cfg = self.cfg
        p = _declare(self, param_shapes(cfg))
        embed = p("embed")  # [V, D]
        x = embed_tokens(embed, tokens, cfg)  # [B, T, D]
        new_layers, observed = [], []
        for i, layer_cache in enumerate(cache.layers):
            x, layer_cache, obs = Block(cfg, i, self.observer, name=layer_name(i))(x, positions, layer_cache, num_new)
            new_layers.append(layer_cache)
            observed.append(obs)
        new_cache = constrain_cache(kv.KVCache(layers=tuple(new_layers), next_position=cache.next_position + num_new))
        aux: dict[str, Any] = {"observed": tuple(observed)} if self.observer is not None else {}

        if self.logits is None:
            return None, new_cache, aux
        if self.logits == "last":
            x = jnp.take_along_axis(x, (num_new - 1)[:, None, None], axis=1)  # [B, 1, D]
        elif self.logits == "at":
            x = jnp.take_along_axis(x, at[:, :, None], axis=1)  # [B, P, D]
        return lm_head(x, cfg, p("final_norm"), embed, None if cfg.tie_embeddings else p("lm_head")), new_cache, aux


def lm_head(x, cfg: ModelConfig, final_norm, embed, head=None):
    """float32 logits [B, T, V] of the residual stream x [B, T, D]: the final norm [D], then the LM head [D, V]
    (the embedding [V, D] transposed when tied; head None then)."""
    x = layers.rms_norm(x, final_norm, cfg.rms_norm_eps)
    return layers.linear(x, embed.T if cfg.tie_embeddings else head)


def embed_tokens(embed, tokens, cfg: ModelConfig):
    """The residual stream [B, T, D] float32 (layers.py) of tokens [B, T] under the embedding table [V, D]."""
    x = embed[tokens].astype(jnp.float32)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, embed.dtype).astype(jnp.float32)  # rounded as HF does
    return x


def apply_block(
    params, cfg: ModelConfig, index: int, x, positions, layer_cache: kv.LayerCache, num_new, observer=None, attend=None
):
    """Decoder layer `index` alone on the residual stream x [B, T, D] -> (x, layer_cache, observer output): for
    passes that go layer by layer (Attention Matching's on-policy compaction changes layer l before layer l + 1
    runs; a serving engine's decode step, with attention over its pages: attend, as in Block). forward is these
    blocks between embed_tokens and lm_head."""
    block = Block(cfg, index, observer, attend)
    return block.apply({"params": params[layer_name(index)]}, x, positions, layer_cache, num_new)


def forward(
    params,
    tokens,
    positions,
    cache: kv.KVCache,
    cfg: ModelConfig,
    observer=None,
    *,
    num_new=None,
    logits: str | None = "last",
    at=None,
):
    """Runs tokens [B, T] at positions [B, T] on top of cache; returns (logits, cache, aux).

    num_new [B]: how many of the T tokens are real (right padding); defaults to T. logits: "last" gives
    [B, 1, V] at each row's last real token, "all" gives [B, T, V], "at" gives [B, P, V] at the token indices
    at [B, P] (the LM head runs only there), None skips the LM head.
    aux["observed"]: per-layer observer outputs when an observer is given.
    """
    if logits not in LOGITS_CHOICES:
        raise ValueError(f"logits must be one of {LOGITS_CHOICES}, got {logits!r}")
    if (logits == "at") != (at is not None):
        raise ValueError('token indices `at` go with logits="at", and only with it')
    B, T = tokens.shape
    if num_new is None:
        num_new = jnp.full((B,), T, jnp.int32)
    model = Transformer(cfg, observer, logits)
    return model.apply({"params": params}, tokens, positions, cache, num_new, at)
