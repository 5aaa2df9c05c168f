"""What trained scorers read and give, per context token: the hidden state entering each attention layer (after its
input norm), and a scorer's per-(layer, KV head) scores of it, from one forward over the context.

The context is fed again over the cache's prefix (a view of the cache that holds only the prefix; the original is
untouched), chunk after chunk in one scanned forward, so the states are those of the prefill that made the cache.

Einsum legend: L layers, C chunks, B batch, T tokens of a chunk, n context columns, K KV heads, D model width.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import UnsupportedArchitectureError
from kvzip_jax.models.transformer import forward
from kvzip_jax.scorers.scorer import Scorer

CHUNK = 512  # context tokens per scanned forward (generate.DEFAULT_CHUNK)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HiddenObserver:
    """Observes a layer's normed attention input: [B, T, D] float32 (the layer attends as without an observer)."""

    hidden_only = True

    def of_hidden(self, layer: int, hidden: jax.Array) -> jax.Array:
        return hidden.astype(jnp.float32)

    def __call__(self, view) -> jax.Array:
        return self.of_hidden(view.layer, view.hidden)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScorerObserver:
    """Observes a layer's scores by a trained scorer: [B, K, T] float32 (Scorer.layer_scores; the layer attends as
    without an observer)."""

    scorer: Scorer
    hidden_only = True

    def of_hidden(self, layer: int, hidden: jax.Array) -> jax.Array:
        return self.scorer.layer_scores(layer, hidden)

    def __call__(self, view) -> jax.Array:
        return self.of_hidden(view.layer, view.hidden)


def prefix_view(cache: kv.KVCache, prefix_len: jax.Array) -> kv.KVCache:
    """The dense cache as if only its first prefix_len [B] tokens were written (later slots are overwritten)."""
    for layer in cache.layers:
        if not isinstance(layer, kv.LayerCache) or layer.keep is not None or layer.bias is not None:
            raise ValueError("trained scorers read a dense cache as the prefill left it (not masked or compacted)")
    prefix = jnp.asarray(prefix_len, jnp.int32)
    layers = tuple(
        dataclasses.replace(layer, lengths=jnp.broadcast_to(prefix[:, None], layer.lengths.shape))
        for layer in cache.layers
    )
    return kv.KVCache(layers=layers, next_position=prefix)


def observe_context(
    params, cfg: ModelConfig, cache: kv.KVCache, prefix_len, context_len, context_tokens, observer, chunk: int = CHUNK
) -> jax.Array:
    """Each layer's observer output over the context tokens [B, n] (right-padded; context_len [B] real), fed at
    positions prefix_len + i over the cache's prefix: [C, L, ...] per chunk, the chunk's T = `chunk` tokens last or
    next to last as the observer returns them."""
    if cfg.mla is not None:
        raise UnsupportedArchitectureError("trained scorers score KV heads: multi-head latent attention has none")
    B, n = context_tokens.shape
    C = -(-n // chunk)
    tokens = jnp.pad(context_tokens, ((0, 0), (0, C * chunk - n))).reshape(B, C, chunk).transpose(1, 0, 2)
    context_len = jnp.asarray(context_len, jnp.int32)

    def step(view, c):  # one chunk: [B, T] tokens at their positions over the view
        num_new = jnp.clip(context_len - c * chunk, 0, chunk)  # [B]
        positions = view.next_position[:, None] + jnp.arange(chunk, dtype=jnp.int32)  # [B, T]
        _, view, aux = forward(params, tokens[c], positions, view, cfg, observer, num_new=num_new, logits=None)
        return view, jnp.stack(aux["observed"])

    _, observed = jax.lax.scan(step, prefix_view(cache, prefix_len), jnp.arange(C))
    return observed


def context_hidden(params, cfg: ModelConfig, cache, prefix_len, context_len, context_tokens, chunk=CHUNK):
    """[L, B, n, D] float32: every layer's normed attention input at each context token."""
    n = context_tokens.shape[1]
    observed = observe_context(params, cfg, cache, prefix_len, context_len, context_tokens, HiddenObserver(), chunk)
    C, L, B, T, D = observed.shape
    return observed.transpose(1, 2, 0, 3, 4).reshape(L, B, C * T, D)[:, :, :n]


def context_scores(params, cfg: ModelConfig, cache, prefix_len, context_len, context_tokens, scorer, chunk=CHUNK):
    """[L, B, K, n] float32: the scorer's score of every context pair (columns past a row's context_len: -inf)."""
    n = context_tokens.shape[1]
    observer = ScorerObserver(scorer)
    observed = observe_context(params, cfg, cache, prefix_len, context_len, context_tokens, observer, chunk)
    C, L, B, K, T = observed.shape
    scores = observed.transpose(1, 2, 3, 0, 4).reshape(L, B, K, C * T)[..., :n]
    in_context = jnp.arange(n) < jnp.asarray(context_len)[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], scores, -jnp.inf)


def prefill_scores(params, cfg: ModelConfig, rows, scorer: Scorer, **prefill_options):
    """Prefills token rows (generate.prefill_observed) with the scorer on every layer: -> (last logits [B, V], cache,
    scores [L, B, K, T]) with column t the score of token t of each row (past a row's length: padding)."""
    from kvzip_jax import generate as gen

    return gen.prefill_observed(params, cfg, rows, ScorerObserver(scorer), **prefill_options)
