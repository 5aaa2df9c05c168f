"""Grouped-query attention of new tokens over [the cache as it was | the new tokens themselves].

Two orders give the same result. Observed passes (the KVzip reread, baselines) read the cache before this step's
write and pass the new keys separately, so a caller that drops the returned cache never pays for the write.
Plain passes (prefill, decode) write first and attend over the written cache with k_new = None: XLA then updates
a donated cache in place, where reading the old cache and writing a new one copies every layer's K and V at
every step. Three forms:
  dense_attention    materialises scores over all keys; for observers that read them
  blocked_attention  online softmax over key blocks of a dense cache [B, K, C, H]
  ragged_attention   online softmax over a flat per-layer store [B, S, H] of per-head segments (ragged caches;
                     ragged_attention.py)

Einsum legend: B batch, T query positions, S key slots, K KV heads, G query heads per KV head, M = G T query rows
per KV head, H head dim, D model width, N blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.models import layers
from kvzip_jax.quant import groups as quant

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite, so an all-masked row never gives inf - inf
BLOCK_ELEMENTS = 1 << 21  # most elements of one block's [query rows x keys] weights in blocked_attention


def attention_mask(
    query_slots: jax.Array, key_slots: jax.Array, key_visible: jax.Array, window: int | None
) -> jax.Array:
    """[B, K, T, S] bool: a key is visible to a query iff key_visible [B, K, S], its slot <= the query's slot,
    and (with a window) the query's slot - its slot < window. query_slots [B, K, T], key_slots [B, K, S]."""
    q = query_slots[..., None]  # [B, K, T, 1]
    k = key_slots[:, :, None, :]  # [B, K, 1, S]
    visible = (k <= q) & key_visible[:, :, None, :]
    if window is not None:
        visible &= (q - k) < window
    return visible


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float, key_bias=None):
    """Softmax attention of q [B, T, K, G, H] over k, v [B, K, S, H] with mask [B, K, T, S] (and a logit added per
    key, key_bias [B, K, S], or None).

    Returns (out [B, T, K, G, H], logits, probs [B, K, G, T, S] float32); masked logits are MASK_VALUE.
    """
    logits = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    if key_bias is not None:
        logits = logits + key_bias[:, :, None, None, :]
    logits = jnp.where(mask[:, :, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)  # [B, K, G, T, S]
    out = jnp.einsum("BKGTS,BKSH->BTKGH", probs.astype(v.dtype), v)
    return out, logits, probs


def dense_keys(k, v, k_new, v_new, filled, query_slots, window, key_keep=None):
    """The key set [cache slots | new tokens] as (k, v [B, K, C + T, H], key_slots, mask) for dense_attention.
    filled [B, K]: cache slots in use before this step."""
    S = k.shape[2]
    T = k_new.shape[2]
    cache_slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), filled.shape + (S,))  # [B, K, S]
    cache_visible = cache_slots < filled[..., None]
    if key_keep is not None:
        cache_visible &= key_keep[:, :, :S]
    key_slots = jnp.concatenate([cache_slots, filled[..., None] + jnp.arange(T, dtype=jnp.int32)], axis=2)
    key_visible = jnp.concatenate([cache_visible, jnp.ones(filled.shape + (T,), bool)], axis=2)  # [B, K, S + T]
    mask = attention_mask(query_slots, key_slots, key_visible, window)
    keys = jnp.concatenate([k, k_new.astype(k.dtype)], axis=2)
    values = jnp.concatenate([v, v_new.astype(v.dtype)], axis=2)
    return keys, values, key_slots, mask


def query_rows(q: jax.Array, scale: float) -> jax.Array:
    """q [B, T, K, G, H] -> scaled float32 query rows [B, K, M = G T, H]."""
    B, T, K, G, H = q.shape
    return (q.astype(jnp.float32) * scale).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)


def _unrows(out: jax.Array, q: jax.Array) -> jax.Array:
    """[B, K, M, Hv] -> [B, T, K, G, Hv] in q's dtype (Hv: the values' width)."""
    B, T, K, G, _ = q.shape
    return out.reshape(B, K, G, T, out.shape[-1]).transpose(0, 3, 1, 2, 4).astype(q.dtype)


def _empty_state(qm: jax.Array, value_width: int | None = None):
    """Online-softmax state of query rows qm [B, K, M, H]: running max [B, K, M], normaliser [B, K, M], weighted
    values [B, K, M, H], and the normaliser over a subset of the keys [B, K, M]; made from qm (layers.zeros_from),
    so each layer's accumulator exists only with its queries (as constants, every layer's would be live at once)."""
    acc = layers.zeros_from(qm)  # [B, K, M, H]
    rows = acc[..., 0]  # [B, K, M]
    if value_width is not None and value_width != acc.shape[-1]:  # values of another width (MLA's latents)
        acc = rows[..., None] + jnp.zeros((value_width,), acc.dtype)  # [B, K, M, Hv]
    return rows + MASK_VALUE, rows, acc, rows


def _visit(state, qm, kb, vb, visible, in_subset=None, bias=None):
    """One online-softmax step over key block kb, vb [B, K, S, H] with visible [B, K, T, S]; in_subset [B, K, S]
    marks the keys of the subset normaliser (None: all); bias [B, K, S] is added to the logits (None: none)."""
    m, l, acc, l_subset = state
    B, K, M, _ = qm.shape
    T, S = visible.shape[2], kb.shape[2]
    s = jnp.einsum("BKMH,BKSH->BKMS", qm, kb, preferred_element_type=jnp.float32)
    if bias is not None:
        s = s + bias[:, :, None, :]
    s = jnp.where(visible[:, :, None], s.reshape(B, K, M // T, T, S), MASK_VALUE).reshape(B, K, M, S)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])  # [B, K, M, S]
    correction = jnp.exp(m - m_new)
    p_sum = p.sum(axis=-1)
    l = l * correction + p_sum
    acc = acc * correction[..., None] + jnp.einsum("BKMS,BKSH->BKMH", p, vb.astype(jnp.float32))
    subset_sum = p_sum if in_subset is None else jnp.einsum("BKMS,BKS->BKM", p, in_subset.astype(jnp.float32))
    return m_new, l, acc, l_subset * correction + subset_sum


def visit_new_keys(state, qm, k_new, v_new, filled, query_slots, window):
    """Online-softmax steps over the T new keys, causal among themselves: the queries go in tiles of `width` and
    each tile visits only the key blocks of `width` at or before it (the blocks after it are masked anyway), so
    the causal half costs half of the whole square."""
    B, K, M, H = qm.shape
    T = k_new.shape[2]
    G = M // T
    width = tile_width(B * K * G, T)
    n = -(-T // width)
    key_slots = filled[..., None] + jnp.arange(n * width, dtype=jnp.int32)  # [B, K, n width]
    if n == 1:
        return _visit(
            state, qm, k_new, v_new, attention_mask(query_slots, key_slots, jnp.ones_like(key_slots, bool), window)
        )
    pad = n * width - T  # padding keys sit after every real query; padding queries are dropped at the end
    grow = lambda x, axis: jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])
    k_new, v_new = grow(k_new, 2), grow(v_new, 2)
    query_slots = jnp.concatenate([query_slots, key_slots[:, :, T:]], axis=2)
    by_token = lambda x: grow(x.reshape((B, K, G, T) + x.shape[3:]), 3)  # [B, K, M, ...] -> [B, K, G, n w, ...]
    m, l, acc, l_subset = (by_token(x) for x in state)
    q_tok = by_token(qm)
    everything = jnp.ones((B, K, width), bool)

    def tile(i, tiles):
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, i * width, width, axis=3)
        rows = lambda x: x.reshape((B, K, G * width) + x.shape[4:])
        q_i = rows(cut(q_tok))
        slots_i = jax.lax.dynamic_slice_in_dim(query_slots, i * width, width, axis=2)  # [B, K, width]

        def visit(j, st):
            kb = jax.lax.dynamic_slice_in_dim(k_new, j * width, width, axis=2)  # [B, K, width, H]
            vb = jax.lax.dynamic_slice_in_dim(v_new, j * width, width, axis=2)
            slots_j = jax.lax.dynamic_slice_in_dim(key_slots, j * width, width, axis=2)
            return _visit(st, q_i, kb, vb, attention_mask(slots_i, slots_j, everything, window))

        st = jax.lax.fori_loop(0, i + 1, visit, tuple(rows(cut(x)) for x in tiles))
        back = lambda x, part: jax.lax.dynamic_update_slice_in_dim(x, part.reshape(cut(x).shape), i * width, axis=3)
        return tuple(back(x, part) for x, part in zip(tiles, st))

    tiles = jax.lax.fori_loop(0, n, tile, (m, l, acc, l_subset))
    return tuple(x[:, :, :, :T].reshape((B, K, M) + x.shape[4:]) for x in tiles)


def tile_width(rows_per_token: int, T: int, largest: int = 256, smallest: int = 64) -> int:
    """Side of the square tiles of causal attention among T new tokens: the power of two in [smallest, largest]
    (at most T) whose [rows_per_token x side] query rows x [side] keys weights fit BLOCK_ELEMENTS."""
    return min(_power_of_two_at_most(math.isqrt(BLOCK_ELEMENTS // max(rows_per_token, 1)), smallest, largest), T)


def _power_of_two_at_most(n: int, smallest: int, largest: int) -> int:
    """The largest power of two <= n, clipped to [smallest, largest]."""
    return min(max(1 << (max(n, 1).bit_length() - 1), smallest), largest)


def finished(state, q):
    """(out [B, T, K, G, H], lse, subset_lse [B, K, G, T]): the log-sum-exp of each query row's visible logits,
    over all keys and over the subset."""
    m, l, acc, l_subset = state
    B, T, K, G, H = q.shape
    # A row that saw no key keeps m = MASK_VALUE, and its masked logits summed exp(0) = 1 each: it gives out 0 and
    # lse MASK_VALUE (rows that saw a key washed those terms out with exp(MASK_VALUE - m) = 0).
    saw = m > MASK_VALUE / 2  # [B, K, M]
    out = _unrows(jnp.where(saw[..., None], acc / jnp.where(saw, l, 1.0)[..., None], 0.0), q)
    lse = lambda total: jnp.where(saw, m + jnp.log(jnp.where(saw, total, 1.0)), MASK_VALUE).reshape(B, K, G, T)
    return out, lse(l), lse(l_subset)


def key_block(rows: int, largest: int = 256, smallest: int = 64) -> int:
    """Keys per online-softmax block for `rows` = B K M query rows: the power of two in [smallest, largest] that
    keeps one block's [rows x keys] weights within BLOCK_ELEMENTS, so they stay in the CPU's cache between the ops
    that read them."""
    return _power_of_two_at_most(BLOCK_ELEMENTS // max(rows, 1), smallest, largest)


def blocked_attention(
    q,
    k,
    v,
    filled,
    k_new,
    v_new,
    query_slots,
    window: int | None,
    scale: float,
    key_keep=None,
    block: int | None = None,
    subset=None,
    key_bias=None,
    latent_keys: bool = False,
):
    """dense_attention's output without materialising scores over the cache.

    q [B, T, K, G, H]; k, v [B, K, C, H] the cache (arrays, or quant.Quantized rows: dequantized one block at a
    time); filled [B, K] its slots in use; k_new, v_new [B, K, T, H] this step's keys, or None when the cache already
    holds them (written first); query_slots [B, K, T]; key_keep [B, K, C] (masked caches) or None. Loops over cache
    blocks of `block` slots (None: key_block of the query rows) up to the most filled head only (a dynamic trip
    count: a short context in a large cache costs what its length costs), then over the new keys (if given) in
    causal tiles. Returns (out [B, T, K, G, H], lse, subset_lse [B, K, G, T]):
    the log of each query row's softmax normaliser, over all visible keys and over the visible keys of a subset
    (observers reuse them; a subset is free: it reuses the same logits). subset: a function of cache slots
    [B, K, S] -> bool [B, K, S] (the new keys always belong to it); None: all keys. key_bias [B, K, C]: a logit
    added per cache slot (a compacted cache's beta), or None. latent_keys: MLA's absorbed form, where a slot's key is
    [v | k] (its latent, then its RoPE key; q is as wide) and its value v (models/mla.py).
    """
    qm = query_rows(q, scale)
    state = _visit_cache(
        _empty_state(qm, v.shape[-1]),
        qm,
        k,
        v,
        filled,
        query_slots,
        window,
        block,
        key_keep,
        subset,
        key_bias,
        latent_keys=latent_keys,
    )
    if k_new is not None:
        state = visit_new_keys(state, qm, k_new, v_new, filled, query_slots, window)
    return finished(state, q)


def _visit_cache(
    state,
    qm,
    k,
    v,
    filled,
    query_slots,
    window: int | None,
    block: int | None,
    key_keep=None,
    subset=None,
    key_bias=None,
    first_slot=None,
    latent_keys: bool = False,
):
    """blocked_attention's online-softmax steps over the visible slots of a dense cache k, v [B, K, C, H] (arrays or
    Quantized), whose slot j is first_slot [B, K] + j (None: j); latent_keys: keys [v | k] (blocked_attention)."""
    B, K, M, H = qm.shape
    C = k.shape[2]
    block_c = math.gcd(C, block or key_block(B * K * M))
    base = jnp.zeros((B, K), jnp.int32) if first_slot is None else first_slot
    first = 0
    if window is not None and first_slot is None:
        first = jnp.maximum(jnp.min(query_slots) - window + 1, 0) // block_c

    def visit(j, state):
        kb = dequantized(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, j * block_c, block_c, axis=2), k))
        vb = dequantized(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, j * block_c, block_c, axis=2), v))
        if latent_keys:
            kb = jnp.concatenate([vb, kb.astype(vb.dtype)], axis=-1)  # [B, K, S, R + dr]
        local = jnp.broadcast_to(j * block_c + jnp.arange(block_c, dtype=jnp.int32), (B, K, block_c))
        visible = local < filled[..., None]
        if key_keep is not None:
            visible &= jax.lax.dynamic_slice_in_dim(key_keep, j * block_c, block_c, axis=2)
        slots = base[..., None] + local
        in_subset = None if subset is None else subset(slots)
        bias = None if key_bias is None else jax.lax.dynamic_slice_in_dim(key_bias, j * block_c, block_c, axis=2)
        return _visit(state, qm, kb, vb, attention_mask(query_slots, slots, visible, window), in_subset, bias)

    last = -(-jnp.max(filled) // block_c)
    return jax.lax.fori_loop(first, last, visit, state)


def dequantized(x):
    """x as float32 rows if it is quant.Quantized; else x."""
    return quant.dequantize(x) if isinstance(x, quant.Quantized) else x


def _resumed(q, out, lse, subset_lse, scale: float):
    """The online-softmax state (and the query rows) behind a finished (out, lse, subset_lse): running max lse,
    normaliser 1, weighted values out, subset normaliser exp(subset_lse - lse)."""
    B, T, K, G, _ = q.shape
    m = lse.reshape(B, K, G * T)  # [B, K, M]: rows ordered (g, t), as query_rows orders them
    acc = out.astype(jnp.float32).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, out.shape[-1])
    return query_rows(q, scale), (m, jnp.ones_like(m), acc, jnp.exp(subset_lse.reshape(B, K, G * T) - m))


def shifted(out, lse, subset_lse, shift):
    """blocked_attention's result with every logit it saw raised by shift [B, K, G, T] (one per query row; None: no
    change): out is unchanged, the log-sum-exps move by shift (rows that saw no key stay MASK_VALUE)."""
    if shift is None:
        return out, lse, subset_lse
    move = lambda x: jnp.where(x > MASK_VALUE / 2, x + shift, x)
    return out, move(lse), move(subset_lse)


def then_window(
    q,
    out,
    lse,
    subset_lse,
    k,
    v,
    first_slot,
    filled,
    query_slots,
    window: int | None,
    scale: float,
    latent_keys: bool = False,
):
    """blocked_attention over [a cache | a window of keys after it] from its result over the cache alone (out, lse,
    subset_lse as blocked_attention returns them): the window's k, v [B, K, R, H] hold filled [B, K] keys at slots
    first_slot [B, K] + j (a quantized layer's full-precision window, written first)."""
    qm, state = _resumed(q, out, lse, subset_lse, scale)
    return finished(
        _visit_cache(
            state, qm, k, v, filled, query_slots, window, None, first_slot=first_slot, latent_keys=latent_keys
        ),
        q,
    )


def then_new_keys(q, out, lse, subset_lse, k_new, v_new, filled, query_slots, window: int | None, scale: float):
    """blocked_attention over [cache | new keys] from its result over the cache alone (out [B, T, K, G, H], lse and
    subset_lse [B, K, G, T], as blocked_attention returns them with k_new None): the online-softmax state is rebuilt
    (running max lse, normaliser 1, weighted values out, subset normaliser exp(subset_lse - lse)) and the T new keys
    visited. Used where the cache's part was computed elsewhere (seq shards merged, seq_attention.py)."""
    qm, state = _resumed(q, out, lse, subset_lse, scale)
    return finished(visit_new_keys(state, qm, k_new, v_new, filled, query_slots, window), q)
