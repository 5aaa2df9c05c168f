"""SnapKV: a context pair's score is how much attention the observation window (the last w tokens of
[context | question]) pays it: per query head, the sum of the window rows' float32 softmax weights (SnapKV's
snapkv_utils.py, SnapKVCluster.update_kv: attn[..., -w:, :-w].sum(dim=-2)), max-pooled over neighbouring context
columns (kernel 7, stride 1, same padding), then the max over the G query heads of its KV head (the KVzip paper
evicts before KV replication; its author's SnapKV, FastKVzip prefill/attention/baseline.py, takes the group max).
The window's own context pairs score +inf: always kept, paid for by the layer's budget (budgets.keep_by_layer).
Window 32, or 16 for contexts under 1,024 tokens, and max-pool kernel 7: the KVzip paper's App. A settings, from
SnapKV's own LongBench configs (experiments/LongBench/config/ablation_c*_w32_k7_maxpool.json).

As in SnapKV's code, the pooling runs over the context columns before the window only (the window's columns do
not spill into their neighbours).

Einsum legend: B batch, T query positions, S key slots, C cache capacity, K KV heads, G query heads per KV head,
H head dim, L layers, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.baselines.observe import context_columns, observe_span, real_rows, to_slots, window_columns
from kvzip_jax.config import ModelConfig
from kvzip_jax.models.observer import AttentionView

WINDOW, SHORT_WINDOW, SHORT_CONTEXT = 32, 16, 1024  # KVzip paper App. A (SnapKV's w32 configs; 16 under 1K)
KERNEL = 7  # max-pool kernel: KVzip paper App. A, SnapKV's k7_maxpool configs


def window_sizes(context_len: jax.Array, window: int | None = None) -> jax.Array:
    """[B] int32 observation window per row: `window`, else 16 for contexts under 1,024 tokens and 32 above."""
    if window is not None:
        return jnp.full(context_len.shape, window, jnp.int32)
    return jnp.where(context_len < SHORT_CONTEXT, SHORT_WINDOW, WINDOW).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowObserver:
    """Per layer [B, K, C]: the window rows' summed softmax weight on each key slot, max over the GQA group."""

    num_valid: jax.Array  # [B] real span tokens
    window: jax.Array  # [B] the last `window` real rows form the observation window

    def __call__(self, view: AttentionView) -> jax.Array:
        T = view.q.shape[1]
        rows = real_rows(self.num_valid, T) & (jnp.arange(T) >= (self.num_valid - self.window)[:, None])  # [B, T]
        stat = jnp.einsum("BKGTS,BT->BKGS", view.probs, rows.astype(jnp.float32))  # [B, K, G, S]
        return to_slots(view, stat.max(axis=2))  # the max over G commutes with the later max-pool


def max_pool(x: jax.Array, kernel: int) -> jax.Array:
    """Max over `kernel` neighbouring columns of x [..., n], stride 1, same padding (-inf outside)."""
    pad = [(0, 0)] * (x.ndim - 1) + [(kernel // 2, (kernel - 1) // 2)]
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim, pad)


def snapkv_scores(
    params,
    cfg: ModelConfig,
    cache: kv.KVCache,
    prefix_len: jax.Array,
    context_len: jax.Array,
    context_tokens: jax.Array,
    question=None,
    window: int | None = None,
    kernel: int = KERNEL,
) -> jax.Array:
    """SnapKV scores [L, B, K, n] of the context pairs of a cache holding [prefix | context].

    context_tokens [B, n] right-padded; question: (tokens [B, Tq], lengths [B]) or None; window: a fixed window
    size (default: window_sizes' rule per row). One replay (observe_span) of the context's last max-window tokens
    followed by the question covers every window, also one straddling context and question.
    """
    B, n = context_tokens.shape
    w = window_sizes(context_len, window)  # [B]
    widest = WINDOW if window is None else window
    tail = jnp.minimum(context_len, widest)  # [B] context tokens replayed
    q_tokens, q_len = question if question is not None else (context_tokens[:, :0], jnp.zeros_like(context_len))
    Tq = q_tokens.shape[1]
    t = jnp.arange(widest + Tq)  # [T]
    index = (context_len - tail)[:, None] + t  # [B, T] context index of each replayed token
    tokens = jnp.take_along_axis(context_tokens, jnp.clip(index, 0, n - 1), axis=1)  # [B, T]
    if Tq:
        asked = jnp.take_along_axis(q_tokens, jnp.clip(t - tail[:, None], 0, Tq - 1), axis=1)  # [B, T]
        tokens = jnp.where(t < tail[:, None], tokens, asked)
    num_valid = tail + q_len  # [B]
    observed = observe_span(
        params, cfg, cache, tokens, prefix_len + context_len - tail, num_valid, WindowObserver(num_valid, w)
    )
    attention = context_columns(jnp.stack(observed), prefix_len, context_len, n)  # [L, B, K, n]

    in_window = window_columns(context_len, q_len, w, n)  # [B, n]
    before = (jnp.arange(n) < context_len[:, None]) & ~in_window  # [B, n] pooled columns
    pooled = max_pool(jnp.where(before[None, :, None, :], attention, -jnp.inf), kernel)  # [L, B, K, n]
    scores = jnp.where(before[None, :, None, :], pooled, -jnp.inf)
    return jnp.where(in_window[None, :, None, :], jnp.inf, scores)
