"""H2O (prefill version, as in KVCache-Factory): a pair's score is the largest attention weight it receives from
any real query and any query head of its GQA group during the self-attention of the context (and of a question
appended after it).

Einsum legend: B batch, T query positions, S key slots, C cache capacity, K KV heads, G query heads per KV head,
H head dim, L layers, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.baselines.observe import context_columns, observe_span, real_rows, to_slots
from kvzip_jax.config import ModelConfig
from kvzip_jax.models.attention import AttentionView, map_key_blocks

DEFAULT_CHUNK = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class H2OObserver:
    """Per layer [B, K, C]: the max softmax weight each key slot receives from the real rows of the span.

    The weights are never materialised: a key's max over rows and query heads, max exp(s - lse), is reduced block
    by block from its logits s and each row's log-normaliser lse, which the forward's attention returns."""

    num_valid: jax.Array  # [B] real span tokens; the rest is padding

    def __call__(self, view: AttentionView) -> jax.Array:
        T = view.q.shape[1]
        qm = (view.q.astype(jnp.float32) * view.scale).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
        keys = jnp.concatenate([view.k, view.k_new.astype(view.k.dtype)], axis=2).astype(jnp.float32)  # [B,K,S,H]
        visible = view.mask & real_rows(self.num_valid, T)[:, None, :, None]  # [B, K, T, S]

        def block_max(kb, vis):  # keys [B, K, size, H], visible [B, K, T, size] -> [B, K, size]
            stat = jnp.einsum("BKGTH,BKSH->BKGTS", qm, kb) - view.lse[..., None]  # log softmax weights
            return jnp.exp(jnp.where(vis[:, :, None], stat, -jnp.inf).max(axis=(2, 3)))

        stat = map_key_blocks(block_max, (keys, 2), (visible, 3))  # [B, K, S]
        return to_slots(view, stat)


def h2o_scores(params, cfg: ModelConfig, cache: kv.KVCache, prefix_len: jax.Array, context_len: jax.Array,
               context_tokens: jax.Array, question=None, chunk: int = DEFAULT_CHUNK) -> jax.Array:
    """H2O scores [L, B, K, n] of the context pairs of a cache holding [prefix | context].

    context_tokens [B, n] right-padded; question: (tokens [B, Tq], lengths [B]) or None. The context is replayed
    in the fewest chunks of at most `chunk` tokens (observe_span), combined by max.
    """
    B, n = context_tokens.shape
    num_chunks = -(-n // chunk)
    width = -(-n // num_chunks)  # chunks of equal width: 640 tokens go as 2 x 320, not 512 + 512
    padded = jnp.pad(context_tokens, ((0, 0), (0, num_chunks * width - n)))  # [B, chunks x width]

    def visit(c, best):
        first = c * width
        tokens = jax.lax.dynamic_slice_in_dim(padded, first, width, axis=1)  # [B, width]
        num_valid = jnp.clip(context_len - first, 0, width)  # [B]
        start = prefix_len + jnp.minimum(first, context_len)  # a finished row replays nothing at its end
        observed = observe_span(params, cfg, cache, tokens, start, num_valid, H2OObserver(num_valid))
        return jnp.maximum(best, jnp.stack(observed))  # [L, B, K, C]

    C = cache.capacity
    best = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, C), jnp.float32)  # [L, B, K, C]
    best = jax.lax.fori_loop(0, num_chunks, visit, best)
    if question is not None:
        tokens, lengths = question
        observed = observe_span(params, cfg, cache, tokens, prefix_len + context_len, lengths, H2OObserver(lengths))
        best = jnp.maximum(best, jnp.stack(observed))
    return context_columns(best, prefix_len, context_len, n)
