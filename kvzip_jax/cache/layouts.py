"""The cache pytrees, one per layer layout (dense or masked, ragged, quantized) and the whole cache, with what each
layout holds: its room, its visible slots, its kept pairs.

Einsum legend: B batch, T query positions, K KV heads, G query heads per KV head, C cache capacity (slots), S ragged
store slots, H head dim, W key width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    k: jax.Array  # [B, K, C, H]
    v: jax.Array  # [B, K, C, H]
    lengths: jax.Array  # [B, K] int32, filled slots per KV head
    keep: jax.Array | None = None  # [B, K, C] bool in a masked compressed cache: False slots are evicted
    bias: jax.Array | None = None  # [B, K, C] float32 logit added per slot (Attention Matching's beta; 0 elsewhere)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


RAGGED_BLOCK = 16  # slots per block of a ragged layer; every head's segment is a whole number of blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedLayerCache:
    """A compressed layer storing only kept pairs: one flat store per row holding every KV head's segment.

    Head k's slot i of row b is k[b, offsets[b, k] + i]; its segment runs to the next head's offset (the last to S),
    so the room left for appended tokens is per head. Segments start on multiples of `block`.
    """

    k: jax.Array  # [B, S, H]
    v: jax.Array  # [B, S, H]
    lengths: jax.Array  # [B, K] int32, filled slots per KV head
    offsets: jax.Array  # [B, K] int32, first store slot of each head's segment
    bias: jax.Array | None = None  # [B, S] float32 logit added per store slot (Attention Matching's beta)
    block: int = dataclasses.field(default=RAGGED_BLOCK, metadata=dict(static=True))

    def head_capacity(self) -> jax.Array:
        """[B, K] slots of each head's segment."""
        ends = jnp.concatenate([self.offsets[:, 1:], jnp.full_like(self.offsets[:, :1], self.k.shape[1])], axis=1)
        return ends - self.offsets


WINDOW = 128  # full-precision recent tokens of a quantized layer (KIVI's residual length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLayerCache:
    """A layer whose stored pairs are quantized, and a full-precision window where new tokens are written.

    store: a dense, masked, compacted or ragged layer whose k and v are quant.Quantized rows (per token and KV head,
    groups along the head dim; keys and values may differ in bits and group); its lengths, keep mask, offsets and
    float32 bias are those of the unquantized form.
    window: a dense LayerCache [B, K, R, H] in the model's dtype. Head k's window row j is its slot
    store.lengths + j: the window's tokens come after every stored pair. A write that would overfill the window moves
    all of [window | new tokens] but the last ((n - 1) mod R) + 1 of those n into the store, quantized (n - that is a
    multiple of R); the rest stay in the window.
    key_center: None, or [B, K, W] per-channel centres of the keys in the scale dtype (W the key width): the store holds
    quantized k - key_center, so a channel that sits far from 0 on every token no longer sets the scale of the other
    channels of its group. A query's logits over the store then lack q . key_center, the same for every stored key:
    attention adds it to the store's log-sum-exp (attention.shifted), so the softmax over [store | window] is
    unchanged.
    """

    store: LayerCache | RaggedLayerCache
    window: LayerCache
    key_center: jax.Array | None = None

    def center_logits(self, q: jax.Array, scale: float) -> jax.Array | None:
        """[B, K, G, T] the logit scale * q . key_center that the store's centred keys leave out, for queries
        [B, T, K, G, W]; None without centres."""
        if self.key_center is None:
            return None
        return scale * jnp.einsum("BTKGW,BKW->BKGT", q.astype(jnp.float32), self.key_center.astype(jnp.float32))

    @property
    def lengths(self) -> jax.Array:
        """[B, K] filled slots per KV head: the store's and the window's."""
        return self.store.lengths + self.window.lengths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    layers: tuple[LayerCache | RaggedLayerCache | QuantizedLayerCache, ...]
    next_position: jax.Array  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.next_position.shape[0]

    @property
    def capacity(self) -> int:
        """Slots per KV head of the smallest dense layer."""
        return min(layer.capacity for layer in self.layers if isinstance(layer, LayerCache))

    def lengths(self) -> jax.Array:
        """[L, B, K] filled slots of every layer and KV head."""
        return jnp.stack([layer.lengths for layer in self.layers])

    def room(self) -> jax.Array:
        """[B] tokens every layer and KV head of a row can still take."""
        return jnp.min(jnp.stack([_room(layer) for layer in self.layers]), axis=(0, 2))


def _room(layer) -> jax.Array:
    """[B, K] free slots of every head (a quantized layer: tokens it takes before a flush would not fit the store)."""
    if isinstance(layer, QuantizedLayerCache):
        R = layer.window.capacity
        return (_room(layer.store) // R + 1) * R - layer.window.lengths
    if isinstance(layer, RaggedLayerCache):
        return layer.head_capacity() - layer.lengths
    return layer.capacity - layer.lengths


def _dense_only(cache: KVCache, what: str) -> None:
    if any(isinstance(layer, QuantizedLayerCache) for layer in cache.layers):
        raise TypeError(f"{what} takes an unquantized cache: quantize after compressing (cache.quantized)")


def kept_per_head(cache: KVCache) -> jax.Array:
    """[L, B, K] visible filled slots of every head (what pack needs room for)."""
    return jnp.stack([_kept(layer) for layer in cache.layers]).astype(jnp.int32)


def _kept(layer) -> jax.Array:
    if isinstance(layer, QuantizedLayerCache):
        return _kept(layer.store) + layer.window.lengths
    return visible_slots(layer).sum(-1) if isinstance(layer, LayerCache) else layer.lengths


def visible_slots(layer: LayerCache) -> jax.Array:
    """[B, K, C] bool: filled slots that are not evicted."""
    visible = jnp.arange(layer.capacity) < layer.lengths[..., None]
    return visible if layer.keep is None else visible & layer.keep
