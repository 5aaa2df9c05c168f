"""KV quantization: kept pairs stored as int8 or packed int4 codes with per-group scales and zero points.

Modules: groups (the format, quantize / dequantize, int4 nibble packing, bytes counted from shapes).
"""

from kvzip_jax.quant.groups import BITS, QuantFormat, Quantized, dequantize, error_bound, pack_int4, quantize, unpack_int4

__all__ = ["BITS", "QuantFormat", "Quantized", "dequantize", "error_bound", "pack_int4", "quantize", "unpack_int4"]
