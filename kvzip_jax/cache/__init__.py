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

Modules: layouts (the pytrees, their room and visible slots), writes (appending tokens to every form), dense
(creating, masking, defragmenting, growing, tiling), ragged (packing), quantize, marks (mark / rewind), sizes (bytes).

Einsum legend: B batch, K KV heads, C cache capacity (slots), S ragged store slots, H head dim, T new tokens.
"""

from kvzip_jax.cache.dense import defragment, grown, init_cache, mask_context, tiled_rows
from kvzip_jax.cache.layouts import (
    RAGGED_BLOCK,
    WINDOW,
    KVCache,
    LayerCache,
    QuantizedLayerCache,
    RaggedLayerCache,
    _room,
    kept_per_head,
    visible_slots,
)
from kvzip_jax.cache.marks import CacheMark, mark, rewind
from kvzip_jax.cache.quantize import _key_center, _per_slot, quantized
from kvzip_jax.cache.ragged import STORE_STEPS, pack, store_bucket
from kvzip_jax.cache.sizes import nbytes, pair_bytes, row_bytes, used_bytes
from kvzip_jax.cache.writes import write, written

__all__ = [
    "RAGGED_BLOCK",
    "STORE_STEPS",
    "WINDOW",
    "CacheMark",
    "KVCache",
    "LayerCache",
    "QuantizedLayerCache",
    "RaggedLayerCache",
    "_key_center",
    "_per_slot",
    "_room",
    "defragment",
    "grown",
    "init_cache",
    "kept_per_head",
    "mark",
    "mask_context",
    "nbytes",
    "pack",
    "pair_bytes",
    "quantized",
    "rewind",
    "row_bytes",
    "store_bucket",
    "tiled_rows",
    "used_bytes",
    "visible_slots",
    "write",
    "written",
]
