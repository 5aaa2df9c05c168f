"""GGUF (llama.cpp) files -> ModelConfig and the parameter tree of params.py (quantized blocks dequantized to
float32, F16 tensors kept float16).

Metadata keys are `{arch}.*` (block_count, embedding_length, attention.head_count, ...). Tensors are read with
gguf.GGUFReader and dequantized with gguf.quants.dequantize (every type the installed package implements). Layout
facts this converter relies on:
  * GGUF-numpy shapes are the reverse of the GGML shapes; linear weights are [out, in] like torch.
  * llama.cpp permutes the rows of attn_q / attn_k for the llama architecture only (its NORM rotary layout); we
    undo it so q/k heads use HF's half-split rotary layout (n_head = num_kv_heads for attn_k).
  * llama.cpp bakes Gemma's +1 into every norm weight (q/k norms included): GGUF Gemma norms already are the
    effective multipliers our params store, so nothing is added.
  * llama 3 RoPE scaling is stored as the helper tensor `rope_freqs` (per-frequency divisors), not as metadata.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from kvzip_jax.config import FULL, SLIDING, ModelConfig, RopeSpec
from kvzip_jax.errors import ModelFileError, UnsupportedArchitectureError, WeightShapeError
from kvzip_jax.weights.assemble import Slot, SourceTensor, assemble_params, placer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
ROPE_FREQS = "rope_freqs.weight"  # llama 3 frequency divisors, folded into ModelConfig.rope

_GLOBAL_TENSORS = {
    "token_embd.weight": Slot(("embed",)),
    "output_norm.weight": Slot(("final_norm",)),
    "output.weight": Slot(("lm_head",)),
}
_BLOCK_TENSORS = {  # blk.{i}.<name> -> (param name, fused part)
    "attn_norm.weight": ("attn_norm", None),
    "attn_q.weight": ("qkv", "q"),
    "attn_k.weight": ("qkv", "k"),
    "attn_v.weight": ("qkv", "v"),
    "attn_q.bias": ("qkv_bias", "q"),
    "attn_k.bias": ("qkv_bias", "k"),
    "attn_v.bias": ("qkv_bias", "v"),
    "attn_q_norm.weight": ("q_norm", None),
    "attn_k_norm.weight": ("k_norm", None),
    "attn_output.weight": ("o", None),
    "post_attention_norm.weight": ("post_attn_norm", None),
    "ffn_norm.weight": ("mlp_norm", None),
    "ffn_gate.weight": ("gate_up", "gate"),
    "ffn_up.weight": ("gate_up", "up"),
    "ffn_down.weight": ("down", None),
    "post_ffw_norm.weight": ("post_mlp_norm", None),
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader over `path`; ModelFileError if the file is missing, truncated or not GGUF."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader parses every header and tensor extent up front: truncation fails here
        raise ModelFileError(f"{path} is truncated or not a GGUF file ({type(e).__name__}: {e})") from None


def _reader(source: str | Path | GGUFReader) -> GGUFReader:
    return source if isinstance(source, GGUFReader) else open_gguf(source)


_REQUIRED = object()


def _meta(reader: GGUFReader, key: str, default=_REQUIRED):
    """A metadata value (float32 values widen exactly, e.g. eps 9.999999747e-06, as transformers reads them)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelFileError(f"{reader.data.filename}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _uniform(value, key: str):
    """Per-layer metadata arrays (some GGUFs store head counts per layer) must be constant here."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedArchitectureError(f"per-layer {key} {value} is not supported")
        return value[0]
    return value


def _llama3_rope(reader: GGUFReader, arch: str, theta: float, head_dim: int) -> RopeSpec:
    """Recovers llama 3 RoPE scaling from the `rope_freqs` tensor (llama.cpp stores no scaling metadata for it).

    llama.cpp computes the divisors from factor, low/high frequency factors (1 and 4 in every Llama 3.x release)
    and the original context (8192); we take factor = the largest divisor and accept the tensor only if those
    parameters reproduce it.
    """
    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise WeightShapeError(f"tensor {ROPE_FREQS!r} has {divisors.size} values, expected {head_dim // 2}")
    if np.allclose(divisors, 1.0):
        return RopeSpec(theta=theta)
    original_context = int(_meta(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    spec = RopeSpec(theta=theta, kind="llama3", factor=float(divisors.max()), original_max_position=original_context)
    if not np.allclose(divisors, llama3_divisors(spec, head_dim), rtol=1e-5):
        raise UnsupportedArchitectureError(
            f"{ROPE_FREQS} does not match llama3 RoPE scaling (factor {spec.factor}, low/high frequency factors "
            f"{spec.low_freq_factor}/{spec.high_freq_factor}, original context {spec.original_max_position})"
        )
    return spec


def llama3_divisors(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """[H/2] factors dividing the default inverse frequencies under llama 3 scaling (HF and llama.cpp formula)."""
    inv_freq = 1.0 / spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    mid = 1.0 / ((1 - smooth) / spec.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, spec.factor, mid))


def _rope(reader: GGUFReader, arch: str, head_dim: int) -> RopeSpec:
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    rotary_dim = _meta(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise UnsupportedArchitectureError(f"partial rotary embedding ({rotary_dim} of {head_dim} dims)")
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if any(t.name == ROPE_FREQS for t in reader.tensors):
        if scaling != "none":
            raise UnsupportedArchitectureError(f"{ROPE_FREQS} together with rope scaling {scaling!r}")
        return _llama3_rope(reader, arch, theta, head_dim)
    if scaling == "none":
        return RopeSpec(theta=theta)
    if scaling == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(_meta(reader, f"{arch}.rope.scaling.factor")))
    raise UnsupportedArchitectureError(f"RoPE scaling {scaling!r} is not supported (none, linear, llama3)")


def _gemma_layer_types(reader: GGUFReader, num_layers: int) -> tuple[str, ...]:
    """Sliding pattern: an int period n (every n-th layer global) or per-layer bools (True = sliding). Gemma 3
    GGUFs usually carry neither; llama.cpp then hardcodes period 6 (5 sliding : 1 global), as HF does."""
    pattern = _meta(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelFileError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return tuple(SLIDING if sliding else FULL for sliding in pattern)
    return tuple(SLIDING if i % pattern < pattern - 1 else FULL for i in range(num_layers))


def config_from_gguf(source: str | Path | GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF metadata (and tensor names: output.weight present = untied, q bias = qkv_bias)."""
    reader = _reader(source)
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    hidden = _meta(reader, f"{arch}.embedding_length")
    heads = _uniform(_meta(reader, f"{arch}.attention.head_count"), "head_count")
    kv_heads = _uniform(_meta(reader, f"{arch}.attention.head_count_kv", heads), "head_count_kv")
    head_dim = _meta(reader, f"{arch}.attention.key_length", hidden // heads)
    if _meta(reader, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError("attention value_length differs from key_length")
    vocab = _meta(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelFileError(f"{reader.data.filename}: GGUF has neither {arch}.vocab_size nor a token list")
        vocab = len(tokens.data)
    num_layers = _meta(reader, f"{arch}.block_count")
    common = dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_uniform(_meta(reader, f"{arch}.feed_forward_length"), "feed_forward_length"),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position=_meta(reader, f"{arch}.context_length"),
        rope=_rope(reader, arch, head_dim),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
    )
    if arch != "gemma3":
        return ModelConfig(**common)
    # query_pre_attn_scalar is not stored; llama.cpp uses hidden/heads for the 27B (62 layers), head_dim otherwise.
    default_scale = (hidden / heads if num_layers == 62 else head_dim) ** -0.5
    window = _meta(reader, "gemma3.attention.sliding_window", 0)  # llama.cpp: absent or 0 = no sliding layers
    return ModelConfig(
        **common,
        rope_sliding=RopeSpec(theta=float(_meta(reader, "gemma3.rope.freq_base_swa", 10000.0))) if window else None,
        layer_types=_gemma_layer_types(reader, num_layers) if window else (FULL,) * num_layers,
        sliding_window=window or None,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=math.sqrt(hidden),
        query_scale=float(_meta(reader, "gemma3.attention.scale", default_scale)),
    )


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's llama-architecture q/k row permutation: [n_head*H, ...] rows back to HF order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(tensor) -> np.ndarray:
    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelFileError(
            f"tensor {tensor.name!r}: the gguf package cannot dequantize {tensor.tensor_type.name}"
        ) from None


def _source_tensors(reader: GGUFReader, cfg: ModelConfig) -> list[SourceTensor]:
    tensors, unexpected = [], []
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # consumed by config_from_gguf
        match = _BLOCK_NAME.fullmatch(tensor.name)
        if tensor.name in _GLOBAL_TENSORS:
            slot, suffix = _GLOBAL_TENSORS[tensor.name], None
        elif match and match.group(2) in _BLOCK_TENSORS:
            suffix = match.group(2)
            name, part = _BLOCK_TENSORS[suffix]
            slot = Slot((f"layers_{int(match.group(1))}", name), part)
        else:
            unexpected.append(tensor.name)
            continue
        transform = None
        if cfg.architecture == "llama" and suffix in ("attn_q.weight", "attn_k.weight"):
            n_head = cfg.num_heads if suffix == "attn_q.weight" else cfg.num_kv_heads
            transform = lambda w, n=n_head: unpermute_rows(w, n)  # noqa: E731
        shape = tuple(int(d) for d in reversed(tensor.shape))
        tensors.append(SourceTensor(tensor.name, slot, shape, lambda t=tensor: _dequantized(t), transform))
    if unexpected:
        raise WeightShapeError(
            f"unexpected GGUF tensor(s): {', '.join(unexpected[:12])}" + (" ..." if len(unexpected) > 12 else "")
        )
    return tensors


def params_from_gguf(path: str | Path, dtype=None, mesh=None) -> tuple[ModelConfig, dict]:
    """(config, parameter tree) from a GGUF file, any quantization the gguf package dequantizes, one tensor at a
    time. dtype: every parameter's (None: float32). mesh: None gives numpy arrays on the host; a (data, seq, tensor)
    mesh gives jax arrays laid out by sharding.param_shardings, each parameter placed as soon as it is dequantized,
    so the host never holds more than one parameter."""
    reader = open_gguf(path)
    cfg = config_from_gguf(reader)
    place = placer(cfg, dtype, mesh)  # a mesh the model does not fit fails here, before any read
    return cfg, assemble_params(cfg, _source_tensors(reader, cfg), place)
