"""How many keys each (layer, KV head) keeps in a compacted cache (reference/attention_matching.md §5).

  uniform   every compacted head keeps floor(ratio x its context length) keys
  global    one top-k over every compacted head's keys of a row by a per-key score (the aggregated attention of
            the reference queries, HAK's own score, by default; or KVzip's): heads that matter more keep more, as
            KVzip's pair level does. The paper finds non-uniform budgets the most important part of the method; its
            budgets come from an offline per-model search we do not have, so a per-key score stands in. As in the
            paper, a head keeps at most `head_cap` (0.75) of its context keys, and never less than one above its
            uniform count (so the row's budget always fits); the cap of the longest row fixes the static size of
            the fit. Which score and cap decide the KL at 20x (docs/attention_matching.md).
  profile   each head a fixed share of the row's budget, searched offline per model as the paper's are
            (studies/budget_search/budget_search.py, stored in kvzip_jax/data/head_budgets/<model>.json): the global
            top-k over scores share / (rank + 1/2), so the counts are proportional to the shares, exact in total, and
            capped at `head_cap` as global budgets are (the excess goes to the other heads in proportion to their
            shares, and to heads of share 0 only once the others are full).
Counts are exact integers (kvzip.budget.kept_count); a ratio applies to the context pairs of the compacted layers.

Fitting every head at the static size of the largest wastes most of the work when budgets are uneven (at 0.1 the
cap is 7.5x the uniform count). `fit_sizes` is a ladder of static sizes instead, each the one above over sqrt(2):
a head is fitted at the smallest that holds its own count (compact.py switches on the count at run time), so the
padding of a fit above MIN_FIT_SIZE is under 42% of its count.

Einsum legend: L compacted layers, B batch, K KV heads, n context columns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from kvzip_jax.errors import KvzipError
from kvzip_jax.kvzip.budget import RATIO_UNITS, kept_count, top_counts

BUDGETS = ("uniform", "global", "profile")
PROFILE_DIR = Path(__file__).parents[1] / "data" / "head_budgets"
FIT_STEP = 2**0.5  # each fit size is the one above over sqrt(2)
MIN_FIT_SIZE = 32


class BudgetProfileError(KvzipError, ValueError):
    """A budget profile that is missing, unreadable or not shaped for the model."""


def profile_file(model: str) -> Path:
    """Where a model's searched budget profile lives (package data)."""
    return PROFILE_DIR / f"{model}.json"


def load_profile(model: str) -> tuple[tuple[float, ...], ...]:
    """A model's searched shares, one row per compacted layer, one share per KV head (MatchingConfig.profile)."""
    path = profile_file(model)
    if not path.is_file():
        raise BudgetProfileError(
            f"no budget profile for {model} at {path}; search one with: "
            f"python studies/budget_search/budget_search.py --model {model}"
        )
    try:
        return tuple(tuple(float(share) for share in row) for row in json.loads(path.read_text())["profile"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BudgetProfileError(f"{path} is not a budget profile ({type(e).__name__}: {e})") from None


def check_profile(profile, layers: int, kv_heads: int) -> None:
    """BudgetProfileError unless profile is [layers][kv_heads] finite shares >= 0, some positive."""
    shares = [list(row) for row in profile]
    if len(shares) != layers or any(len(row) != kv_heads for row in shares):
        raise BudgetProfileError(
            f"a budget profile needs {layers} rows (compacted layers) of {kv_heads} shares "
            f"(KV heads), got {[len(row) for row in shares]}"
        )
    flat = [share for row in shares for share in row]
    if not all(math.isfinite(share) and share >= 0 for share in flat) or not sum(flat) > 0:
        raise BudgetProfileError("budget profile shares must be finite, >= 0, and not all 0")


def profile_scores(shares: jax.Array, context_len: jax.Array, n: int) -> jax.Array:
    """[L, B, K, n] per-key scores share / (rank + 1/2) (-inf past a row's context) for shares [L, K]: a global
    top-k over them keeps per head a count proportional to its share."""
    scores = shares[:, None, :, None] / (jnp.arange(n) + 0.5)  # [L, 1, K, n]
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    return jnp.where(in_context[None, :, None, :], scores, -jnp.inf)


def _host_count(ratio: float, n: int) -> int:
    return round(ratio * RATIO_UNITS) * n // RATIO_UNITS  # kept_count's arithmetic, on the host


def static_count(ratio: float, n: int, budget: str, head_cap: float) -> int:
    """The most keys one head can keep (the static size of its fit) for n context columns."""
    if budget == "uniform":
        return _host_count(ratio, n)
    return min(n, max(_host_count(head_cap, n), _host_count(ratio, n) + 1))


def fit_sizes(size: int) -> tuple[int, ...]:
    """The static fit sizes for heads of at most `size` keys, from `size` down: each the one above over sqrt(2)
    (rounded up), none below MIN_FIT_SIZE (smaller fits cost as much: their [N, T] work dominates)."""
    ladder = [size]
    while math.ceil(ladder[-1] / FIT_STEP) >= MIN_FIT_SIZE:
        ladder.append(math.ceil(ladder[-1] / FIT_STEP))
    return tuple(ladder)


def head_caps(ratio: float, head_cap: float, context_len: jax.Array) -> jax.Array:
    """The most keys a head of each row may keep under global budgets, [B] int32 for context_len [B]."""
    floor = kept_count(ratio, context_len) + 1  # >= the ceiling of the uniform share: the row's budget fits
    return jnp.minimum(context_len, jnp.maximum(kept_count(head_cap, context_len), floor)).astype(jnp.int32)


def head_counts(
    ratio: float,
    context_len: jax.Array,
    shape: tuple[int, int, int, int],
    budget: str,
    scores: jax.Array | None = None,
    head_cap: float = 0.75,
) -> jax.Array:
    """counts [L, B, K] int32 for context_len [B] and (L, B, K, n) = shape. global: scores [L, B, K, n] (-inf past a
    row's context), a head keeping at most head_caps(ratio, head_cap, context_len) of them; profile: the same, with
    scores = profile_scores(shares, context_len, n)."""
    L, B, K, n = shape
    if budget == "uniform":
        return jnp.broadcast_to(kept_count(ratio, context_len)[None, :, None], (L, B, K)).astype(jnp.int32)
    if budget not in ("global", "profile"):
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    caps = jnp.broadcast_to(head_caps(ratio, head_cap, context_len)[None, :, None], (L, B, K))
    capped = top_counts(scores, caps)  # [L, B, K, n] each head's best, up to its cap
    in_context = jnp.arange(n) < context_len[:, None]  # [B, n]
    candidates = jnp.where(capped & in_context[None, :, None, :], scores, -jnp.inf)
    flat = candidates.transpose(1, 0, 2, 3).reshape(B, L * K * n)
    keep = top_counts(flat, kept_count(ratio, L * K * context_len.astype(jnp.int32)))  # [B, L K n]
    return keep.reshape(B, L, K, n).sum(-1, dtype=jnp.int32).transpose(1, 0, 2)
