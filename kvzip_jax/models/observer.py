"""The observation hook: what one attention layer hands to an observer (AttentionView), and the key-block loop in
which observers compute per-key statistics without materialising [rows x keys] over every key at once.

Einsum legend: B batch, T query positions, S key slots, K KV heads, G query heads per KV head, H head dim,
D model width, N query heads (in map_key_blocks: blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

KEY_BLOCK = 256  # keys per block of map_key_blocks


@dataclasses.dataclass(frozen=True)
class AttentionView:
    """What one attention layer saw, handed to an observer. Arrays are float32 unless noted.

    Keys are [the C cache slots as they were before this step | the T new tokens]. mask, logits and probs are
    materialised only if the observer reads them (XLA drops them otherwise); lse comes from the forward itself.
    layer: layer index. hidden: the normed attention input [B, T, D]. q: post-norm, post-RoPE queries
    [B, T, K, G, H]. k, v: the cache before this step's write [B, K, C, H]. k_new, v_new: [B, K, T, H].
    key_slots: [B, K, C + T] int32 cache slot of each key (new token t goes to the first free slot + t).
    query_slots: [B, K, T] int32. mask: [B, K, T, C + T] bool. logits: masked scaled scores and probs: softmax
    weights, both [B, K, G, T, C + T]. lse: [B, K, G, T] log of each query row's
    softmax normaliser; subset_lse the same over the keys of the observer's `normaliser_subset` (see
    attention.blocked_attention). o_proj: the output projection [N H, D]. scale: the attention scale on q.k.
    """

    layer: int
    hidden: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    k_new: jax.Array
    v_new: jax.Array
    key_slots: jax.Array
    query_slots: jax.Array
    mask: jax.Array
    logits: jax.Array
    probs: jax.Array
    lse: jax.Array
    subset_lse: jax.Array
    o_proj: jax.Array
    scale: float


Observer = Callable[[AttentionView], Any]


def hidden_only(observer) -> bool:
    """Whether an observer reads a layer's normed attention input alone (its class sets hidden_only = True and has
    of_hidden(layer, hidden [B, T, D])): the layer then attends as it does without an observer, and hands it only
    that (a grouped-query layer; a latent one shows its full view)."""
    return getattr(observer, "hidden_only", False)


def map_key_blocks(block_stats, num_keys: int, size: int = KEY_BLOCK) -> jax.Array:
    """Per-key statistics [B, K, num_keys, ...] computed over blocks of `size` keys (fewer for fewer keys) one at a
    time (lax.map), so an observer's [rows x keys] intermediates never exceed one block. block_stats(start, size)
    loads the keys [start, start + size) itself (take_keys), inside the loop: operands gathered or padded whole
    before it, XLA CPU would make every layer's at the program's start and hold them all. It returns
    [B, K, size, ...]; columns past num_keys (the last block's, clipped) are dropped."""
    size = min(size, num_keys)
    out = jax.lax.map(lambda start: block_stats(start, size), jnp.arange(-(-num_keys // size)) * size)
    N, B, K = out.shape[:3]  # [N, B, K, size, ...]
    return jnp.moveaxis(out, 0, 2).reshape((B, K, N * size) + out.shape[4:])[:, :, :num_keys]


def take_keys(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    """x restricted along `axis` to [start, start + size); indices past the end are clipped (map_key_blocks drops
    those columns)."""
    return jnp.take(x, jnp.clip(start + jnp.arange(size), 0, x.shape[axis] - 1), axis=axis)
