"""Attention Matching (arXiv 2602.16284): a shorter synthetic cache fitted in closed form, on the same cache pytree.

    compact = jax.jit(matching.compact)
    compacted, counts = compact(params, cfg, cache, reread, matching.MatchingConfig(ratio=0.1, selector="hak"))

Modules: queries (reference queries: repeat, context, self-study), self_study (the turns the model writes about a
context, for the self-study source), select (Highest-Attention-Keys, Orthogonal Matching Pursuit), fit (NNLS biases,
least-squares values, one KV head), refine (optax steps from the closed form), budgets (uniform, global or
searched-profile per-head counts), config (MatchingConfig), heads (per-head selection and fit over a layer
stack), compact (the whole cache), on_policy (layer by layer).
"""

from kvzip_jax.matching import self_study
from kvzip_jax.matching.budgets import BUDGETS, BudgetProfileError, head_counts, load_profile
from kvzip_jax.matching.compact import compact, compact_with
from kvzip_jax.matching.config import (
    LATENT_VALUES,
    SELECTORS,
    LatentValuesError,
    MatchingConfig,
    check_choices,
    effective_ratio,
)
from kvzip_jax.matching.fit import attend, fit_head, mixture, nnls_box
from kvzip_jax.matching.queries import SOURCES, Probes, ReferenceQueries, reference_queries, thinned
from kvzip_jax.matching.refine import matching_loss, refine_head
from kvzip_jax.matching.select import (
    AGGREGATIONS,
    attention_key_scores,
    highest_attention_keys,
    orthogonal_matching_pursuit,
)

__all__ = [
    "AGGREGATIONS",
    "BUDGETS",
    "LATENT_VALUES",
    "SELECTORS",
    "SOURCES",
    "BudgetProfileError",
    "LatentValuesError",
    "MatchingConfig",
    "Probes",
    "ReferenceQueries",
    "attend",
    "attention_key_scores",
    "check_choices",
    "compact",
    "compact_with",
    "effective_ratio",
    "fit_head",
    "head_counts",
    "highest_attention_keys",
    "load_profile",
    "mixture",
    "nnls_box",
    "matching_loss",
    "orthogonal_matching_pursuit",
    "reference_queries",
    "refine_head",
    "self_study",
    "thinned",
]
