"""score_and_evict: one reconstruction scoring pass, then a masked compressed cache at a ratio.

    compress = jax.jit(kvzip.score_and_evict)
    masked, scores = compress(params, cfg, cache, reread, 0.3)      # ratio is an array: no recompilation
    ragged = kv.pack(masked, room=64)                                 # only kept pairs stored

Static choices live in KVzipConfig (hashable, registered static), so jit needs no extra arguments.
"""

from __future__ import annotations

import dataclasses

import jax

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip.eviction import LEVELS, keep_mask
from kvzip_jax.kvzip.scoring import VARIANTS, RereadInputs, evictable_layers, score


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class KVzipConfig:
    """level: pair | pair-uniform | layer | head. variant: softmax (KVzip) | logits (the paper's softmax-free
    variant: raw logits, not normalised per query row; docs/results.md measures it). kvzip_plus: KVzip+
    normalisation (divide by the query's hidden-state norm, times |W_O v|)."""

    level: str = "pair"
    variant: str = "softmax"
    kvzip_plus: bool = False

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")


def score_and_evict(
    params, cfg: ModelConfig, cache: kv.KVCache, reread: RereadInputs, ratio, config: KVzipConfig = KVzipConfig()
):
    """Scores the context pairs of cache ([prefix | context] per row) and masks all but a `ratio` of them.

    Returns (masked cache, scores [L, B, K, n]). One scoring pass serves any number of ratios: call
    `kv.mask_context(cache, keep_mask(scores, ...), prefix_len, context_len)` again with another ratio. Only the
    full-attention layers are scored and evicted (Gemma 3's sliding-window layers keep their window).
    """
    scores = score(params, cfg, cache, reread, config.variant, config.kvzip_plus)
    keep = keep_mask(scores, reread.context_len, ratio, config.level, evictable_layers(cfg))
    return kv.mask_context(cache, keep, reread.prefix_len, reread.context_len), scores
