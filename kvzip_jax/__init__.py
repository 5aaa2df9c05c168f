"""kvzip-jax: query-agnostic KV-cache compression (KVzip) in pure-functional JAX/Flax."""

from kvzip_jax.cache import KVCache, LayerCache, init_cache
from kvzip_jax.config import ModelConfig
from kvzip_jax.models.transformer import forward
from kvzip_jax.weights.registry import LoadedModel, load

__all__ = ["KVCache", "LayerCache", "LoadedModel", "ModelConfig", "forward", "init_cache", "load"]
