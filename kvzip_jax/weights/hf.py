"""HF safetensors folders -> ModelConfig and the parameter tree of params.py (source precision, or a dtype asked for;
on the host, or placed onto a device mesh parameter by parameter), without torch.

Reads `model.safetensors`, or the shards listed in `model.safetensors.index.json`, with safe_open(framework="numpy")
(bf16 comes back through ml_dtypes). HF linear weights are [out, in]; assemble.py transposes and fuses them.
HF Gemma 3 stores every RMSNorm weight w (q/k norms included) used as (1 + w): we add the 1 here, since params
hold effective multipliers.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import SafetensorError, safe_open

from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ModelFileError, WeightShapeError
from kvzip_jax.weights.assemble import Slot, SourceTensor, assemble_params, placer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_TENSORS = {  # model.layers.{i}.<name> -> (param name, fused part); norm names differ for Gemma, below
    "input_layernorm.weight": ("attn_norm", None),
    "self_attn.q_proj.weight": ("qkv", "q"),
    "self_attn.k_proj.weight": ("qkv", "k"),
    "self_attn.v_proj.weight": ("qkv", "v"),
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "self_attn.o_proj.weight": ("o", None),
    "mlp.gate_proj.weight": ("gate_up", "gate"),
    "mlp.up_proj.weight": ("gate_up", "up"),
    "mlp.down_proj.weight": ("down", None),
}
_LLAMA_NORMS = {"post_attention_layernorm.weight": ("mlp_norm", None)}
_MLA_TENSORS = {  # DeepSeek-V2/V3 attention (dense MLP layers use the llama names)
    "input_layernorm.weight": ("attn_norm", None),
    "post_attention_layernorm.weight": ("mlp_norm", None),
    "self_attn.q_proj.weight": ("q", None),
    "self_attn.q_a_proj.weight": ("q_a", None),
    "self_attn.q_a_layernorm.weight": ("q_a_norm", None),
    "self_attn.q_b_proj.weight": ("q_b", None),
    "self_attn.kv_a_proj_with_mqa.weight": ("kv_a", None),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", None),
    "self_attn.kv_b_proj.weight": ("kv_b", None),
    "self_attn.o_proj.weight": ("o", None),
    "mlp.gate_proj.weight": ("gate_up", "gate"),
    "mlp.up_proj.weight": ("gate_up", "up"),
    "mlp.down_proj.weight": ("down", None),
}
_GEMMA_NORMS = {
    "post_attention_layernorm.weight": ("post_attn_norm", None),
    "pre_feedforward_layernorm.weight": ("mlp_norm", None),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", None),
}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")  # non-persistent buffers some old checkpoints still carry
_VISION = ("model.vision_tower.", "model.multi_modal_projector.")  # multimodal Gemma 3: text weights only


def safetensors_files(folder: str | Path) -> list[Path]:
    """The safetensors files of an HF folder: the single file, or every shard the index names."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFileError(f"HF model folder not found: {folder}")
    if (folder / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFileError(f"{folder / INDEX_FILE} is not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        raise ModelFileError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ModelFileError(f"missing safetensors shard(s): {', '.join(absent)}")
    return files


def _read_all(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """name -> (shape, loader) over all files; loaders read lazily. Duplicate names across shards are an error."""
    found = {}
    for path in files:
        try:
            handle = safe_open(str(path), framework="numpy")
            for name in handle.keys():
                if name in found:
                    raise WeightShapeError(f"tensor {name!r} appears in more than one shard")
                shape = tuple(handle.get_slice(name).get_shape())
                found[name] = (shape, lambda h=handle, n=name: _get(h, n, path))
        except (SafetensorError, OSError) as e:
            raise ModelFileError(f"{path} is not a readable safetensors file ({e})") from None
    return found


def _get(handle, name: str, path: Path) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f"{path}: cannot read tensor {name!r} ({e})") from None


def _plus_one(w: np.ndarray) -> np.ndarray:
    return w + 1.0


def _slot(cfg: ModelConfig, key: str, prefix: str) -> Slot | None:
    """The slot an HF key fills, None if the name is not a parameter of ours."""
    if key == "lm_head.weight":
        return Slot(("lm_head",))
    if not key.startswith(prefix):
        return None
    name = key[len(prefix) :]
    if name == "embed_tokens.weight":
        return Slot(("embed",))
    if name == "norm.weight":
        return Slot(("final_norm",))
    match = _LAYER_NAME.fullmatch(name)
    if cfg.mla is not None:
        table = _MLA_TENSORS
    else:
        table = {**_LAYER_TENSORS, **(_GEMMA_NORMS if cfg.architecture == "gemma3" else _LLAMA_NORMS)}
    if match is None or match.group(2) not in table:
        return None
    param, part = table[match.group(2)]
    return Slot((f"layers_{int(match.group(1))}", param), part)


def _rope_evens_first(cfg: ModelConfig, param: str):
    """For an MLA projection whose output holds RoPE lanes in interleaved pairs (V3's rope_interleave, V2's complex
    pairs): a transform of the HF weight [out, in] putting each RoPE block's even lanes first, then the odd ones, so
    that the half-split RoPE of models/layers.py rotates the same pairs (q and k permuted alike: q.k is unchanged).
    None for the other parameters."""
    m = cfg.mla
    rope = np.concatenate([np.arange(0, m.qk_rope_head_dim, 2), np.arange(1, m.qk_rope_head_dim, 2)])
    if param in ("q", "q_b"):
        width = m.qk_nope_head_dim + m.qk_rope_head_dim
        order = np.concatenate(
            [
                h * width + np.concatenate([np.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + rope])
                for h in range(cfg.num_heads)
            ]
        )
    elif param == "kv_a":
        order = np.concatenate([np.arange(m.kv_lora_rank), m.kv_lora_rank + rope])
    else:
        return None
    return lambda w: w[order]


def _interleaved_rope(folder: Path) -> bool:
    hf = json.loads((folder / "config.json").read_text())
    return hf.get("model_type") == "deepseek_v2" or bool(hf.get("rope_interleave", True))


def params_from_hf(folder: str | Path, dtype=None, mesh=None) -> tuple[ModelConfig, dict]:
    """(config, parameter tree) from an HF folder: config.json + safetensors (single or sharded), read lazily one
    tensor at a time. dtype: every parameter's (None: the source's precision, dtypes.storage). mesh: None gives numpy
    arrays on the host; a (data, seq, tensor) mesh gives jax arrays laid out by sharding.param_shardings, each
    parameter placed on its devices as soon as it is fused, so the host never holds more than one parameter."""
    folder = Path(folder)
    cfg = ModelConfig.from_hf(folder)
    place = placer(cfg, dtype, mesh)  # a mesh the model does not fit fails here, before any read
    found = _read_all(safetensors_files(folder))
    interleaved = cfg.mla is not None and _interleaved_rope(folder)
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in found) else "model."
    multimodal = prefix == "model.language_model."
    if "lm_head.weight" in found and cfg.tie_embeddings:
        lm_head, embed = found.pop("lm_head.weight"), found.get(prefix + "embed_tokens.weight")
        if embed is not None and (lm_head[0] != embed[0] or not np.array_equal(lm_head[1](), embed[1]())):
            warnings.warn(
                f"{folder}: lm_head.weight differs from the embeddings although tie_word_embeddings is "
                "true; using the embeddings, as transformers does",
                stacklevel=2,
            )
    tensors, unexpected = [], []
    for key, (shape, load) in found.items():
        slot = _slot(cfg, key, prefix)
        if slot is None:
            if not _IGNORED.fullmatch(key) and not (multimodal and key.startswith(_VISION)):
                unexpected.append(key)
            continue
        gemma_norm = cfg.architecture == "gemma3" and slot.path[-1].endswith("norm")
        transform = _plus_one if gemma_norm else None
        if cfg.mla is not None and interleaved:
            transform = _rope_evens_first(cfg, slot.path[-1])
        tensors.append(SourceTensor(key, slot, shape, load, transform))
    if unexpected:
        raise WeightShapeError(
            f"unexpected tensor(s) in {folder}: {', '.join(sorted(unexpected)[:12])}"
            + (" ..." if len(unexpected) > 12 else "")
        )
    return cfg, assemble_params(cfg, tensors, place)
