"""Weights: GGUF and HF safetensors converters, orbax checkpoints, tokenizers and the bundled-model registry."""

from kvzip_jax.weights.checkpoint import load_checkpoint, save_checkpoint
from kvzip_jax.weights.gguf import config_from_gguf, params_from_gguf
from kvzip_jax.weights.hf import params_from_hf
from kvzip_jax.weights.registry import BUNDLED, LoadedModel, bundled_gguf, convert, converted, load

__all__ = [
    "BUNDLED",
    "LoadedModel",
    "bundled_gguf",
    "config_from_gguf",
    "convert",
    "converted",
    "load",
    "load_checkpoint",
    "params_from_gguf",
    "params_from_hf",
    "save_checkpoint",
]
