"""The dtype policy: parameters and caches in bfloat16 or float32, by choice.

"auto" means bfloat16 on GPU and TPU (half the bytes, and the hardware's native matmul type) and float32 on CPU
(XLA's CPU matmuls are fastest in float32, and parity tests run there). Whatever the storage dtype, softmax, norms,
RoPE, the KVzip score and the logits accumulate in float32. A KV cache follows the parameters' dtype.
"""

from __future__ import annotations

import numpy as np

from kvzip_jax.errors import KvzipError

CHOICES = ("auto", "float32", "bfloat16")
SOURCE = "source"  # convert: keep each tensor's precision as the source file stores it


class DtypeError(KvzipError, ValueError):
    """A dtype kvzip-jax does not run in."""


def resolve(dtype=None):
    """The dtype for params and caches: "auto" (or None) by backend, else "float32" / "bfloat16" or those dtypes."""
    import jax
    import jax.numpy as jnp

    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise DtypeError(f"dtype must be one of {', '.join(CHOICES)}, got {dtype!r}")
    return resolved


def of_params(params) -> np.dtype:
    """The dtype a model runs in: its embedding table's."""
    return np.dtype(params["embed"].dtype)


def cast_params(params, dtype) -> dict:
    """Every leaf of a parameter tree as a jax array of `dtype` (no copy where it already is)."""
    import jax
    import jax.numpy as jnp

    dtype = resolve(dtype)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def storage(array) -> np.dtype:
    """The dtype a converted checkpoint stores a source tensor in: its own when that is float32, bfloat16 or float16,
    else float32 (quantized GGUF blocks are dequantized to float32)."""
    dtype = np.dtype(array.dtype)
    return dtype if dtype.name in ("float32", "bfloat16", "float16") else np.dtype(np.float32)
