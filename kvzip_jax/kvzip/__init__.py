"""KVzip: query-agnostic KV-cache compression by context reconstruction (arXiv 2505.23416)."""

from kvzip_jax.kvzip.budget import RatioError, kept_count
from kvzip_jax.kvzip.compress import KVzipConfig, score_and_evict
from kvzip_jax.kvzip.eviction import LEVELS, keep_mask
from kvzip_jax.kvzip.head_level import HeadScoresError, head_keep, head_scores, load_head_scores, save_head_scores
from kvzip_jax.kvzip.scoring import (
    VARIANTS,
    CacheLayoutError,
    RereadInputs,
    check_context_cache,
    reread_inputs,
    score,
    without_host_callbacks,
)

evict = keep_mask

__all__ = [
    "LEVELS",
    "VARIANTS",
    "CacheLayoutError",
    "HeadScoresError",
    "KVzipConfig",
    "RatioError",
    "RereadInputs",
    "check_context_cache",
    "evict",
    "head_keep",
    "head_scores",
    "keep_mask",
    "kept_count",
    "load_head_scores",
    "reread_inputs",
    "save_head_scores",
    "score",
    "score_and_evict",
    "without_host_callbacks",
]
