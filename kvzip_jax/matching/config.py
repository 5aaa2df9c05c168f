"""MatchingConfig: the static choices of an Attention Matching compaction, and the rules between them.

Budgets (budgets.py) are uniform, global, or a model's searched profile. `same_bytes` (default) counts the bias' 4
bytes per kept pair: a ratio keeps fewer pairs (x 2 H b / (2 H b + 4) for head dim H and b bytes per element, 0.8%
fewer at H = 64 in float32), so the compacted context pairs take about the bytes of the evicted ones at the same
ratio (to within the rounding of two integer budgets). The bias is stored per slot of a compacted layer, so the
never-compacted prefix and the tokens after the context pay its 4 bytes too (cache.used_bytes counts them). Without
the bias fit (fit_bias=False) the compaction adds no bias: the cache keeps the one it had, if any, and a ratio keeps
its pairs. An MLA token's value latent is its own latent by default ("kept"); "fitted" fits one apart from its key
(the split layout of models/mla.py, 2 R + dr per slot, which same_bytes counts).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from kvzip_jax import cache as kv
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import KvzipError
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.matching.budgets import BUDGETS, BudgetProfileError
from kvzip_jax.matching.fit import RIDGE
from kvzip_jax.matching.queries import SOURCES
from kvzip_jax.matching.select import AGGREGATIONS, OMP_UPPER

SELECTORS = ("hak", "omp", "kvzip")
BUDGET_SCORES = ("kvzip", "attention")
BIAS_BYTES = 4  # a float32 beta per kept pair
LATENT_VALUES = ("kept", "fitted")  # an MLA token's value latent: its own latent, or one fitted apart from its key


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MatchingConfig:
    """Static choices of a compaction (hashable: jit needs no extra arguments; the ratio sets shapes, so it lives here).

    ratio: fraction of context pairs kept, in (0, 1]. selector: hak | omp | kvzip. aggregate: HAK's aggregation over
    queries (rms | max | mean). budget: uniform | global | profile; budget_scores: what global budgets rank (KVzip's
    scores, or the reference queries' aggregated attention); head_cap: under global and profile budgets a head keeps
    at most this fraction of its context keys (the paper's 0.75; budgets.head_caps); profile: the profile budget's
    shares, one row per compacted layer of one share per KV head (budgets.load_profile).
    sources: reference query sources (queries.SOURCES); query_cap: most reference rows per KV head and layer;
    self_study_queries: most self-study rows per KV head and layer the fit takes, evenly spaced among those captured
    (queries.thinned; None: all), so that one capture serves several counts (off-policy only).
    omp_step, omp_refit: OMP's keys per step and steps per refit (1, 1: exact; 4, 2: AM-OMP-fast).
    on_policy: layer-sequential compaction (compact only): layer l is fitted to the queries of a model whose layers
    < l are already compacted; the sources are then repeat and self-study.
    refine_steps: Adam steps (matching.refine) on beta and C_v from the closed form, per head (0: none).
    value_ridge: the value fit's ridge towards the kept keys' own values, relative to the mean diagonal of its normal
    equations (fit.RIDGE: a least-squares fit; large: the kept values themselves, only beta fitted).
    fit_bias: fit beta to the attention mass (False: beta = 0, only the values fitted and refined, and the compacted
    cache carries no bias of its own; an ablation).
    latent_values: multi-head latent attention only: "kept" (a kept token's latent serves as key and value) or
    "fitted" (a value latent fitted apart from the key latent; the compacted layers take models/mla.py's split
    layout).
    """

    ratio: float = 0.1
    selector: str = "hak"
    aggregate: str = "rms"
    budget: str = "global"
    budget_scores: str = "attention"
    head_cap: float = 0.75
    profile: tuple[tuple[float, ...], ...] | None = None
    sources: tuple[str, ...] = ("repeat",)
    query_cap: int = 8192
    self_study_queries: int | None = None
    omp_step: int = 1
    omp_refit: int = 1
    same_bytes: bool = True
    on_policy: bool = False
    refine_steps: int = 0
    value_ridge: float = RIDGE
    fit_bias: bool = True
    latent_values: str = "kept"

    def __post_init__(self):
        check_ratio(self.ratio)
        for name, value, choices in (
            ("selector", self.selector, SELECTORS),
            ("aggregate", self.aggregate, AGGREGATIONS),
            ("budget", self.budget, BUDGETS),
            ("budget_scores", self.budget_scores, BUDGET_SCORES),
            ("latent_values", self.latent_values, LATENT_VALUES),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if not self.sources or set(self.sources) - set(SOURCES):
            raise ValueError(f"sources must be among {SOURCES}, got {self.sources}")
        if not 0 < self.head_cap <= 1:
            raise ValueError(f"head_cap is a fraction of a head's keys, in (0, 1], got {self.head_cap}")
        if self.profile is not None and self.budget != "profile":
            raise BudgetProfileError("a profile is given with budget 'profile' only")
        if self.query_cap < 1 or self.omp_step < 1 or self.omp_refit < 1:
            raise ValueError("query_cap, omp_step and omp_refit must be >= 1")
        if self.refine_steps < 0:
            raise ValueError(f"refine_steps must be >= 0, got {self.refine_steps}")
        if not self.value_ridge > 0:
            raise ValueError(f"value_ridge must be > 0, got {self.value_ridge}")
        if self.needs_kvzip_scores and "repeat" not in self.sources:
            raise ValueError("KVzip's scores (selector kvzip, or global budgets by kvzip) need the 'repeat' source")
        if self.self_study_queries is not None:
            if self.self_study_queries < 0 or "self-study" not in self.sources:
                raise ValueError(
                    f"self_study_queries counts self-study rows (>= 0, with the 'self-study' source), "
                    f"got {self.self_study_queries} with sources {self.sources}"
                )
            if self.on_policy:
                raise ValueError(
                    "self_study_queries thins queries captured once: on-policy compaction captures them layer by layer"
                )
        if self.on_policy and "context" in self.sources:
            raise ValueError("on-policy compaction takes the repeat and self-study sources, not 'context'")

    @property
    def needs_kvzip_scores(self) -> bool:
        return self.selector == "kvzip" or (self.budget == "global" and self.budget_scores == "kvzip")

    def nnls_bounds(self) -> tuple[float, float, int]:
        """(lower, upper, gradient steps) of the NNLS weights: OMP's [1e-12, e^7] with none, else HAK's e^+-3
        with 2 (the reference code's settings); [1, 1] (beta = 0) without fit_bias."""
        if not self.fit_bias:
            return 1.0, 1.0, 0
        return (1e-12, OMP_UPPER, 0) if self.selector == "omp" else (math.exp(-3.0), math.exp(3.0), 2)


def effective_ratio(config: MatchingConfig, cache: kv.KVCache) -> float:
    """The ratio of pairs kept: config.ratio, less (same_bytes) the bias' bytes when the fit adds a bias and an MLA
    token's second latent when its value latent is fitted (latent_values "fitted")."""
    if not config.same_bytes:
        return config.ratio
    layer = cache.layers[0]
    pair = (layer.k.shape[-1] + layer.v.shape[-1]) * layer.k.dtype.itemsize  # an MLA cache's shared layout
    kept = pair + (BIAS_BYTES if config.fit_bias else 0)
    if config.latent_values == "fitted":
        kept += layer.v.shape[-1] * layer.v.dtype.itemsize
    return config.ratio * pair / kept


class LatentValuesError(KvzipError, ValueError):
    """Fitted latent values asked of a model without a latent cache (or refinement of an MLA cache's kept ones)."""


def check_choices(cfg: ModelConfig, config: MatchingConfig) -> None:
    """The choices that depend on the model (LatentValuesError for its attention, BudgetProfileError for a profile
    budget given no profile), checked before any pass runs."""
    if config.budget == "profile" and config.profile is None:
        raise BudgetProfileError(
            "budget 'profile' needs the model's profile: give one (budgets.load_profile), or "
            "take the method's options for the model (methods.get(name).options_for(model))"
        )
    if config.latent_values == "fitted" and cfg.mla is None:
        raise LatentValuesError(
            "latent_values 'fitted' fits an MLA token's value latent; this model has no latent cache"
        )
    if cfg.mla is not None and config.latent_values == "kept" and config.refine_steps:
        raise LatentValuesError(
            "refinement moves the kept values, and an MLA slot's latent is its key too: "
            "refine_steps must be 0 on multi-head latent attention unless latent_values is "
            "'fitted'"
        )
