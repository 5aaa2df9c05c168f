"""kvzip-jax: query-agnostic KV-cache compression (KVzip) in pure-functional JAX/Flax."""
