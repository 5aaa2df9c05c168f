"""Attention Matching (arXiv 2602.16284): a shorter synthetic cache fitted in closed form.

So far: the closed-form fit of one KV head (`fit_head`: NNLS biases on attention mass, least-squares values) and two
key selectors, Highest-Attention-Keys and exact Orthogonal Matching Pursuit. Reference queries from the cache,
budgets and the compacted cache pytree come next.
"""

from kvzip_jax.matching.fit import attend, fit_head, mixture, nnls_box
from kvzip_jax.matching.select import (
    AGGREGATIONS,
    attention_key_scores,
    highest_attention_keys,
    orthogonal_matching_pursuit,
)

__all__ = ["AGGREGATIONS", "attend", "attention_key_scores", "fit_head", "highest_attention_keys", "mixture",
           "nnls_box", "orthogonal_matching_pursuit"]
