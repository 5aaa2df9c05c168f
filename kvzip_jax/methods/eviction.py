"""Eviction methods: score every context pair once, then mask all but a ratio of them (a masked cache; kv.pack
stores only the kept pairs). KVzip and the baselines of its paper (baselines/), each under its own budget rule.

Einsum legend: L layers, B batch, K KV heads, n context columns.
"""

from __future__ import annotations

import functools

from kvzip_jax import baselines, kvzip
from kvzip_jax import cache as kv
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.kvzip.scoring import evictable_layers
from kvzip_jax.methods.registry import Inputs, Method, NoOptions, register


def _masked(cache: kv.KVCache, inputs: Inputs, keep) -> kv.KVCache:
    return kv.mask_context(cache, keep, inputs.prefix_len, inputs.context_len)


def _kvzip_scores(params, cfg, cache, inputs: Inputs, options: kvzip.KVzipConfig):
    """[L, B, K, n] KVzip's scores: the ones given when they are what the options ask, else one reread pass."""
    if inputs.kvzip_scores is not None and options.variant == "softmax" and not options.kvzip_plus:
        return inputs.kvzip_scores
    return kvzip.score(params, cfg, cache, inputs.reread, options.variant, options.kvzip_plus)


def _kvzip_finish(params, cfg, cache, inputs: Inputs, scores, ratio, options: kvzip.KVzipConfig):
    keep = keep_mask(scores, inputs.context_len, ratio, options.level, evictable_layers(cfg))  # [L, B, K, n]
    return _masked(cache, inputs, keep)


def _baseline_prepare(name: str, params, cfg, cache, inputs: Inputs, options):
    """[L, B, K, n] the baseline's scores (baselines.baseline_scores)."""
    return baselines.baseline_scores(
        name,
        params,
        cfg,
        cache,
        inputs.prefix_len,
        inputs.context_len,
        inputs.context_tokens,
        question=inputs.question,
        key=inputs.key,
    )


def _baseline_finish(name: str, params, cfg, cache, inputs: Inputs, scores, ratio, options):
    keep = baselines.keep_for(name, scores, inputs.context_len, ratio, evictable_layers(cfg))  # [L, B, K, n]
    return _masked(cache, inputs, keep)


def _baseline(name: str, question_aware: bool, paper: str, description: str, needs: tuple[str, ...]) -> Method:
    return Method(
        name=name,
        family="eviction",
        question_aware=question_aware,
        paper=paper,
        description=description,
        options=NoOptions(),
        prepare=functools.partial(_baseline_prepare, name),
        finish=functools.partial(_baseline_finish, name),
        needs=needs,
        uses=("question",) if question_aware else (),
    )


KVZIP = register(
    Method(
        name="kvzip",
        family="eviction",
        question_aware=False,
        paper="KVzip, arXiv 2505.23416",
        description="the model rereads the context over its own cache; the pairs that reread attends to least go, in "
        "one top-k over every layer and head (option level: pair, pair-uniform, layer, head)",
        options=kvzip.KVzipConfig(),
        prepare=_kvzip_scores,
        finish=_kvzip_finish,
        needs=("reread",),
        uses=("kvzip_scores",),
    )
)
register(
    Method(
        name="kvzip-plus",
        family="eviction",
        question_aware=False,
        paper="KVzip+, kvpress (KVzap, arXiv 2601.07891)",
        description="KVzip's reread with each score normalised: a reread row's attention over the norm of its "
        "query's hidden state, times the norm of the head's write W_O v to the residual stream",
        options=kvzip.KVzipConfig(kvzip_plus=True),
        prepare=_kvzip_scores,
        finish=_kvzip_finish,
        needs=("reread",),
    )
)
_REPLAY = ("context_tokens",)  # the context's ids: replayed by the attention baselines, its width for the others
register(
    _baseline(
        "h2o",
        True,
        "H2O, arXiv 2306.14048",
        "accumulated attention of the context's tokens and the question's; the same count in every layer",
        _REPLAY,
    )
)
register(
    _baseline(
        "snapkv",
        True,
        "SnapKV, arXiv 2404.14469",
        "attention of an observation window (the question, "
        "else the context's last tokens), pooled; the same count in every layer",
        _REPLAY,
    )
)
register(
    _baseline(
        "pyramidkv",
        True,
        "PyramidKV, arXiv 2406.02069",
        "SnapKV's scores under layer budgets that shrink with depth",
        _REPLAY,
    )
)
register(
    _baseline(
        "streamingllm",
        False,
        "StreamingLLM, arXiv 2309.17453",
        "the first tokens (attention sinks) and the most recent ones",
        _REPLAY,
    )
)
register(
    _baseline(
        "random",
        False,
        "KVzip's random baseline",
        "uniformly random pairs, the same count in every layer",
        ("context_tokens", "key"),
    )
)
