"""Trained scorers: a KV pair's KVzip score predicted from the hidden state entering its layer, with no reread.

Modules: gate (Fast KVzip's low-rank sink-attention gate), linear (KVzap's ridge regressor), scorer (either as one
pytree), features (the attention inputs of a cache's context and a scorer's scores of them), train (the gates'
optax training), store (orbax weights and a manifest naming the model), data, extract and pipeline (the training
data: the model's own texts, their sampled attention inputs and KVzip / KVzip+ scores; the fit), decoding
(compression while decoding: the cache cut back to a budget every block of generated tokens).
"""

from kvzip_jax.scorers.scorer import KINDS, Scorer

__all__ = ["KINDS", "Scorer"]
