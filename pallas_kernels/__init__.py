"""Pallas kernels for kvzip-jax: a placeholder until the kernel issue.

The kernels arrive with that issue: score_max (KVzip's max-over-queries of softmax attention probabilities) and
ragged_decode (decode attention over a ragged compressed cache). Each lives beside its jnp oracle and runs in Pallas
interpret mode on CPU in the tests.
"""
