"""Compaction methods (Attention Matching, arXiv 2602.16284): the context's pairs replaced by fewer selected keys
with a fitted per-key bias and fitted values (matching/). Each entry is a named set of MatchingConfig choices; the
ratio is static (it sets the fit's shapes).

prepare captures the reference queries (one reread-style pass; Inputs.queries when a caller already holds them),
finish compacts at a ratio; on-policy entries (-op) refit layer by layer from the queries of the already compacted
layers below, each step jitted on its own (eager).
"""

from __future__ import annotations

import dataclasses

from kvzip_jax import matching
from kvzip_jax.matching.budgets import BudgetProfileError, load_profile
from kvzip_jax.matching.config import check_choices
from kvzip_jax.methods.registry import Inputs, Method, register

PAPER = "Attention Matching, arXiv 2602.16284"


def configured(options: matching.MatchingConfig, inputs: Inputs, ratio) -> matching.MatchingConfig:
    """The options at `ratio`, taking the self-study source when the inputs carry its probes."""
    sources = options.sources
    if inputs.probes is not None and "self-study" not in sources:
        sources = sources + ("self-study",)
    return dataclasses.replace(options, ratio=float(ratio), sources=sources)


def _prepare(params, cfg, cache, inputs: Inputs, options: matching.MatchingConfig):
    """The reference queries (given, or captured here; None for on-policy uniform budgets, which need no full
    pass)."""
    if inputs.queries is not None:
        return inputs.queries
    config = configured(options, inputs, 1.0)
    if config.on_policy and config.budget != "global":
        return None
    return matching.reference_queries(
        params, cfg, cache, inputs.reread, config.sources, config.query_cap, config.needs_kvzip_scores, inputs.probes
    )


def _finish(params, cfg, cache, inputs: Inputs, queries, ratio, options: matching.MatchingConfig):
    config = configured(options, inputs, ratio)
    if config.on_policy:
        return matching.compact(params, cfg, cache, inputs.reread, config, inputs.probes, queries=queries)[0]
    return matching.compact_with(queries, cfg, cache, inputs.reread, config)[0]


def _resolve(options: matching.MatchingConfig, model_name: str | None, cfg) -> matching.MatchingConfig:
    """Loads the model's budget profile for a profile budget given none; refuses choices the model's attention
    cannot take (matching.LatentValuesError)."""
    if options.budget == "profile" and options.profile is None:
        if model_name is None:
            raise BudgetProfileError("this method takes the model's budget profile: give the model's name")
        options = dataclasses.replace(options, profile=load_profile(model_name))
    if cfg is not None:
        check_choices(cfg, options)
    return options


def attention_matching(name: str, description: str, **choices) -> Method:
    """An Attention Matching entry of MatchingConfig choices (not registered: pass it to register)."""
    options = matching.MatchingConfig(**choices)
    return Method(
        name=name,
        family="compaction",
        question_aware=False,
        paper=PAPER,
        description=description,
        options=options,
        prepare=_prepare,
        finish=_finish,
        needs=("reread",),
        uses=("queries", "probes"),
        static_ratio=True,
        eager=options.on_policy,
        resolve=_resolve,
    )


_KVZIP_AM = dict(selector="kvzip", budget_scores="kvzip")
register(
    attention_matching(
        "am-hak",
        "keys of highest attention from the reread's queries; per-key bias and "
        "values fitted in closed form; global budgets by attention",
        selector="hak",
    )
)
register(
    attention_matching(
        "am-omp",
        "keys chosen by orthogonal matching pursuit on the attention mass; bias and values fitted",
        selector="omp",
    )
)
register(attention_matching("kvzip-am", "KVzip's selection and budgets, then the bias and values fitted", **_KVZIP_AM))
register(
    attention_matching(
        "am-hak-kb",
        "HAK's keys within KVzip's own per-head budgets (no head cap)",
        selector="hak",
        budget_scores="kvzip",
        head_cap=1.0,
    )
)
register(
    attention_matching(
        "am-hak-pb", "HAK's keys under the model's searched per-head budget profile", selector="hak", budget="profile"
    )
)
register(
    attention_matching(
        "am-hak-op",
        "am-hak fitted layer by layer to the queries of the layers already compacted (on-policy)",
        selector="hak",
        on_policy=True,
    )
)
register(attention_matching("kvzip-am-op", "kvzip-am fitted layer by layer (on-policy)", **_KVZIP_AM, on_policy=True))
register(
    attention_matching(
        "am-hak-fl",
        "am-hak with each token's value latent fitted apart from its key (multi-head latent attention only)",
        selector="hak",
        latent_values="fitted",
    )
)
