"""A compressed KV cache in a serving engine's paged layout, and attention over those pages.

Modules: pages (PagedExport, export_tpu for tpu-inference / vLLM on TPU, export_gpu for vLLM's FlashAttention blocks,
merge_kv, read_pages, write_pages), paged_attention (the plain-jnp oracle over either layout), tpu_inference_kernel
(the engine's own reference kernel, loaded by file from the tpu-inference wheel), decode (greedy decoding with the
cache kept in the pages, attention by the engine's kernel), export_io (an export saved with a manifest, and loaded).

Einsum legend: B batch, T new tokens, N query heads, K KV heads, H head dim.
"""

from kvzip_jax.serving import decode, export_io, tpu_inference_kernel
from kvzip_jax.serving.paged_attention import paged_decode_attention
from kvzip_jax.serving.pages import (
    LAYOUTS,
    NonUniformCacheError,
    PagedExport,
    UnsupportedCacheError,
    dtype_packing,
    export_gpu,
    export_tpu,
    merge_kv,
    read_pages,
    tpu_page_shape,
    write_pages,
)
from kvzip_jax.serving.tpu_inference_kernel import EngineKernelMissingError

__all__ = [
    "LAYOUTS",
    "EngineKernelMissingError",
    "NonUniformCacheError",
    "PagedExport",
    "UnsupportedCacheError",
    "decode",
    "dtype_packing",
    "export_gpu",
    "export_io",
    "export_tpu",
    "merge_kv",
    "paged_decode_attention",
    "read_pages",
    "tpu_inference_kernel",
    "tpu_page_shape",
    "write_pages",
]
