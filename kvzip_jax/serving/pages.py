"""A compressed KV cache in a serving engine's paged layout: tpu-inference's page buffer (vLLM on TPU) or vLLM's
FlashAttention blocks (GPU), with the page table, the kept lengths and the logical next positions; read_pages and
write_pages read a layer's slots and write new tokens into them through the page table.

A paged engine keeps one length and one row of page indices per sequence, shared by every layer and KV head, so a
cache exports only when every (layer, KV head) of a row keeps the same number of pairs (KVzip's `pair-uniform`
level). The kept pairs fill a sequence's slots in their cache order, keys with their stored RoPE; the tokens that
come next take their RoPE positions from `positions` (the cache's next_position), not from kv_lens.

Page buffers per layer (P pages, ps slots per page, p = 32 // bits of the dtype, Ha = H rounded up to 128):
  tpu            [P, ps, align(2K, p) // p, p, Ha]   keys and values interleaved on the head axis: k0 v0 k1 v1 ...
  tpu, hd64      [P, ps, align(K, p) // p, p, 2H]    (H = 64, the engine's hd64 kernel) head i's row is [k_i | v_i]
  gpu            [2, P, ps, K, H]                    keys, then values
Sequence b owns pages [b pps, (b + 1) pps) (pps pages per sequence); slots past kv_lens are zero.

Einsum legend: B batch, K KV heads, C cache capacity (slots), S slots per sequence (pps ps), H head dim, T tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.cache.layouts import KVCache, LayerCache, QuantizedLayerCache, kept_per_head, visible_slots
from kvzip_jax.errors import KvzipError

LAYOUTS = ("tpu", "gpu")
LANES = 128  # tpu-inference rounds the head dim up to a multiple of this (the hd64 layout holds [k | v] in one)


class NonUniformCacheError(KvzipError, ValueError):
    """A row whose (layer, KV head) kept counts differ: a paged engine has one length per sequence."""


class UnsupportedCacheError(KvzipError, ValueError):
    """A cache form a paged engine's pages cannot hold (quantized, with a per-key bias, or latent)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedExport:
    """A cache in an engine's pages: one page buffer per layer (layouts above) and the tables every layer shares."""

    pages: tuple[jax.Array, ...]  # per layer: tpu [P, ps, rows, p, width]; gpu [2, P, ps, K, H]
    page_indices: jax.Array  # [B, pps] int32, the pages of each sequence in order
    kv_lens: jax.Array  # [B] int32, kept pairs of each sequence (its physical length)
    positions: jax.Array  # [B] int32, the logical position of each sequence's next token (RoPE continues here)
    page_size: int = dataclasses.field(metadata=dict(static=True))
    layout: str = dataclasses.field(metadata=dict(static=True))  # "tpu" | "gpu"
    num_kv_heads: int = dataclasses.field(metadata=dict(static=True))
    head_dim: int = dataclasses.field(metadata=dict(static=True))
    hd64: bool = dataclasses.field(default=False, metadata=dict(static=True))  # tpu: the hd64 kernel's layout

    @property
    def pages_per_seq(self) -> int:
        return self.page_indices.shape[1]

    @property
    def flat_page_indices(self) -> jax.Array:
        """[B pps] int32: the page table as the tpu kernel takes it."""
        return self.page_indices.reshape(-1)


def dtype_packing(dtype) -> int:
    """Values of `dtype` per 32-bit word: tpu-inference's kv_packing (1 float32, 2 bfloat16, 4 float8)."""
    return 32 // (jnp.dtype(dtype).itemsize * 8)


def _align(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def tpu_page_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, hd64: bool = False):
    """The shape of one layer's tpu page buffer (tpu-inference's get_kv_cache_shape, or its hd64 variant's)."""
    p = dtype_packing(dtype)
    if hd64:
        return (num_pages, page_size, _align(num_kv_heads, p) // p, p, 2 * head_dim)
    return (num_pages, page_size, _align(2 * num_kv_heads, p) // p, p, _align(head_dim, LANES))


def merge_kv(k: jax.Array, v: jax.Array, hd64: bool = False) -> jax.Array:
    """tpu-inference's page rows of tokens' keys and values k, v [T, K, H] (in their dtype):
    [T, align(2K, p) // p, p, Ha] with k_i, v_i on head rows 2i, 2i + 1, zero-padded; hd64: [T, align(K, p) // p, p,
    2H] with head row i = [k_i | v_i]."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"keys and values must match in shape and dtype, got {k.shape} {k.dtype}, {v.shape} {v.dtype}")
    T, K, H = k.shape
    p = dtype_packing(k.dtype)
    if hd64:
        rows = _align(K, p)
        kv = jnp.pad(jnp.concatenate([k, v], axis=-1), ((0, 0), (0, rows - K), (0, 0)))  # [T, rows, 2H]
        return kv.reshape(T, rows // p, p, 2 * H)
    rows, width = _align(2 * K, p), _align(H, LANES)
    kv = jnp.concatenate([k, v], axis=-1).reshape(T, 2 * K, H)  # [T, 2K, H]: k0 v0 k1 v1 ...
    kv = jnp.pad(kv, ((0, 0), (0, rows - 2 * K), (0, width - H)))
    return kv.reshape(T, rows // p, p, width)


def export_tpu(cache: KVCache, page_size: int, dtype=None, *, room: int = 0, hd64: bool | None = None) -> PagedExport:
    """tpu-inference's pages of a compressed cache whose rows keep the same count in every (layer, KV head).

    dtype: the pages' dtype (None: the cache's); room: free slots per sequence past its kept pairs, for the tokens
    the engine writes next (a step of T tokens needs kv_lens + T slots in the sequence's pages); hd64: the hd64
    kernel's layout (None: when the head dim is 64, as the engine chooses). Runs on the host: the counts set shapes.
    """
    kept, pages_per_seq, K, H = _plan(cache, page_size, room)
    hd64 = H == 64 if hd64 is None else hd64
    if hd64 and H != 64:
        raise ValueError(f"the hd64 layout takes a head dim of 64, got {H}")
    dtype = jnp.dtype(cache.layers[0].k.dtype if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UnsupportedCacheError(f"tpu-inference's pages hold floating-point keys and values, got {dtype}")
    if page_size % dtype_packing(dtype):
        raise ValueError(f"page_size must be a multiple of {dtype_packing(dtype)} for {dtype}, got {page_size}")
    B, slots = cache.batch_size, pages_per_seq * page_size
    pages = []
    for layer in cache.layers:
        k, v = _kept_pairs(layer, slots)  # [B, S, K, H]
        rows = merge_kv(k.reshape(B * slots, K, H).astype(dtype), v.reshape(B * slots, K, H).astype(dtype), hd64)
        pages.append(rows.reshape((B * pages_per_seq, page_size) + rows.shape[1:]))  # [P, ps, rows, p, width]
    return _export(cache, pages, kept, pages_per_seq, page_size, "tpu", K, H, hd64)


def export_gpu(cache: KVCache, block_size: int, dtype=None, *, room: int = 0) -> PagedExport:
    """vLLM FlashAttention's blocks [2, P, block_size, K, H] of a compressed cache whose rows keep the same count in
    every (layer, KV head); page_indices is the block table. dtype, room: as in export_tpu."""
    kept, pages_per_seq, K, H = _plan(cache, block_size, room)
    B, slots = cache.batch_size, pages_per_seq * block_size
    pages = []
    for layer in cache.layers:
        kv = jnp.stack(_kept_pairs(layer, slots))  # [2, B, S, K, H]
        kv = kv if dtype is None else kv.astype(dtype)
        pages.append(kv.reshape(2, B * pages_per_seq, block_size, K, H))
    return _export(cache, pages, kept, pages_per_seq, block_size, "gpu", K, H, False)


def read_pages(export: PagedExport, layer: int) -> tuple[jax.Array, jax.Array]:
    """Keys and values [B, S, K, H] of one layer's pages, each sequence's slots in order through its page table
    (slots past kv_lens hold whatever its pages hold)."""
    pages, table = export.pages[layer], export.page_indices  # table [B, pps]
    B, pps = table.shape
    S, K, H = pps * export.page_size, export.num_kv_heads, export.head_dim
    if export.layout == "gpu":
        kv = pages[:, table].reshape(2, B, S, K, H)  # [2, B, pps, ps, K, H] -> [2, B, S, K, H]
        return kv[0], kv[1]
    rows = pages[table]  # [B, pps, ps, rows, p, width]
    rows = rows.reshape(B, S, -1, rows.shape[-1])  # [B, S, rows p, width]
    if export.hd64:
        rows = rows[:, :, :K]  # [B, S, K, 2H]
        return rows[..., :H], rows[..., H : 2 * H]
    kv = rows[:, :, : 2 * K, :H].reshape(B, S, K, 2, H)
    return kv[:, :, :, 0], kv[:, :, :, 1]


def write_pages(export: PagedExport, layer: int, k_new: jax.Array, v_new: jax.Array) -> jax.Array:
    """Layer `layer`'s page buffer with T new tokens' keys and values k_new, v_new [B, T, K, H] written at slots
    kv_lens + t of each sequence (through its page table; the slots must exist: export with room), as the engine
    writes them (tpu: merge_kv's rows)."""
    pages, table = export.pages[layer], export.page_indices  # table [B, pps]
    B, T, K, H = k_new.shape
    slots = export.kv_lens[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    page = jnp.take_along_axis(table, slots // export.page_size, axis=1)  # [B, T]
    at = slots % export.page_size
    if export.layout == "gpu":
        return pages.at[:, page, at].set(jnp.stack([k_new, v_new]).astype(pages.dtype))  # [2, B, T, K, H]
    k, v = (x.reshape(B * T, K, H).astype(pages.dtype) for x in (k_new, v_new))
    rows = merge_kv(k, v, export.hd64)  # [B T, rows, p, width]
    return pages.at[page, at].set(rows.reshape((B, T) + rows.shape[1:]))


def _plan(cache: KVCache, page_size: int, room: int) -> tuple[np.ndarray, int, int, int]:
    """(kept pairs [B], pages per sequence, K, H) of an exportable cache, or a named error."""
    if page_size < 1 or room < 0:
        raise ValueError(f"page_size must be >= 1 and room >= 0, got {page_size} and {room}")
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, QuantizedLayerCache):
            raise UnsupportedCacheError(
                f"layer {i} is quantized: the engine's pages hold float keys and values; export before quantizing"
            )
        if layer.bias is not None:
            raise UnsupportedCacheError(
                f"layer {i} carries a per-key bias (Attention Matching): the engine's attention kernel takes no bias "
                "argument, so a compacted cache does not fit its pages"
            )
        if layer.k.shape[-1] != layer.v.shape[-1]:
            raise UnsupportedCacheError(
                f"layer {i} has keys of width {layer.k.shape[-1]} and values of {layer.v.shape[-1]} (a latent MLA "
                "cache): the engine's pages hold one head dim"
            )
    counts = np.asarray(kept_per_head(cache))  # [L, B, K]
    uneven = {
        b: sorted({int(c) for c in counts[:, b].ravel()})
        for b in range(counts.shape[1])
        if counts[:, b].min() != counts[:, b].max()
    }
    if uneven:
        found = "; ".join(f"row {b}: {_listed(c)}" for b, c in uneven.items())
        raise NonUniformCacheError(
            "a paged engine keeps one length per sequence, shared by every layer and KV head, but the cache's "
            f"(layer, KV head)s keep different counts of pairs ({found}). Compress with KVzip's pair-uniform level "
            "(--level pair-uniform; kvzip.KVzipConfig(level='pair-uniform')), which keeps the same count in each; "
            "nothing is padded here"
        )
    kept = counts[0, :, 0]  # [B]
    pages_per_seq = max(-(-(int(kept.max()) + room) // page_size), 1)
    layer = cache.layers[0]
    K = layer.lengths.shape[1]
    return kept, pages_per_seq, K, layer.k.shape[-1]


def _listed(counts: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, counts[:most]))
    return f"counts {shown}" + (f" and {len(counts) - most} more" if len(counts) > most else "")


def _kept_pairs(layer, slots: int) -> tuple[jax.Array, jax.Array]:
    """Each row's kept keys and values [B, S, K, H] in cache order, zero past the kept count (S = slots)."""
    if isinstance(layer, LayerCache):
        visible = visible_slots(layer)  # [B, K, C]
        B, K, _ = visible.shape
        rank = jnp.cumsum(visible, axis=-1, dtype=jnp.int32) - 1  # [B, K, C] place of each kept slot
        dest = jnp.where(visible, rank, slots)  # evicted and empty slots aim past the end
        batch, head = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
        put = lambda x: jnp.zeros((B, K, slots, x.shape[-1]), x.dtype).at[batch, head, dest].set(x, mode="drop")
        return put(layer.k).transpose(0, 2, 1, 3), put(layer.v).transpose(0, 2, 1, 3)
    i = jnp.arange(slots, dtype=jnp.int32)
    index = layer.offsets[..., None] + i  # [B, K, S] store slot of each head's slot i
    valid = i < layer.lengths[..., None]  # [B, K, S]
    index = jnp.clip(index, 0, layer.k.shape[1] - 1)
    take = lambda x: jnp.where(valid[..., None], jax.vmap(lambda store, at: store[at])(x, index), 0)  # [B, K, S, H]
    return take(layer.k).transpose(0, 2, 1, 3), take(layer.v).transpose(0, 2, 1, 3)


def _export(cache, pages, kept, pages_per_seq, page_size, layout, K, H, hd64) -> PagedExport:
    B = cache.batch_size
    return PagedExport(
        pages=tuple(pages),
        page_indices=jnp.arange(B * pages_per_seq, dtype=jnp.int32).reshape(B, pages_per_seq),
        kv_lens=jnp.asarray(kept, jnp.int32),
        positions=jnp.array(cache.next_position, jnp.int32),
        page_size=page_size,
        layout=layout,
        num_kv_heads=K,
        head_dim=H,
        hd64=hd64,
    )
