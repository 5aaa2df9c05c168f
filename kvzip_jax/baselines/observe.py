"""Observing the attention of any span of tokens on top of a cache, without a second prefill.

A cache holding [prefix | context] (slot s holds position s) can replay any span of its own context: forwarded at
positions start.. on top of the cache cut back to its first `start` slots, the span recomputes exactly the keys the
cache stores after `start`, and its queries see what they saw in the prefill. A question appended after the context
is observed the same way with start = prefix_len + context_len.

Observers of this package return per layer [B, K, C] statistics over cache slots: a cache key's at its slot, a new
key's at its key slot (slots >= C are dropped).

Einsum legend: B batch, T query positions, S key slots (C cache slots + T new), C cache capacity, K KV heads,
G query heads per KV head, H head dim, L layers, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.models.observer import AttentionView, Observer
from kvzip_jax.models.transformer import forward


def observe_span(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    tokens: jax.Array,
    start: jax.Array,
    num_valid: jax.Array,
    observer: Observer,
) -> tuple:
    """Per-layer observer outputs of tokens [B, T] forwarded at positions start [B] + t on top of the cache's
    slots [0, start); num_valid [B] real tokens per row. The cache is neither modified nor copied."""
    B, T = tokens.shape
    layers = tuple(
        dataclasses.replace(layer, lengths=jnp.broadcast_to(start[:, None], layer.lengths.shape))
        for layer in cache.layers
    )
    cut = kv.KVCache(layers=layers, next_position=start)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    _, _, aux = forward(params, tokens, positions, cut, cfg, observer, num_new=num_valid, logits=None)
    return aux["observed"]


def real_rows(num_valid: jax.Array, T: int) -> jax.Array:
    """[B, T] bool: the real (non-padding) query rows."""
    return jnp.arange(T) < num_valid[:, None]


def to_slots(view: AttentionView, stat: jax.Array) -> jax.Array:
    """A non-negative statistic of every key [B, K, C + T] -> [B, K, C] at the keys' cache slots.

    A slot >= start is seen twice (the invisible cache key and the new key recomputing it): the max keeps the
    new key's value, since an invisible key's statistic is 0."""
    B, K, C, _ = view.k.shape
    batch = jnp.arange(B)[:, None, None]
    head = jnp.arange(K)[None, :, None]
    slots = jnp.zeros((B, K, C), jnp.float32)  # [B, K, C]
    return slots.at[batch, head, view.key_slots].max(stat.astype(jnp.float32), mode="drop")


def context_columns(stats: jax.Array, prefix_len: jax.Array, context_len: jax.Array, n: int) -> jax.Array:
    """Slot statistics [L, B, K, C] -> context columns [L, B, K, n] (column i = slot prefix_len + i); columns past
    context_len are -inf."""
    C = stats.shape[-1]
    index = jnp.clip(prefix_len[:, None] + jnp.arange(n), 0, C - 1)  # [B, n]
    columns = jnp.take_along_axis(stats, index[None, :, None, :], axis=-1)  # [L, B, K, n]
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], columns, -jnp.inf)


def window_columns(context_len: jax.Array, question_len: jax.Array, window: jax.Array, n: int) -> jax.Array:
    """[B, n] bool: the context columns among the last window [B] tokens of [context | question] (question_len [B],
    0 without a question): a window may straddle context and question, or lie in the question entirely."""
    columns = jnp.arange(n)
    start = (context_len + question_len - window)[:, None]  # [B, 1] first context column inside the window
    return (columns >= start) & (columns < context_len[:, None])
