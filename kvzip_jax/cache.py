"""The KV cache: an explicit pytree passed into the forward and returned from it, plus its pure operations.

Per layer, `k, v: [B, K, C, H]` hold post-norm, post-RoPE keys and values at their original absolute positions
(RoPE is never re-applied), left-aligned: slots [0, lengths[b, k]) are filled. `lengths: [B, K]` is per KV head
so that compressed caches can keep a different number of pairs per head. `next_position: [B]` is the logical
position the next token gets; it equals the filled length until a compression evicts pairs.

Compressed forms: a masked cache is the same arrays plus `keep: [B, K, C]` (mask_context); a ragged cache
(pack) stores each layer as one flat `[B, S, H]` store of per-KV-head segments with `offsets: [B, K]`
(RaggedLayerCache), so its bytes follow the pairs each head keeps. Any of these forms can hold its pairs quantized
(quantized: int8 or packed int4 codes with group scales, quant/) beside a full-precision window of the most recent
tokens (QuantizedLayerCache), its keys centred per channel first (key_center).

A full cache: every head has a fixed room (the capacity of a dense layer, its segment of a ragged one). `write`
stores what fits and drops the rest, so `lengths` never exceed a head's room and no head writes into another's
segment. Callers check first: prefill and ask raise ContextTooLongError before writing tokens that do not fit,
and the decode loop ends a row whose cache is full (room() == 0) while the other rows go on.

Einsum legend: B batch, K KV heads, C cache capacity (slots), S ragged store slots, H head dim, T new tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import ModelConfig
from kvzip_jax.quant import groups as quant


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
    groups along the head dim); its lengths, keep mask, offsets and float32 bias are those of the unquantized form.
    window: a dense LayerCache [B, K, R, H] in the model's dtype. Head k's window row j is its slot
    store.lengths + j: the window's tokens come after every stored pair. A write that would overfill the window moves
    all of [window | new tokens] but the last ((n - 1) mod R) + 1 of those n into the store, quantized (n - that is a
    multiple of R); the rest stay in the window.
    key_center: None, or [B, K, W] per-channel centres of the keys in the scale dtype (W the key width): the store holds
    quantized k - key_center, so a channel that sits far from 0 on every token (Qwen2.5-1.5B's layer 0 has one near
    -355, from its key bias) no longer sets the scale of the other channels of its group. A query's logits over the
    store then lack q . key_center, the same for every stored key: attention adds it to the store's log-sum-exp
    (attention.shifted), so the softmax over [store | window] is unchanged.
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


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for `capacity` tokens per KV head in every layer."""
    k_width, v_width = cfg.cache_widths()  # H and H; an MLA cache's RoPE key and latent
    shape = lambda width: (batch_size, cfg.num_kv_heads, capacity, width)  # [B, K, C, H]
    layer = lambda: LayerCache(
        k=jnp.zeros(shape(k_width), dtype),
        v=jnp.zeros(shape(v_width), dtype),
        lengths=jnp.zeros((batch_size, cfg.num_kv_heads), jnp.int32),
    )
    return KVCache(layers=tuple(layer() for _ in range(cfg.num_layers)),
                   next_position=jnp.zeros((batch_size,), jnp.int32))


def write(layer, k_new: jax.Array, v_new: jax.Array, num_new: jax.Array):
    """Writes the first num_new [B] of k_new, v_new [B, K, T, H] at each head's filled length.

    Padding rows (t >= num_new) are dropped, never written, so neither a finished row of a batch nor a cache
    with less spare room than the padded width loses pairs. Rows past a head's room are dropped too, and the
    lengths count only what was stored (at most the head's room; see the module docstring on full caches).
    """
    if isinstance(layer, QuantizedLayerCache):
        return _write_quantized(layer, k_new, v_new, num_new)
    if isinstance(layer, RaggedLayerCache):
        return _write_ragged(layer, k_new, v_new, num_new)
    count = jnp.broadcast_to(num_new[:, None], layer.lengths.shape)
    return written(layer, _write_dense(layer.k, k_new, layer.lengths, count),
                   _write_dense(layer.v, v_new, layer.lengths, count), num_new)


def _write_dense(store: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """store [B, K, C, ...] with the first count [B, K] rows of new [B, K, T, ...] at slots start [B, K] (rows past
    C dropped)."""
    T = new.shape[2]

    def write_head(cache_kh, new_kh, start, count):  # [C, ...], [T, ...], [], []
        C = cache_kh.shape[0]
        new_kh = new_kh.astype(cache_kh.dtype)
        rows = jnp.arange(T)
        if T > C:  # a padded block wider than the whole cache: scatter the real rows
            target = jnp.where(rows < count, start + rows, C)  # padding aims past the end: dropped
            return cache_kh.at[target].set(new_kh, mode="drop")
        base = jnp.minimum(start, C - T)  # a block that fits; the real rows go to start within it
        shift = start - base
        old = jax.lax.dynamic_slice_in_dim(cache_kh, base, T, axis=0)  # [T, H]
        moved = jnp.roll(new_kh, shift, axis=0)
        real = ((rows >= shift) & (rows - shift < count))[:, None]
        return jax.lax.dynamic_update_slice_in_dim(cache_kh, jnp.where(real, moved, old), base, axis=0)

    return jax.vmap(jax.vmap(write_head))(store, new, start, count)


def written(layer: LayerCache, k: jax.Array, v: jax.Array, num_new: jax.Array) -> LayerCache:
    """A dense layer after a write of num_new [B] pairs per head whose K, V [B, K, C, H] are already stored: the
    lengths grow by what fits (at most the capacity); the keep mask and the bias are unchanged (slots past the
    context are kept, and new tokens get no bias)."""
    lengths = jnp.minimum(layer.lengths + num_new[:, None].astype(jnp.int32), layer.capacity)
    return LayerCache(k=k, v=v, lengths=lengths, keep=layer.keep, bias=layer.bias)


def _write_ragged(layer: RaggedLayerCache, k_new, v_new, num_new) -> RaggedLayerCache:
    count = jnp.broadcast_to(num_new[:, None].astype(jnp.int32), layer.lengths.shape)
    stored = jnp.minimum(count, layer.head_capacity() - layer.lengths)  # [B, K] new pairs each head can take
    put = lambda store, new: _put_ragged(store, new, layer.offsets + layer.lengths, stored)
    return dataclasses.replace(layer, k=put(layer.k, k_new), v=put(layer.v, v_new), lengths=layer.lengths + stored)


def _put_ragged(store: jax.Array, new: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """store [B, S, ...] with the first count [B, K] rows of head k's new [B, K, T, ...] at store slots start [B, K]
    onward (the caller keeps them within the head's segment)."""
    B, T = new.shape[0], new.shape[2]
    rows = jnp.arange(T, dtype=jnp.int32)
    slots = jnp.where(rows < count[..., None], start[..., None] + rows, store.shape[1])  # [B, K, T]; rest dropped
    return store.at[jnp.arange(B)[:, None, None], slots].set(new.astype(store.dtype), mode="drop")


def quantized(cache: KVCache, fmt: quant.QuantFormat = quant.QuantFormat(), window: int = WINDOW,
              center: bool = True) -> KVCache:
    """The cache with every layer's stored pairs quantized in fmt (per token, groups along the head dim) and an empty
    full-precision window of `window` tokens per KV head for what is appended next; keep masks, offsets and biases
    (float32) are kept as they are. center: each head's keys are first centred per channel on the midpoint of their
    visible pairs' range, rounded to the scale dtype (key_center; exact: attention adds the centre's logit back).
    Any form (dense, masked, compacted, ragged); jittable."""
    if fmt.along != "head_dim":
        raise ValueError("a cache quantizes its pairs per token (along='head_dim'); per-channel (KIVI) keys need "
                         "token groups that flushes of the window would split")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def layer_of(layer):
        if isinstance(layer, QuantizedLayerCache):
            raise TypeError("the cache is quantized already")
        copied = jax.tree.map(jnp.copy, dataclasses.replace(layer, k=None, v=None))  # new arrays: donation-safe
        key_center = _key_center(layer).astype(fmt.scale_dtype) if center else None
        keys = layer.k if key_center is None else layer.k - _per_slot(layer, key_center.astype(jnp.float32))
        store = dataclasses.replace(copied, k=quant.quantize(keys, fmt), v=quant.quantize(layer.v, fmt))
        B, K = layer.lengths.shape
        empty = lambda x: jnp.zeros((B, K, window, x.shape[-1]), x.dtype)  # k and v widths (MLA: they differ)
        return QuantizedLayerCache(store=store, window=LayerCache(k=empty(layer.k), v=empty(layer.v),
                                                                  lengths=jnp.zeros_like(layer.lengths)),
                                   key_center=key_center)

    return KVCache(layers=tuple(layer_of(layer) for layer in cache.layers), next_position=jnp.copy(cache.next_position))


def _key_center(layer) -> jax.Array:
    """[B, K, W] float32: per channel, the midpoint of (the smallest, the largest) key over each head's visible
    pairs; 0 for a head with none."""
    keys = layer.k.astype(jnp.float32)
    if isinstance(layer, RaggedLayerCache):  # [B, S, W] -> per head segment
        head, filled = _slot_heads(layer)  # [B, S]
        K = layer.offsets.shape[1]
        segment = jnp.where(filled, head, K)  # empty slots: a segment of their own, dropped
        reduce = lambda op: jax.vmap(lambda x, s: op(x, s, num_segments=K + 1))(keys, segment)[:, :K]
        high, low = reduce(jax.ops.segment_max), reduce(jax.ops.segment_min)
    else:
        visible = visible_slots(layer)[..., None]  # [B, K, C, 1]
        high = jnp.where(visible, keys, -jnp.inf).max(axis=2)
        low = jnp.where(visible, keys, jnp.inf).min(axis=2)
    return jnp.where(high >= low, (high + low) / 2, 0.0)


def _slot_heads(layer: RaggedLayerCache) -> tuple[jax.Array, jax.Array]:
    """([B, S] the head whose segment holds each store slot, [B, S] whether that slot is filled)."""
    slots = jnp.arange(layer.k.shape[1], dtype=jnp.int32)
    head = jax.vmap(lambda o: jnp.searchsorted(o, slots, side="right") - 1)(layer.offsets)  # [B, S]
    start = jnp.take_along_axis(layer.offsets, head, axis=1)
    return head, slots - start < jnp.take_along_axis(layer.lengths, head, axis=1)


def _per_slot(layer, per_head: jax.Array) -> jax.Array:
    """per_head [B, K, W] laid out as the layer's k: [B, K, 1, W] (dense) or [B, S, W] (ragged, by segment)."""
    if isinstance(layer, RaggedLayerCache):
        return jnp.take_along_axis(per_head, _slot_heads(layer)[0][..., None], axis=1)
    return per_head[:, :, None, :]


def _write_quantized(layer: QuantizedLayerCache, k_new, v_new, num_new) -> QuantizedLayerCache:
    """[window | new] -> the store (all but the last ((n - 1) mod R) + 1, quantized) and the window (the rest)."""
    window, store = layer.window, layer.store
    R, T = window.capacity, k_new.shape[2]
    grow = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, T), (0, 0)])
    both = write(LayerCache(k=grow(window.k), v=grow(window.v), lengths=window.lengths), k_new, v_new, num_new)
    total = both.lengths  # [B, K] rows of [window | new]
    flushed = jnp.where(total > R, (total - 1) // R * R, 0)  # [B, K] a multiple of R
    stored = jnp.minimum(flushed, _room(store))  # rows past the store's room are dropped (callers check room())
    if isinstance(store, RaggedLayerCache):
        put = lambda old, new: jax.tree.map(
            lambda o, n: _put_ragged(o, n, store.offsets + store.lengths, stored), old, new)
    else:
        put = lambda old, new: jax.tree.map(lambda o, n: _write_dense(o, n, store.lengths, stored), old, new)
    keys = both.k if layer.key_center is None else both.k - layer.key_center[:, :, None, :].astype(jnp.float32)
    store = dataclasses.replace(store, k=put(store.k, quant.quantize(keys, store.k.format)),  # (MLA: k and v
                                v=put(store.v, quant.quantize(both.v, store.v.format)),  # differ in width)
                                lengths=store.lengths + stored)
    rest = jnp.minimum(flushed[..., None] + jnp.arange(R), R + T - 1)  # [B, K, R] rows left in the window
    keep = lambda x: jnp.take_along_axis(x, rest[..., None], axis=2)
    return QuantizedLayerCache(store=store, window=LayerCache(k=keep(both.k), v=keep(both.v), lengths=total - flushed),
                               key_center=layer.key_center)


def nbytes(cache: KVCache) -> int:
    """Device bytes held by the cache arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def used_bytes(cache: KVCache) -> int:
    """Bytes of the K/V pairs held and visible (filled and, in a masked cache, kept): pairs x (a key and a value:
    head dim values, or a quantized layer's codes, scales and zero points; plus a float32 bias where the cache
    carries one); a quantized layer's window tokens at full precision and its key centres."""
    return int(row_bytes(cache).sum())


def row_bytes(cache: KVCache, to_host=np.asarray) -> np.ndarray:
    """[B] used_bytes of each batch row. to_host: fetches a device array (a multi-process run passes one that
    gathers the other processes' shards)."""
    total = np.zeros(cache.batch_size, np.int64)
    for layer, kept in zip(cache.layers, to_host(kept_per_head(cache)).sum(axis=2)):  # kept [B]
        if isinstance(layer, QuantizedLayerCache):
            window = to_host(layer.window.lengths).sum(axis=1)  # [B]
            total += window * pair_bytes(layer.window) + (kept - window) * pair_bytes(layer.store)
            if layer.key_center is not None:  # its centres: K x W per row
                total += layer.key_center[0].size * layer.key_center.dtype.itemsize
        else:
            total += kept * pair_bytes(layer)
    return total


def pair_bytes(layer) -> int:
    """Bytes one slot of a (dense or ragged) layer holds: its key, its value and its bias."""
    row = lambda x: x.nbytes // int(np.prod(x.shape[:-1])) if isinstance(x, quant.Quantized) else \
        x.shape[-1] * x.dtype.itemsize
    return row(layer.k) + row(layer.v) + (0 if layer.bias is None else 4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMark:
    """The filled lengths of a cache at one moment, to drop everything appended after it; for a quantized layer
    also its window as it was (a flush since then moved those tokens into the store, quantized)."""

    lengths: tuple[jax.Array, ...]  # per layer [B, K]
    next_position: jax.Array  # [B]
    windows: tuple[QuantizedLayerCache | None, ...] | None = None  # per layer: the store's lengths and the window


def mark(cache: KVCache) -> CacheMark:
    windows = tuple(QuantizedLayerCache(store=LayerCache(k=None, v=None, lengths=jnp.array(layer.store.lengths)),
                                        window=jax.tree.map(jnp.array, layer.window))
                    if isinstance(layer, QuantizedLayerCache) else None for layer in cache.layers)
    return CacheMark(tuple(jnp.array(layer.lengths) for layer in cache.layers), jnp.array(cache.next_position),
                     windows if any(w is not None for w in windows) else None)


def rewind(cache: KVCache, to: CacheMark) -> KVCache:
    """The cache as it was at `to` (or `to` moved on by tokens written since, answering.py): pairs appended after it
    are dropped (their slots get overwritten later).

    Valid while the cache has only grown since the mark (left-aligned slots before it are untouched). A quantized
    layer gets its window back exactly when the mark lies in it; a point past the mark's window that a flush has
    since moved into the store stays there, quantized (as if the cache had been filled to it)."""
    windows = to.windows or (None,) * len(cache.layers)
    layers = tuple(_rewound(layer, jnp.array(lengths), then)  # copies: the mark outlives donation
                   for layer, lengths, then in zip(cache.layers, to.lengths, windows))
    return KVCache(layers=layers, next_position=jnp.array(to.next_position))


def _rewound(layer, lengths: jax.Array, then: QuantizedLayerCache | None):
    if not isinstance(layer, QuantizedLayerCache):
        return dataclasses.replace(layer, lengths=lengths)
    if then is None:
        raise ValueError("a mark taken before the cache was quantized cannot rewind it")
    stored_then, stored_now = then.store.lengths, layer.store.lengths  # [B, K]
    in_old_window = (stored_now > stored_then) & (lengths <= then.lengths)  # flushed since; back in the old window
    stored = jnp.where(in_old_window, stored_then, jnp.clip(lengths, stored_then, stored_now))
    pick = lambda old, new: jnp.where(in_old_window[..., None, None], old, new)
    window = LayerCache(k=pick(then.window.k, layer.window.k), v=pick(then.window.v, layer.window.v),
                        lengths=lengths - stored)
    return QuantizedLayerCache(store=dataclasses.replace(layer.store, lengths=stored), window=window,
                               key_center=layer.key_center)


def mask_context(cache: KVCache, keep: jax.Array, prefix_len: jax.Array, context_len: jax.Array) -> KVCache:
    """A masked compressed cache: context slots [prefix_len, prefix_len + context_len) follow keep [L, B, K, n]
    (n >= context_len); every other slot (the prefix, anything appended later) stays visible. Nothing is moved;
    memory is unchanged."""
    L, B, K, n = keep.shape
    _dense_only(cache, "mask_context")
    layers = []
    for layer, layer_keep in zip(cache.layers, keep):
        slots = jnp.arange(layer.capacity, dtype=jnp.int32)  # [C]
        offset = slots[None, :] - prefix_len[:, None]  # [B, C] context offset of each slot
        in_context = (offset >= 0) & (offset < context_len[:, None])
        gathered = jnp.take_along_axis(layer_keep, jnp.clip(offset, 0, n - 1)[:, None, :], axis=-1)  # [B, K, C]
        layers.append(dataclasses.replace(layer, keep=jnp.where(in_context[:, None, :], gathered, True)))
    return dataclasses.replace(cache, layers=tuple(layers))


STORE_STEPS = 8  # store sizes per octave (power of two): a bucket wastes at most 1/8 of the slots


def store_bucket(slots: int, minimum: int = 64) -> int:
    """The ragged store size for `slots` needed slots: the smallest m 2^e >= slots with m in [STORE_STEPS,
    2 STORE_STEPS) and a multiple of RAGGED_BLOCK, at least `minimum`. Nearby sizes share a bucket, so a new context
    or ratio usually reuses the compiled decode step; past 128 slots the slack is at most 1/STORE_STEPS."""
    slots = max(slots, minimum)
    step = max(1 << max(slots.bit_length() - STORE_STEPS.bit_length(), 0), RAGGED_BLOCK)  # slots / step in [8, 16)
    return -(-slots // step) * step


def pack(cache: KVCache, room: int, multiple: int = 64) -> KVCache:
    """A ragged compressed cache from a masked one: each (layer, KV head) keeps only its visible filled slots, in
    their original order, in a segment of the layer's flat store with `room` free slots for tokens appended later
    (question, answer). Keys keep their original RoPE positions; next_position is unchanged.

    Runs on the host: the kept counts set the shapes. Each layer's store size is a bucket (store_bucket, at least
    `multiple` slots), so the device bytes are about ratio x the filled full cache plus the room (1/8 more at most,
    past 128 slots), and nearby contexts and ratios share compiled steps.
    """
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    _dense_only(cache, "pack")
    kept = np.asarray(kept_per_head(cache))  # [L, B, K]
    layers = []
    for layer, kept_l in zip(cache.layers, kept):
        block = RAGGED_BLOCK
        segments = -(-(kept_l + room) // block) * block  # [B, K] slots per head, whole blocks
        offsets = np.cumsum(segments, axis=1) - segments  # [B, K]
        size = store_bucket(int(segments.sum(axis=1).max()), multiple)
        # Placed as the layer is (committed to its sharding, or not), so the packed cache and the caches a jitted
        # step returns from it look alike to jit: one compile.
        offsets = jax.device_put(offsets.astype(np.int32), layer.k.sharding if layer.k.committed else None)
        layers.append(_pack_layer(layer, offsets, size, block))
    return KVCache(layers=tuple(layers), next_position=jnp.array(cache.next_position))  # a copy: donation-safe


def _pack_layer(layer, offsets: jax.Array, size: int, block: int) -> RaggedLayerCache:
    visible = visible_slots(layer)  # [B, K, C]
    B = visible.shape[0]
    rank = jnp.cumsum(visible, axis=-1, dtype=jnp.int32) - 1  # [B, K, C] place of each kept slot in its segment
    slots = jnp.where(visible, offsets[..., None] + rank, size)  # evicted and empty slots aim past the end
    batch = jnp.arange(B)[:, None, None]
    store = lambda x: jnp.zeros((B, size, x.shape[-1]), x.dtype).at[batch, slots].set(x, mode="drop")
    bias = None if layer.bias is None else jnp.zeros((B, size), jnp.float32).at[batch, slots].set(
        layer.bias, mode="drop")  # [B, S]
    return RaggedLayerCache(k=store(layer.k), v=store(layer.v), lengths=visible.sum(-1, dtype=jnp.int32),
                            offsets=offsets, bias=bias, block=block)


def _dense_only(cache: KVCache, what: str) -> None:
    if any(isinstance(layer, QuantizedLayerCache) for layer in cache.layers):
        raise TypeError(f"{what} takes an unquantized cache: quantize after compressing (cache.quantized)")


def defragment(cache: KVCache) -> KVCache:
    """A dense cache from a masked (or compacted) one of the same capacity: each head's visible filled slots move
    to the front, in their order, with their bias; the evicted slots become free room for new tokens. Keys keep their
    original RoPE and next_position is unchanged, so attention is the same. Jittable (shapes do not change)."""
    return dataclasses.replace(cache, layers=tuple(_defragment_layer(layer) for layer in cache.layers),
                               next_position=jnp.array(cache.next_position))


def _defragment_layer(layer):
    if not isinstance(layer, LayerCache):
        raise TypeError("defragment takes dense (masked) layers; a ragged layer stores only its kept pairs already")
    if layer.keep is None:
        return layer
    visible = visible_slots(layer)  # [B, K, C]
    # A stable order that puts the visible slots first: slot index, offset by C for the others.
    order = jnp.argsort(jnp.where(visible, 0, layer.capacity) + jnp.arange(layer.capacity), axis=-1)  # [B, K, C]
    gather = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
    return LayerCache(k=gather(layer.k), v=gather(layer.v), lengths=visible.sum(-1, dtype=jnp.int32),
                      bias=None if layer.bias is None else gather(layer.bias))


def grown(cache: KVCache, extra: int) -> KVCache:
    """A copy of a dense cache with `extra` more slots per head (room for a pass on top of a full cache)."""
    if extra < 0:
        raise ValueError(f"extra must be >= 0, got {extra}")

    def grow(layer):
        if not isinstance(layer, LayerCache):
            raise TypeError("grown takes a dense cache, not a ragged one")
        pad = lambda x, value=0: None if x is None else jnp.pad(
            x, [(0, 0), (0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 3), constant_values=value)
        return LayerCache(k=pad(layer.k), v=pad(layer.v), lengths=jnp.copy(layer.lengths), keep=pad(layer.keep, True),
                          bias=pad(layer.bias))

    return KVCache(layers=tuple(grow(layer) for layer in cache.layers), next_position=jnp.copy(cache.next_position))


def tiled_rows(cache: KVCache, copies: int) -> KVCache:
    """`copies` copies of a cache's batch (or a layer's) stacked along it: row c B + b is row b. New arrays, even
    for one copy (the result may be donated)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return jax.tree.map(lambda x: jnp.concatenate([x] * copies, axis=0) if copies > 1 else jnp.copy(x), cache)


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
