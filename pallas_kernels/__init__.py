"""Pallas kernels for kvzip-jax, each beside its jnp oracle.

- `ragged_decode`: decode attention over per-(batch row, KV head) segments of a flat key/value store (the ragged
  compressed cache), with an optional per-slot logit bias; returns (out, lse) so partial results merge.
- `decode_attention`: the dense per-head cache [B, K, C, H] (optionally with a keep mask) run as a ragged store
  through `ragged_decode`, so its cost follows the filled lengths, not the capacity.
- `QuantizedRows`: int8 or packed int4 keys / values with group scales and zero points, which both decode kernels
  accept in place of float arrays and dequantize block by block inside the kernel.
- `score_max`: KVzip's per-key score, max over reread query rows of q . k - lse, exponentiated once per key, without
  materialising the [rows x keys] matrix.

`impl="auto" | "xla" | "pallas"` picks the implementation (`resolve_impl`): the XLA path is the oracle itself. On CPU
the kernels run in Pallas interpret mode (the tests); on a CUDA GPU they lower through Triton; on a TPU all three
take their TPU variants (ragged_decode_tpu, score_max_tpu; QuantizedRows included), lowered through Mosaic. The TPU
variants are tested in Pallas TPU interpret mode and lowered for "tpu" on CPU, never run on a TPU; "auto" stays "xla"
there. This package never imports kvzip_jax.
"""

from .decode_attention import decode_attention, decode_attention_reference
from .dispatch import IMPLS, MASK_VALUE, KernelInputError, resolve_impl
from .quantized_rows import QuantizedRows
from .ragged_decode import ragged_decode, ragged_decode_reference
from .score_max import score_max, score_max_reference

__all__ = [
    "IMPLS",
    "MASK_VALUE",
    "KernelInputError",
    "QuantizedRows",
    "decode_attention",
    "decode_attention_reference",
    "ragged_decode",
    "ragged_decode_reference",
    "resolve_impl",
    "score_max",
    "score_max_reference",
]
