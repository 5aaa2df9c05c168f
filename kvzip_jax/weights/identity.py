"""Model identity: short stable hashes of a model's config, of its parameters and of its tokenizer, to tell when
results (a sweep's records, a saved cache) were made with another model.

The parameter fingerprint reads every leaf's path, shape and dtype and up to SAMPLES values spread evenly over it, so
it costs milliseconds even for a large model, and any retrained, requantised or differently converted weights change
it (they change nearly every value).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import ModelConfig

SAMPLES = 4096  # values read per parameter leaf


def config_hash(cfg: ModelConfig) -> str:
    """16 hex digits of the config's model fields (sorted JSON of to_dict)."""
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def params_fingerprint(params) -> str:
    """16 hex digits from every leaf's path, shape, dtype and an even sample of its values."""
    digest = hashlib.sha256()
    for path, leaf in sorted(
        jax.tree_util.tree_leaves_with_path(params), key=lambda item: jax.tree_util.keystr(item[0])
    ):
        flat = jnp.ravel(leaf)
        index = np.unique(np.linspace(0, max(flat.size - 1, 0), min(SAMPLES, flat.size)).astype(np.int64))
        sample = np.asarray(flat[index], np.float32) if flat.size else np.zeros(0, np.float32)
        digest.update(f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)} {leaf.dtype}\n".encode())
        digest.update(sample.tobytes())
    return digest.hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """16 hex digits of a tokenizer's vocabulary, special tokens and chat template."""
    record = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(map(str, tokenizer.all_special_ids)),
        "template": getattr(tokenizer, "chat_template", None) or "",
    }
    return hashlib.sha256(json.dumps(record, default=str).encode()).hexdigest()[:16]


def model_identity(cfg: ModelConfig, params) -> dict[str, str]:
    """{"config": config_hash, "params": params_fingerprint}."""
    return {"config": config_hash(cfg), "params": params_fingerprint(params)}


def package_version(name: str) -> str:
    """The installed version of a package (e.g. "kvzip-jax", "jax"), or "unknown"."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"
