"""KVzip: query-agnostic KV-cache compression by context reconstruction (arXiv 2505.23416)."""

from kvzip_jax.kvzip.compress import KVzipConfig, score_and_evict
from kvzip_jax.kvzip.eviction import LEVELS, RatioError, keep_mask
from kvzip_jax.kvzip.scoring import RereadInputs, reread_inputs, score

evict = keep_mask

__all__ = ["KVzipConfig", "LEVELS", "RatioError", "RereadInputs", "evict", "keep_mask", "reread_inputs", "score",
           "score_and_evict"]
