"""ModelConfig: one frozen, hashable description of a decoder, read from HF config.json or GGUF metadata.

Families are flags, not subclasses:
  llama  (Llama 2/3.x, SmolLM2): plain RMSNorm, SwiGLU, optional RoPE frequency scaling (linear, llama3, YaRN).
  qwen2  (Qwen2/2.5): llama + q/k/v biases.
  qwen3: llama + per-head q/k RMSNorm before RoPE.
  gemma3 (text): (1+w) norms (the +1 is baked into our params), sqrt(D) embedding scale, query_pre_attn_scalar,
         GELU-tanh MLP, pre/post attention and FFN norms, q/k norms, hybrid sliding/global layers with their own
         RoPE bases.
  deepseek (DeepSeek-V2/V3, dense MLP layers): multi-head latent attention (MLASpec). The cache holds one latent row
         per token and layer, a single "KV head": k is the shared RoPE key [.., qk_rope_head_dim] and v the latent
         [.., kv_lora_rank]; num_kv_heads is 1 and head_dim the RoPE width.
The config is registered static, so it can be passed straight through `jax.jit` as an ordinary argument.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

import jax

from kvzip_jax.errors import ModelFileError, UnsupportedArchitectureError
from pallas_kernels.dispatch import IMPLS

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "deepseek")
FULL, SLIDING = "full", "sliding"
MLA_FORMS = ("absorbed", "naive")

_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3). q_lora_rank: the query's down-projection rank (None: one
    projection); kv_lora_rank (R): the cached latent's width; qk_nope_head_dim, qk_rope_head_dim (the shared RoPE
    key's width), v_head_dim: per-head widths. RoPE's interleaved lane order (V3's rope_interleave, V2's complex
    pairs) is taken out at conversion: the rotary columns of the projections are stored evens first."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class YarnSpec:
    """YaRN's extra parameters (arXiv 2309.00071; RopeSpec kind 'yarn'): frequencies between beta_fast and beta_slow
    rotations over the original context are ramped from extrapolated to interpolated (the correction range rounded
    outwards when truncate), and cos / sin are multiplied by attention_factor."""

    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 mscale ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type. kind: 'default' | 'linear' | 'llama3' | 'yarn' (with its YarnSpec)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    yarn: YarnSpec | None = None

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, theta: float, max_position: int | None = None) -> "RopeSpec":
        """Reads an HF rope dict (`rope_scaling` or transformers-5 `rope_parameters`); None means default.
        max_position: the config's max_position_embeddings (YaRN without a factor takes it over the original)."""
        params = dict(params or {})
        theta = float(params.get("rope_theta", theta))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise UnsupportedArchitectureError(f"RoPE type {kind!r} is not supported (default, linear, llama3, yarn)")
        if kind == "default":
            return cls(theta=theta)
        if kind == "linear":
            return cls(theta=theta, kind=kind, factor=float(params["factor"]))
        if kind == "yarn":
            original = int(params["original_max_position_embeddings"])
            factor = params.get("factor") or (max_position or original) / original
            attention_factor = params.get("attention_factor")
            if attention_factor is None:
                mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
                attention_factor = (
                    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                    if mscale and mscale_all_dim
                    else yarn_mscale(factor)
                )
            yarn = YarnSpec(
                attention_factor=float(attention_factor),
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1),
                truncate=bool(params.get("truncate", True)),
            )
            return cls(theta=theta, kind=kind, factor=float(factor), original_max_position=original, yarn=yarn)
        return cls(
            theta=theta,
            kind=kind,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and family description of a decoder-only transformer."""

    architecture: str  # one of ARCHITECTURES
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    intermediate_size: int  # F
    rms_norm_eps: float
    max_position: int
    rope: RopeSpec  # full (global) attention layers
    rope_sliding: RopeSpec | None = None  # sliding-window layers (Gemma 3 local base)
    layer_types: tuple[str, ...] = ()  # FULL | SLIDING per layer; empty means all FULL
    sliding_window: int | None = None
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # Gemma: post-attention and post-FFN norms
    activation: str = "silu"  # silu | gelu_tanh
    embed_scale: float = 1.0  # Gemma: sqrt(D)
    query_scale: float = 0.0  # multiplies q.k; 0 means head_dim ** -0.5
    mla: MLASpec | None = None  # deepseek: multi-head latent attention
    # A kernel flag, not part of the model (never saved): "auto" | "xla" | "pallas" for decode attention and the
    # KVzip score reduction (pallas_kernels.resolve_impl; auto is Pallas on a CUDA GPU, XLA elsewhere).
    attention_impl: str = "auto"
    # MLA's attention form, a runtime choice (never saved): "absorbed" (attend over the latents with W_UK folded
    # into the queries and W_UV applied after; models/mla.py) or "naive" (the latents up-projected per head).
    mla_form: str = "absorbed"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"attention_impl must be one of {IMPLS}, got {self.attention_impl!r}")
        if self.mla_form not in MLA_FORMS:
            raise ValueError(f"mla_form must be one of {MLA_FORMS}, got {self.mla_form!r}")
        if (self.architecture == "deepseek") != (self.mla is not None):
            raise ValueError("the deepseek architecture, and it alone, has an MLASpec")
        if self.mla is not None and (self.num_kv_heads != 1 or self.head_dim != self.mla.qk_rope_head_dim):
            raise ValueError(
                "an MLA cache is one latent 'KV head' whose key is the RoPE part: num_kv_heads 1, "
                "head_dim qk_rope_head_dim"
            )
        if self.query_scale == 0.0:
            object.__setattr__(self, "query_scale", self.head_dim**-0.5)

    @property
    def group_size(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def cache_widths(self) -> tuple[int, int]:
        """(k, v) widths of a cached pair: (H, H), or for MLA (the RoPE key, the latent)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim, self.mla.kv_lora_rank
        return self.head_dim, self.head_dim

    def rope_for(self, layer: int) -> RopeSpec:
        if self.layer_types[layer] == SLIDING and self.rope_sliding is not None:
            return self.rope_sliding
        return self.rope

    def window_for(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def to_dict(self) -> dict[str, Any]:
        """The model's description (attention_impl, a runtime choice, left out)."""
        d = dataclasses.asdict(self)
        del d["attention_impl"], d["mla_form"]
        if d["mla"] is None:
            del d["mla"]  # the saved form of the other families is unchanged (checkpoint identity hashes)
        for rope in (d["rope"], d["rope_sliding"]):
            if rope is not None and rope["yarn"] is None:
                del rope["yarn"]  # likewise for every RoPE but YaRN's
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        rope = lambda r: RopeSpec(**{**r, "yarn": YarnSpec(**r["yarn"]) if r.get("yarn") else None})
        d["rope"] = rope(d["rope"])
        d["rope_sliding"] = rope(d["rope_sliding"]) if d.get("rope_sliding") else None
        d["layer_types"] = tuple(d["layer_types"])
        d["mla"] = MLASpec(**d["mla"]) if d.get("mla") else None
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | str | Path) -> "ModelConfig":
        """From an HF config dict, a config.json path, or a folder holding config.json (transformers 4 or 5)."""
        if not isinstance(hf, Mapping):
            path = Path(hf)
            path = path / "config.json" if path.is_dir() else path
            try:
                hf = json.loads(path.read_text())
            except FileNotFoundError:
                raise ModelFileError(f"no config.json at {path}") from None
            except json.JSONDecodeError as e:
                raise ModelFileError(f"{path} is not valid JSON: {e}") from None
        hf = dict(hf.get("text_config", hf)) if hf.get("model_type") == "gemma3" else dict(hf)
        model_type = hf.get("model_type")
        if model_type not in _HF_MODEL_TYPES:
            names = hf.get("architectures") or [model_type]
            raise UnsupportedArchitectureError(
                f"architecture {names[0]!r} (model_type {model_type!r}) is not supported; "
                f"supported model types: {', '.join(sorted(_HF_MODEL_TYPES))}"
            )
        arch = _HF_MODEL_TYPES[model_type]
        heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling")
        theta = float(hf.get("rope_theta", 10000.0))
        gemma = arch == "gemma3"
        common = dict(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position=hf.get("max_position_embeddings", 8192),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        )
        if arch == "deepseek":
            return _deepseek(hf, common, rope_params, theta)
        if arch in ("llama", "qwen2", "qwen3"):
            if hf.get("use_sliding_window"):
                raise UnsupportedArchitectureError(f"{model_type} with use_sliding_window=True is not supported")
            return cls(
                **common,
                rope=RopeSpec.from_hf(rope_params, theta, common["max_position"]),
                qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
            )
        # gemma3: transformers 5 nests per-layer-type rope params; transformers 4 has rope_theta,
        # rope_local_base_freq and rope_scaling (applied to the global layers).
        if rope_params and "full_attention" in rope_params:
            rope = RopeSpec.from_hf(rope_params["full_attention"], theta)
            rope_sliding = RopeSpec.from_hf(rope_params.get("sliding_attention"), 10000.0)
        else:
            rope = RopeSpec.from_hf(rope_params, float(hf.get("rope_theta", 1_000_000.0)))
            rope_sliding = RopeSpec(theta=float(hf.get("rope_local_base_freq", 10000.0)))
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(common["num_layers"])
            ]
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise UnsupportedArchitectureError("Gemma logit soft-capping is not supported (Gemma 3 has none)")
        return cls(
            **common,
            rope=rope,
            rope_sliding=rope_sliding,
            layer_types=tuple(SLIDING if t == "sliding_attention" else FULL for t in layer_types),
            sliding_window=hf.get("sliding_window", 4096),
            qk_norm=True,
            sandwich_norms=True,
            activation="gelu_tanh",
            embed_scale=math.sqrt(hidden),
            query_scale=float(hf.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        )


def _deepseek(hf: dict, common: dict, rope_params, theta: float) -> ModelConfig:
    """A DeepSeek-V2/V3 config with dense MLP layers only (MoE layers and attention biases are named errors). With
    YaRN RoPE (DeepSeek-V2-Lite's, V3's) the softmax scale takes mscale_all_dim's temperature squared, on every query
    dimension, as DeepSeek's reference code does."""
    layers = common["num_layers"]
    dense = hf.get("first_k_dense_replace")
    if hf.get("n_routed_experts") and (dense is None or dense < layers):
        raise UnsupportedArchitectureError(
            f"{hf.get('model_type')} with mixture-of-experts layers is not supported (n_routed_experts "
            f"{hf.get('n_routed_experts')}, first_k_dense_replace {dense} < {layers} layers): only dense MLP layers"
        )
    if hf.get("attention_bias"):
        raise UnsupportedArchitectureError(f"{hf.get('model_type')} with attention_bias=True is not supported")
    rope = RopeSpec.from_hf(rope_params, theta, common["max_position"])
    mla = MLASpec(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
    )
    return ModelConfig(
        **{**common, "num_kv_heads": 1, "head_dim": mla.qk_rope_head_dim},
        rope=rope,
        mla=mla,
        query_scale=mla_query_scale(mla, rope, rope_params),
    )


def mla_query_scale(mla: MLASpec, rope: RopeSpec, rope_params: Mapping[str, Any] | None) -> float:
    """An MLA layer's softmax scale: 1 / sqrt(nope + rope head dim), times mscale(factor, mscale_all_dim)^2 when a
    scaled RoPE (rope_params: the HF dict it was read from) gives mscale_all_dim."""
    mscale_all_dim = (rope_params or {}).get("mscale_all_dim") if rope.kind != "default" else None
    temperature = yarn_mscale(rope.factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5 * temperature
