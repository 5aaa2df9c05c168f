"""Which implementation a kernel call runs, how its pallas_call is lowered, and the checks both need.

Backends:
- GPU (CUDA, compute capability >= 8.0: A100, L4, H100, H200, ...): the kernels are written in the backend-neutral
  Pallas subset and lowered through **Triton**, chosen by passing `triton.CompilerParams` to `pallas_call`. Without
  compiler params jax >= 0.9 lowers a `pallas_call` through Mosaic GPU, which needs Hopper (sm90) or later and other
  kernel shapes; our kernels do not target it. jax 0.11 deprecates the Triton backend and warns at every lowering:
  that one warning is filtered below (jax < 0.12 keeps the backend).
- GPU below compute capability 8.0 (V100, T4): `impl="auto"` takes the XLA path. JAX's own Pallas-Triton kernels are
  gated on cc >= 8.0 and bf16 dots need sm80; whether our kernels compile there is unverified, and
  `impl="pallas"` tries anyway.
- CPU: `pallas_call` only runs in interpret mode (a jitted scan over the grid), which is what the tests use.
  `impl="auto"` takes the XLA path there.
- TPU: ragged_decode (and so decode_attention) and score_max have TPU variants (ragged_decode_tpu.py,
  score_max_tpu.py) lowered through **Mosaic**, chosen by passing `pltpu.CompilerParams(dimension_semantics=...)`:
  scalar-prefetched offsets and lengths, Mosaic block shapes (last two block dims multiples of 8 and 128, or the
  array's); float and QuantizedRows stores. They are tested in Pallas TPU interpret mode and lowered for "tpu" on CPU
  (jax.export), never run on a TPU: `impl="auto"` takes the XLA path there (unmeasured).

The lowering is chosen at trace time from `target_platform()` (the default backend's; tests replace it to export for
another platform) by `lowering()`. One export holds one platform's kernels: with jax 0.10 `lax.platform_dependent`
lowers each kept branch's pallas_call for every platform of the module, which the Triton and Mosaic lowerings refuse.

Triton constraints the kernels respect: every loaded or stored block has a power-of-two size, dot operands are at
least 16 x 16 (query rows are padded to a power of two >= 16), and float32 dots default to TF32, so every kernel dot
goes through `kernel_dot`, which asks for IEEE float32 (`Precision.HIGHEST`) and float32 accumulation.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton

IMPLS = ("auto", "xla", "pallas")

# Finite "minus infinity" for masked logits: exp(MASK_VALUE - m) underflows to 0 while MASK_VALUE - MASK_VALUE stays
# 0, so a row with every key masked gives no inf - inf. Rounded to float32 so stored values compare equal to it.
MASK_VALUE = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))  # numpy: importing starts no backend

MIN_TRITON_CAPABILITY = (8, 0)
TRITON_NUM_WARPS = 4
TRITON_NUM_STAGES = 2
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

# jax 0.11 raises this DeprecationWarning when a Triton pallas_call is lowered, which happens when the caller's jit
# compiles, outside any call of ours: a module-level filter, restricted to this message and category.
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


class KernelInputError(ValueError):
    """A kernel was given arrays or settings it does not accept (shapes, dtypes, block sizes)."""


def _cuda_capability() -> tuple[int, ...] | None:
    """Compute capability of the first device as (major, minor), or None when it is not a CUDA GPU."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return tuple(int(part) for part in str(capability).split("."))
    except ValueError:
        return None


def resolve_impl(impl: str) -> str:
    """Map an `impl` choice to "xla" or "pallas".

    "auto" is "pallas" on a CUDA GPU of compute capability >= 8.0 and "xla" everywhere else (CPU; TPU: its kernels
    are unmeasured on a TPU; older or non-CUDA GPUs: unverified). "xla" and "pallas" are returned as given.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    capability = _cuda_capability()
    return "pallas" if capability is not None and capability >= MIN_TRITON_CAPABILITY else "xla"


def target_platform() -> str:
    """The lowering platform the kernels are traced for: the default backend's ("cuda" for a GPU, "tpu", "cpu").

    Tests replace it to trace for a platform this host lacks (then export for that platform).
    """
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" else backend


def lowering(platform: str | None = None) -> str:
    """How a kernel is built for a lowering platform (default `target_platform()`): "triton" (CUDA), "mosaic" (TPU)
    or "interpret" (any other: CPU)."""
    return {"cuda": "triton", "tpu": "mosaic"}.get(target_platform() if platform is None else platform, "interpret")


def interpret_mode() -> bool:
    """Whether the kernels run interpreted: True unless a GPU or a TPU is targeted."""
    return lowering() == "interpret"


def compiler_params(interpret: bool | None = None) -> pl_triton.CompilerParams | None:
    """The Triton kernels' pallas_call compiler params: Triton's when compiled (selects the Triton lowering), None
    when interpreted.

    `interpret` defaults to `interpret_mode()`; passing False asks for the Triton params on any host (the tests
    lower the kernels for CUDA on CPU that way).
    """
    if interpret_mode() if interpret is None else interpret:
        return None
    return pl_triton.CompilerParams(num_warps=TRITON_NUM_WARPS, num_stages=TRITON_NUM_STAGES)


def mosaic_compiler_params(*dimension_semantics: str) -> pltpu.CompilerParams:
    """The TPU kernels' pallas_call compiler params: one "parallel" or "arbitrary" per grid axis."""
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


def mosaic_interpret_params():
    """pallas_call's `interpret` for a TPU kernel run on another host: TPU interpret mode (simulated VMEM, SMEM and
    DMAs) where this jax has it, else the generic interpreter."""
    params = getattr(pltpu, "InterpretParams", None)
    return True if params is None else params()


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` >= n."""
    return -(-n // multiple) * multiple


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def supports_head_dim(head_dim: int) -> bool:
    """Whether the kernels take this head dim (a power of two >= 16); callers fall back to XLA otherwise."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def check_power_of_two(name: str, value: int, minimum: int = 16) -> None:
    """Raise KernelInputError unless `value` is a power of two >= `minimum` (Triton block and dot constraints)."""
    if value < minimum or value & (value - 1):
        raise KernelInputError(f"{name} must be a power of two >= {minimum}, got {value}")


def kernel_dot(a: jax.Array, b: jax.Array, *, transpose_b: bool = False) -> jax.Array:
    """a @ b (or a @ b.T) inside a kernel, accumulated in float32; IEEE float32 products when inputs are float32.

    a [X, Y], b [Y, Z] (or [Z, Y] with transpose_b), same dtype -> [X, Z] float32.
    """
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract_b = 1 if transpose_b else 0
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
