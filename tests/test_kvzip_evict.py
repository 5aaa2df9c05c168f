"""Eviction levels: exact budgets, never-evicted prefix and suffix, ties, jit/eager agreement, no NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzip_jax.kvzip.eviction import LEVELS, RatioError, keep_mask

L, B, K, N = 3, 2, 2, 17


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["random", "tied", "constant"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if kind == "random":
        scores = rng.random((L, B, K, N))
    elif kind == "tied":
        scores = rng.integers(0, 3, (L, B, K, N)).astype(np.float64)
    else:
        scores = np.full((L, B, K, N), 0.5)
    context_len = np.array([draw(st.integers(1, N)), draw(st.integers(1, N))], np.int32)
    percent = draw(st.integers(1, 100))  # ratios as the decimals users write
    return scores.astype(np.float32), context_len, percent


def expected_counts(level, context_len, percent):
    """Kept pairs per batch row from the budget rule: floor(ratio x candidates) per budget unit."""
    if level == "pair":
        return [L * K * c * percent // 100 for c in context_len]
    if level == "pair-uniform":
        return [L * K * (c * percent // 100) for c in context_len]
    if level == "layer":
        return [L * (K * c * percent // 100) for c in context_len]
    return [(L * K * percent // 100) * c for c in context_len]


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_budgets_are_exact_and_only_context_is_evictable(level, case):
    scores, context_len, percent = case
    keep = np.asarray(keep_mask(jnp.asarray(scores), jnp.asarray(context_len), percent / 100, level))
    assert keep.shape == scores.shape and keep.dtype == bool
    for b, c in enumerate(context_len):
        assert not keep[:, b, :, c:].any()  # past the context: not a candidate (kept by the cache, not here)
        assert keep[:, b].sum() == expected_counts(level, context_len, percent)[b]
    if level == "pair-uniform":
        for b, c in enumerate(context_len):
            assert (keep[:, b].sum(-1) == c * percent // 100).all()
    if level == "layer":
        for b, c in enumerate(context_len):
            assert (keep[:, b].sum((-1, -2)) == K * c * percent // 100).all()


def test_kept_pairs_outscore_evicted_ones_and_ties_go_to_earlier_pairs():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, (L, B, K, N)).astype(np.float32)
    context_len = jnp.array([N, 11])
    keep = np.asarray(keep_mask(jnp.asarray(scores), context_len, 0.4, "pair"))
    for b, c in enumerate([N, 11]):
        kept, evicted = scores[:, b, :, :c][keep[:, b, :, :c]], scores[:, b, :, :c][~keep[:, b, :, :c]]
        assert kept.min() >= evicted.max()
        threshold = kept.min()
        at_threshold = np.argwhere(scores[:, b, :, :c] == threshold)  # (l, k, i) in row-major = flat order
        kept_flags = keep[:, b, :, :c][tuple(at_threshold.T)]
        assert not np.any(np.diff(kept_flags.astype(int)) > 0)  # kept ones come first


@pytest.mark.parametrize("level", LEVELS)
def test_jit_and_eager_agree(level):
    scores = jnp.asarray(np.random.default_rng(1).random((L, B, K, N)), jnp.float32)
    context_len = jnp.array([N, 9])
    eager = keep_mask(scores, context_len, 0.3, level)
    jitted = jax.jit(keep_mask, static_argnames="level")(scores, context_len, jnp.float32(0.3), level=level)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_a_head_may_keep_nothing_and_nothing_is_nan():
    scores = np.zeros((L, B, K, N), np.float32)
    scores[0] = 1.0  # layer 0 takes the whole budget
    keep = np.asarray(keep_mask(jnp.asarray(scores), jnp.array([N, N]), 0.2, "pair"))
    assert keep[0].sum() == B * (L * K * N * 20 // 100) and not keep[1:].any()
    nan_scores = jnp.asarray(np.full((L, B, K, N), -np.inf, np.float32))
    assert np.asarray(keep_mask(nan_scores, jnp.array([N, N]), 0.5, "pair")).sum() == B * L * K * N // 2


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, float("nan")])
def test_ratio_outside_unit_interval_is_a_named_error(ratio):
    with pytest.raises(RatioError, match="ratio"):
        keep_mask(jnp.zeros((L, B, K, N)), jnp.array([N, N]), ratio)


def test_only_evictable_layers_compete_for_the_budget():
    scores = jnp.asarray(np.random.default_rng(3).random((L, B, K, N)), jnp.float32)
    keep = np.asarray(keep_mask(scores, jnp.array([N, 10]), 0.25, "pair", evictable=(1,)))
    for b, c in enumerate([N, 10]):
        assert keep[0, b, :, :c].all() and keep[2, b, :, :c].all()  # not evictable: whole context kept
        assert keep[1, b].sum() == K * c * 25 // 100  # the ratio counts the evictable layer alone
        assert not keep[:, b, :, c:].any()
