"""Attention over the compressed layer forms beside the plain dense path: a quantized layer (its store dequantized
block by block, then its full-precision window), and a decode step on the Pallas decode kernels.

Einsum legend: B batch, T query positions, K KV heads, G query heads per KV head, M = G query rows per KV head,
H head dim.
"""

from __future__ import annotations

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.models import attention, ragged_attention
from pallas_kernels import QuantizedRows, decode_attention, ragged_decode, resolve_impl
from pallas_kernels.dispatch import supports_head_dim


def quantized_attention(q, layer: kv.QuantizedLayerCache, query_slots, window, scale: float, kernel_impl=None):
    """Attention over a quantized layer holding this step's keys: its store (dequantized block by block, by the decode
    kernels when kernel_impl is given; centred keys get their centre's logit back), then its full-precision window
    -> out [B, T, K, G, H]."""
    store = layer.store
    if kernel_impl is not None:  # a decode step: the store's tokens all precede the new one (kept in the window)
        B, T, K, G, H = q.shape
        rows = q.reshape(B, K, G, H)  # [B, K, M = G, H]
        k, v = (QuantizedRows(x.codes, x.scale, x.zero) for x in (store.k, store.v))
        if isinstance(store, kv.RaggedLayerCache):
            out, lse = ragged_decode(
                rows, k, v, store.offsets, store.lengths, store.bias, scale=scale, impl=kernel_impl
            )
        else:
            out, lse = decode_attention(
                rows, k, v, store.lengths, store.keep, store.bias, scale=scale, impl=kernel_impl
            )
        cached = out.reshape(B, T, K, G, H), lse[..., None], lse[..., None]  # [B, 1, K, G, H], [B, K, G, 1]
    elif isinstance(store, kv.RaggedLayerCache):
        cached = ragged_attention.ragged_attention(
            q,
            store.k,
            store.v,
            store.offsets,
            store.lengths,
            None,
            None,
            query_slots,
            window,
            scale,
            store.block,
            store.bias,
        )
    else:
        cached = attention.blocked_attention(
            q, store.k, store.v, store.lengths, None, None, query_slots, window, scale, store.keep, key_bias=store.bias
        )
    cached = attention.shifted(*cached, layer.center_logits(q, scale))
    return attention.then_window(
        q, *cached, layer.window.k, layer.window.v, store.lengths, layer.window.lengths, query_slots, window, scale
    )[0]


def decode_kernel_applies(cfg: ModelConfig, q, window) -> bool:
    """Whether a decode step (one new token; no sliding window) runs on the Pallas decode kernels."""
    return (
        q.shape[1] == 1
        and window is None
        and resolve_impl(cfg.attention_impl) == "pallas"
        and supports_head_dim(cfg.head_dim)
        and cfg.mla is None
    )


def decode_kernel(q, layer_cache, scale: float, impl: str):
    """pallas_kernels' decode over a cache holding this step's key: q [B, 1, K, G, H] -> out [B, 1, K, G, H]."""
    B, T, K, G, H = q.shape
    rows = q.reshape(B, K, G, H).astype(layer_cache.k.dtype)  # [B, K, M = G, H], multiplied in the cache's dtype
    if isinstance(layer_cache, kv.RaggedLayerCache):
        out, _ = ragged_decode(
            rows,
            layer_cache.k,
            layer_cache.v,
            layer_cache.offsets,
            layer_cache.lengths,
            layer_cache.bias,
            scale=scale,
            impl=impl,
        )
    else:
        out, _ = decode_attention(
            rows,
            layer_cache.k,
            layer_cache.v,
            layer_cache.lengths,
            layer_cache.keep,
            layer_cache.bias,
            scale=scale,
            impl=impl,
        )
    return out.reshape(B, T, K, G, H)  # float32
