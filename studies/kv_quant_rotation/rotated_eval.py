"""`kvzip-jax eval` with every quantized row rotated by a normalised Hadamard matrix first (QuaRot-style incoherence
processing): quantize(x) quantizes x H, dequantize returns dequantized(x H) H^T. Scores are unchanged by the rotation
in exact arithmetic (H is orthogonal), so any difference in answers is the int4 rounding of rotated rows against
plain ones. A simulation over the XLA path (dequantize is what it reads), not a feature of the library.

    python studies/kv_quant_rotation/rotated_eval.py eval --model qwen2.5-coder-0.5b-instruct --methods kvzip \
        --ratios 0.3 --kv-bits 16,4 --tasks multi_needle,passkey,niah --contexts 6 --context-tokens 640 \
        --questions-per-context 3 --attention-impl xla --out studies/kv_quant_rotation/results
"""

import sys

import jax.numpy as jnp
import numpy as np

from kvzip_jax.quant import groups

plain_quantize, plain_dequantize = groups.quantize, groups.dequantize


def hadamard(n: int) -> jnp.ndarray:
    """[n, n] Sylvester Hadamard matrix / sqrt(n) (n a power of 2): orthogonal and symmetric."""
    if n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of 2, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(h / np.sqrt(n), jnp.float32)


def rotated_quantize(x, fmt=groups.QuantFormat()):
    return plain_quantize(x.astype(jnp.float32) @ hadamard(x.shape[-1]), fmt)


def rotated_dequantize(q, dtype=jnp.float32):
    x = plain_dequantize(q)
    return (x @ hadamard(x.shape[-1]).T).astype(dtype)


if __name__ == "__main__":
    groups.quantize, groups.dequantize = rotated_quantize, rotated_dequantize  # what cache.py and attention.py call
    from kvzip_jax.cli import main

    sys.exit(main())
