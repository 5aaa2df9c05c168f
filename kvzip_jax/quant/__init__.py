"""KV quantization: kept pairs stored as int8 or packed int4 codes with per-group scales and zero points.

Modules: groups (the format, a cache's key and value formats, quantize / dequantize, int4 nibble packing, bytes
counted from shapes), folded (query . key logits and probability-weighted values over quantized rows with the scales
folded in, no dequantized copy).
"""

from kvzip_jax.quant.folded import folded_logits, folded_values
from kvzip_jax.quant.groups import (
    BITS,
    KV_BITS,
    QuantFormat,
    Quantized,
    dequantize,
    error_bound,
    kv_formats,
    pack_int4,
    quantize,
    unpack_int4,
)

__all__ = [
    "BITS",
    "KV_BITS",
    "QuantFormat",
    "Quantized",
    "dequantize",
    "error_bound",
    "folded_logits",
    "folded_values",
    "kv_formats",
    "pack_int4",
    "quantize",
    "unpack_int4",
]
