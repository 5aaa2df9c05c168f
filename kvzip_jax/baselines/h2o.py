"""H2O (heavy hitters, prefill version): a pair's score is the attention it accumulates, the sum of the float32
softmax weights it receives from every real query row of the context (and of a question appended after it), per
query head, then the max over the G query heads of its KV head; the last w tokens of [context | question] are a
recent window kept whatever their score (+inf). This is KVCache-Factory's H2OKVCluster.update_kv
(pyramidkv/pyramidkv_utils.py: attn_weights[..., :-w].sum(dim=-2), then topk(C - w) plus the window) and the
accumulated score of H2O's own code (FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py, hh_score). The window
is SnapKV's (32, or 16 under 1,024 context tokens: KVCache-Factory's init_H2O default is 32, the KVzip paper's
baselines use 16 for short contexts). The KVzip paper ran H2O with the max instead of the sum ("max beat mean");
that variant is not kept here.

Einsum legend: B batch, T query positions, S key slots, C cache capacity, K KV heads, G query heads per KV head,
H head dim, L layers, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.baselines.observe import context_columns, observe_span, real_rows, to_slots, window_columns
from kvzip_jax.baselines.snapkv import window_sizes
from kvzip_jax.config import ModelConfig
from kvzip_jax.models.observer import AttentionView, map_key_blocks, take_keys

DEFAULT_CHUNK = 512  # tokens replayed per observed pass (memory only: the sums do not depend on it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class H2OObserver:
    """Per layer [B, K, G, C]: the softmax weight each key slot accumulates from the real rows of the span, per
    query head (the max over the GQA group comes after the sums over every span: h2o_scores).

    The weights are never materialised: a key's sum over rows, sum_t exp(s_t - lse_t), is reduced block by block
    from its logits s and each row's log-normaliser lse, which the forward's attention returns."""

    num_valid: jax.Array  # [B] real span tokens; the rest is padding

    def __call__(self, view: AttentionView) -> jax.Array:
        T = view.q.shape[1]
        qm = (view.q.astype(jnp.float32) * view.scale).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
        keys = jnp.concatenate([view.k, view.k_new.astype(view.k.dtype)], axis=2).astype(jnp.float32)  # [B,K,S,H]
        visible = view.mask & real_rows(self.num_valid, T)[:, None, :, None]  # [B, K, T, S]

        def block_sum(start, size):  # [B, K, size, G] weight sums of keys [start, start + size)
            kb, vis = take_keys(keys, start, size, axis=2), take_keys(visible, start, size, axis=3)
            stat = jnp.einsum("BKGTH,BKSH->BKGTS", qm, kb) - view.lse[..., None]  # log softmax weights
            return jnp.where(vis[:, :, None], jnp.exp(stat), 0.0).sum(axis=3).transpose(0, 1, 3, 2)

        stat = map_key_blocks(block_sum, keys.shape[2])  # [B, K, S, G]
        return jax.vmap(lambda head_stat: to_slots(view, head_stat), in_axes=3, out_axes=2)(stat)


def h2o_scores(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    prefix_len: jax.Array,
    context_len: jax.Array,
    context_tokens: jax.Array,
    question=None,
    chunk: int = DEFAULT_CHUNK,
    window: int | None = None,
) -> jax.Array:
    """H2O scores [L, B, K, n] of the context pairs of a cache holding [prefix | context]; the recent window's
    columns are +inf.

    context_tokens [B, n] right-padded; question: (tokens [B, Tq], lengths [B]) or None; window: a fixed window size
    (default: snapkv.window_sizes per row). The context is replayed in the fewest chunks of at most `chunk` tokens
    (observe_span), whose accumulated weights add up.
    """
    B, n = context_tokens.shape
    num_chunks = -(-n // chunk)
    width = -(-n // num_chunks)  # chunks of equal width: 640 tokens go as 2 x 320, not 512 + 512
    padded = jnp.pad(context_tokens, ((0, 0), (0, num_chunks * width - n)))  # [B, chunks x width]

    def visit(c, total):
        first = c * width
        tokens = jax.lax.dynamic_slice_in_dim(padded, first, width, axis=1)  # [B, width]
        num_valid = jnp.clip(context_len - first, 0, width)  # [B]
        start = prefix_len + jnp.minimum(first, context_len)  # a finished row replays nothing at its end
        observed = observe_span(params, cfg, cache, tokens, start, num_valid, H2OObserver(num_valid))
        return total + jnp.stack(observed)  # [L, B, K, G, C]

    C = cache.capacity
    total = jnp.zeros((cfg.num_layers, B, cfg.num_kv_heads, cfg.group_size, C), jnp.float32)  # [L, B, K, G, C]
    total = jax.lax.fori_loop(0, num_chunks, visit, total)
    q_len = jnp.zeros_like(context_len)
    if question is not None:
        tokens, q_len = question
        observed = observe_span(params, cfg, cache, tokens, prefix_len + context_len, q_len, H2OObserver(q_len))
        total = total + jnp.stack(observed)
    scores = context_columns(total.max(axis=3), prefix_len, context_len, n)  # [L, B, K, n]: max over the group
    in_window = window_columns(context_len, q_len, window_sizes(context_len, window), n)  # [B, n]
    return jnp.where(in_window[None, :, None, :], jnp.inf, scores)
