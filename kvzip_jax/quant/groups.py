"""Asymmetric group quantization along the last axis (QServe-style per token and KV head, groups along the head
dimension; reference/mla_quant.md §4-5).

Each group of `group` consecutive elements x gets a zero point z (its minimum, rounded down to the scale dtype) and a
scale s ((max - z) / (2^bits - 1), rounded up), both stored in bfloat16 or float16; codes c = round((x - z) / s) in
[0, 2^bits - 1], so x is z + c s to within s / 2 (error_bound). int8 codes take a uint8 each; int4 codes are packed
two per uint8 (element 2i in the low nibble, 2i + 1 in the high one): `jnp.int4` arrays do not report packed bytes,
so bytes are counted from shapes (Quantized.nbytes). KIVI's per-channel key quantization is the option
`along="tokens"`: each channel's groups run along `group` consecutive tokens (rows [..., T, D], T a multiple of the
group), scales [..., T / group, D]; codes stay [..., T, D] (int4 packed along D).

Einsum legend: D last axis (head dim), N groups per row (D / group), g elements per group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.kv_bits import KV_BITS

BITS = (8, 4)
DEFAULT_GROUP = {8: 64, 4: 16}  # elements per scale when none is given (int4: four scales per head of 64)
SCALE_DTYPES = ("bfloat16", "float16")
ALONG = ("head_dim", "tokens")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """bits: 8 or 4; group: elements per scale (it must divide the grouped axis; None: DEFAULT_GROUP[bits]);
    scale_dtype: of the scales and zero points; along: head_dim (groups along the last axis, per token: QServe) or
    tokens (per channel, groups along the second to last axis: KIVI's keys)."""

    bits: int = 4
    group: int | None = None
    scale_dtype: str = "bfloat16"
    along: str = "head_dim"

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if self.group is None:
            object.__setattr__(self, "group", DEFAULT_GROUP[self.bits])
        if self.group < 2 or self.group % 2:
            raise ValueError(f"group must be an even number >= 2, got {self.group}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.along not in ALONG:
            raise ValueError(f"along must be one of {ALONG}, got {self.along!r}")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def group_for(self, width: int) -> int:
        """The group along an axis of `width` elements: `group`, or the whole axis when it is shorter."""
        group = min(self.group, width)
        if group < 2 or width % group or group % 2:
            raise ValueError(f"a group of {group} does not split an axis of {width} elements into even groups")
        return group


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """codes [..., D] uint8 (int8 format) or [..., D / 2] uint8 (int4, packed); scale, zero [..., N] (along
    head_dim, N = D / group) or [..., T / group, D] (along tokens) in the scale dtype; bits and along static."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    along: str = dataclasses.field(default="head_dim", metadata=dict(static=True))

    @property
    def width(self) -> int:
        """D: the elements of a row."""
        return self.codes.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the rows it stands for: codes' with the last axis unpacked."""
        return self.codes.shape[:-1] + (self.width,)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def format(self) -> QuantFormat:
        """The QuantFormat these rows were quantized in."""
        groups = self.scale.shape[-2] if self.along == "tokens" else self.scale.shape[-1]
        width = self.codes.shape[-2] if self.along == "tokens" else self.width
        return QuantFormat(
            bits=self.bits, group=width // groups, scale_dtype=np.dtype(self.scale.dtype).name, along=self.along
        )

    @property
    def nbytes(self) -> int:
        """Bytes from shapes: codes (one byte per uint8, two int4 codes in one), scales and zero points."""
        return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in (self.codes, self.scale, self.zero)))


def kv_formats(bits: int | str, group: int | None = None) -> tuple[QuantFormat, QuantFormat] | None:
    """(the keys' format, the values' format) of a KV_BITS entry, or None for 16 (the model's dtype); group as
    QuantFormat's (None: each width's DEFAULT_GROUP)."""
    if bits not in KV_BITS:
        raise ValueError(f"kv bits must be one of {KV_BITS}, got {bits!r}")
    if bits == 16:
        return None
    key_bits, value_bits = (8, 4) if bits == "8/4" else (bits, bits)
    return QuantFormat(bits=key_bits, group=group), QuantFormat(bits=value_bits, group=group)


def pack_int4(codes: jax.Array) -> jax.Array:
    """[..., D] uint8 codes in [0, 15] -> [..., D / 2] uint8, element 2i in the low nibble, 2i + 1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last axis, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """pack_int4's inverse: [..., D / 2] uint8 -> [..., D] uint8 codes. Each byte is repeated, then element j takes
    its byte's high nibble where j is odd: elementwise, so XLA fuses it into the dequantization that reads it
    (stacking the two nibbles and reshaping them makes a copy)."""
    twice = jnp.repeat(packed, 2, axis=-1)  # [..., D]
    odd = jnp.arange(twice.shape[-1]) % 2 == 1  # [D]
    return jnp.where(odd, twice >> 4, twice & 0xF).astype(jnp.uint8)


def quantize(x: jax.Array, fmt: QuantFormat = QuantFormat()) -> Quantized:
    """x [..., D] (any float dtype; [..., T, D] along tokens) -> Quantized in fmt."""
    x = x.astype(jnp.float32)
    if fmt.along == "tokens":
        if x.ndim < 2:
            raise ValueError("quantizing along tokens needs rows [..., T, D]")
        codes, scale, zero = _along_last(jnp.swapaxes(x, -1, -2), fmt)  # [..., D, T], [..., D, T / g]
        codes, scale, zero = (jnp.swapaxes(a, -1, -2) for a in (codes, scale, zero))
    else:
        codes, scale, zero = _along_last(x, fmt)
    return Quantized(
        codes=pack_int4(codes) if fmt.bits == 4 else codes, scale=scale, zero=zero, bits=fmt.bits, along=fmt.along
    )


def _along_last(x: jax.Array, fmt: QuantFormat):
    """(codes [..., D] uint8, scale [..., N], zero [..., N]) of float32 x [..., D], groups along the last axis."""
    D = x.shape[-1]
    g = fmt.group_for(D)
    dtype = jnp.dtype(fmt.scale_dtype)
    groups = x.reshape(x.shape[:-1] + (D // g, g))  # [..., N, g]
    low, high = groups.min(axis=-1), groups.max(axis=-1)  # [..., N]
    zero = _rounded(low, dtype, up=False)  # stored zero <= every element
    scale = _rounded((high - zero.astype(jnp.float32)) / fmt.levels, dtype, up=True)  # z + levels s >= max
    s, z = scale.astype(jnp.float32)[..., None], zero.astype(jnp.float32)[..., None]
    codes = jnp.where(s > 0, jnp.round((groups - z) / jnp.where(s > 0, s, 1.0)), 0.0)
    return jnp.clip(codes, 0, fmt.levels).astype(jnp.uint8).reshape(x.shape), scale, zero


def per_element(q: Quantized, a: jax.Array) -> jax.Array:
    """A per-group array a (q.scale's shape) repeated over its group's elements: the codes' unpacked shape."""
    if q.along == "tokens":
        return jnp.repeat(a, q.codes.shape[-2] // a.shape[-2], axis=-2)
    return jnp.repeat(a, q.width // a.shape[-1], axis=-1)


def dequantize(q: Quantized, dtype=jnp.float32) -> jax.Array:
    """[..., D] in dtype: zero + code x scale per element."""
    codes = (unpack_int4(q.codes) if q.bits == 4 else q.codes).astype(jnp.float32)
    x = per_element(q, q.zero.astype(jnp.float32)) + codes * per_element(q, q.scale.astype(jnp.float32))
    return x.astype(dtype)


def error_bound(q: Quantized) -> jax.Array:
    """The most |x - dequantize(q)| can be per element: half its group's scale (float32 arithmetic aside)."""
    return per_element(q, q.scale.astype(jnp.float32) / 2)


def _rounded(x: jax.Array, dtype, up: bool) -> jax.Array:
    """x (float32) in dtype, rounded up (or down): never below (above) x."""
    r = x.astype(dtype)
    wrong = r.astype(jnp.float32) < x if up else r.astype(jnp.float32) > x
    toward = jnp.array(jnp.inf if up else -jnp.inf, dtype)
    return jnp.where(wrong, jnp.nextafter(r, toward), r)
