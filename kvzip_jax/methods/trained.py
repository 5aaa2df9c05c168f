"""Eviction by trained scorers (kvzip_jax/scorers/): every context pair scored from the hidden state entering its
layer, with no reread; the lowest evicted under KVzip's exact budget rules (a masked cache).

Einsum legend: L layers, B batch, K KV heads, n context columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.kvzip.eviction import LEVELS, keep_mask
from kvzip_jax.kvzip.scoring import evictable_layers
from kvzip_jax.methods.registry import Inputs, Method, MethodError, register
from kvzip_jax.scorers.features import context_scores
from kvzip_jax.scorers.scorer import KINDS

THRESHOLD_WINDOW = 128  # DMSPress's: the last context tokens a threshold never evicts


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    """kind: the scorer it reads (scorers.KINDS). level: KVzip's budget levels. window: the last context tokens
    always kept; None: window_fraction of the context with a ratio (Fast KVzip's prefill keeps 2%), THRESHOLD_WINDOW
    tokens with a threshold. threshold: None, or evict every pair scoring below it outside the window, whatever the
    ratio (each head keeps what passes: the ratio reached is an outcome, DMSPress's rule)."""

    kind: str = "gate"
    level: str = "pair"
    window: int | None = None
    window_fraction: float = 0.02
    threshold: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if not 0 <= self.window_fraction <= 1:
            raise ValueError(f"window_fraction must be in [0, 1], got {self.window_fraction}")


def recent_window(context_len: jax.Array, options: ScorerOptions) -> jax.Array:
    """[B] int32 context tokens at the end of each row that are always kept."""
    if options.window is not None or options.threshold is not None:
        window = THRESHOLD_WINDOW if options.window is None else options.window
        return jnp.minimum(jnp.int32(window), context_len)
    return jnp.floor(options.window_fraction * context_len).astype(jnp.int32)


def _prepare(params, cfg, cache: kv.KVCache, inputs: Inputs, options: ScorerOptions) -> jax.Array:
    """[L, B, K, n] the scorer's scores, the recent window's set to +inf (kept first)."""
    if inputs.scorer.kind != options.kind:
        raise MethodError(f"this method reads a {options.kind} scorer; the one given is a {inputs.scorer.kind}")
    context_len = jnp.asarray(inputs.context_len, jnp.int32)
    scores = context_scores(
        params, cfg, cache, inputs.prefix_len, context_len, inputs.context_tokens, inputs.scorer
    )  # [L, B, K, n]
    n = scores.shape[-1]
    column = jnp.arange(n)
    recent = (column >= (context_len - recent_window(context_len, options))[:, None]) & (column < context_len[:, None])
    return jnp.where(recent[None, :, None, :], jnp.inf, scores)


def threshold_mask(scores: jax.Array, context_len: jax.Array, threshold, evictable: tuple[int, ...]) -> jax.Array:
    """keep [L, B, K, n]: context pairs scoring at least `threshold` in the evictable layers, every context pair in
    the others (scores [L, B, K, n], context_len [B])."""
    L, _, _, n = scores.shape
    in_context = (jnp.arange(n) < context_len[:, None])[None, :, None, :]  # [1, B, 1, n]
    scored = jnp.asarray([layer in evictable for layer in range(L)])[:, None, None, None]  # [L, 1, 1, 1]
    return in_context & (~scored | (scores >= threshold))


def _finish(params, cfg, cache: kv.KVCache, inputs: Inputs, scores, ratio, options: ScorerOptions) -> kv.KVCache:
    """The masked cache at `ratio` under options.level, or, with options.threshold, of what passes it (ratio
    ignored)."""
    if options.threshold is None:
        keep = keep_mask(scores, inputs.context_len, ratio, options.level, evictable_layers(cfg))  # [L, B, K, n]
    else:
        keep = threshold_mask(scores, inputs.context_len, options.threshold, evictable_layers(cfg))
    return kv.mask_context(cache, keep, inputs.prefix_len, inputs.context_len)


register(
    Method(
        name="fast-kvzip",
        family="eviction",
        question_aware=False,
        paper="Fast KVzip, arXiv 2601.17668",
        description="a low-rank sink-attention gate per layer, trained on KVzip's scores, scores each pair from its "
        f"hidden state: no reread; the recent 2% of the context kept ({THRESHOLD_WINDOW} tokens with a threshold)",
        options=ScorerOptions(),
        prepare=_prepare,
        finish=_finish,
        needs=("context_tokens", "scorer"),
    )
)
register(
    Method(
        name="kvzap",
        family="eviction",
        question_aware=False,
        paper="KVzap, arXiv 2601.07891",
        description="a linear regressor per layer, fitted in closed form to log KVzip+ scores, scores each pair from "
        f"its hidden state: no reread; the recent 2% of the context kept ({THRESHOLD_WINDOW} tokens with a threshold)",
        options=ScorerOptions(kind="linear"),
        prepare=_prepare,
        finish=_finish,
        needs=("context_tokens", "scorer"),
    )
)
