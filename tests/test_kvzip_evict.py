"""Eviction levels: exact budgets, never-evicted prefix and suffix, ties, jit/eager agreement, no NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzip_jax.kvzip.budget import RatioError, kept_count
from kvzip_jax.kvzip.eviction import LEVELS, keep_mask

L, B, K, N = 3, 2, 2, 17
MILLION = 10**6


@st.composite
def cases(draw):
    """Scores [L, B, K, N] of any small shape (random, tied or constant), context lengths, and a ratio in
    millionths (1..10^6: decimals users write, and ones that are not multiples of 1/100)."""
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 40)))
    kind = draw(st.sampled_from(["random", "tied", "constant"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if kind == "random":
        scores = rng.random(shape)
    elif kind == "tied":
        scores = rng.integers(0, 3, shape).astype(np.float64)
    else:
        scores = np.full(shape, 0.5)
    context_len = np.array([draw(st.integers(1, shape[-1])) for _ in range(shape[1])], np.int32)
    units = draw(st.one_of(st.integers(1, 100).map(lambda p: p * 10_000), st.integers(1, MILLION)))
    return scores.astype(np.float32), context_len, units


def expected_counts(level, shape, context_len, units):
    """Kept pairs per batch row from the budget rule: floor(ratio x candidates) per budget unit, in integers."""
    L, _, K, _ = shape
    floor = lambda candidates: candidates * units // MILLION
    if level == "pair":
        return [floor(L * K * c) for c in context_len]
    if level == "pair-uniform":
        return [L * K * floor(c) for c in context_len]
    if level == "layer":
        return [L * floor(K * c) for c in context_len]
    return [floor(L * K) * c for c in context_len]


JITTED_KEEP = jax.jit(keep_mask, static_argnames=("level",))


@pytest.mark.parametrize("level", LEVELS)
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_budgets_are_exact_and_only_context_is_evictable(level, case):
    scores, context_len, units = case
    L, _, K, _ = scores.shape
    keep = np.asarray(JITTED_KEEP(jnp.asarray(scores), jnp.asarray(context_len), units / MILLION, level=level))
    assert keep.shape == scores.shape and keep.dtype == bool
    for b, c in enumerate(context_len):
        assert not keep[:, b, :, c:].any()  # past the context: not a candidate (kept by the cache, not here)
        assert keep[:, b].sum() == expected_counts(level, scores.shape, context_len, units)[b]
        if level == "pair-uniform":
            assert (keep[:, b].sum(-1) == c * units // MILLION).all()
        if level == "layer":
            assert (keep[:, b].sum((-1, -2)) == K * c * units // MILLION).all()


@settings(max_examples=300, deadline=None)
@given(units=st.integers(0, MILLION), candidates=st.integers(0, 2**31 - 1))
def test_kept_count_is_exact_in_integers_far_past_float32(units, candidates):
    """floor(ratio x candidates) for candidate counts up to 2^31 - 1 (float32 counts exactly only to 2^24), with
    the ratio as a Python float and as a float32 array under jit."""
    exact = units * candidates // MILLION
    assert int(kept_count(units / MILLION, candidates)) == exact
    jitted = jax.jit(kept_count)(jnp.float32(units / MILLION), jnp.int32(candidates))
    assert int(jitted) == exact and jitted.dtype == jnp.int32


@pytest.mark.parametrize(
    "ratio, candidates, expected",
    [
        (0.75, 400_001, 300_000),  # 300,000.75 pairs: the float product nudged up by 1e-6 gave 300,001
        (0.9, 1_111_111, 999_999),
        (0.7, 10, 7),  # float32(0.7) x 10 = 6.99999988: a plain float floor loses a pair
        (0.3, 2**24 + 1, 5_033_165),
        (1 / 3, 3_000_000, 999_999),  # past 2^24; a ratio finer than 10^-6 is rounded
        (1.0, 2**31 - 1, 2**31 - 1),
    ],
)
def test_kept_count_at_the_edges(ratio, candidates, expected):
    assert int(kept_count(ratio, candidates)) == expected


@pytest.mark.parametrize("level", ["pair", "layer", "pair-uniform"])
def test_a_large_budget_is_exact(level):
    """400,001 candidate pairs at 0.75 keep 300,000 (the float rule kept 300,001)."""
    n = 400_001
    scores = jnp.asarray(np.random.default_rng(0).random((1, 1, 1, n)), jnp.float32)
    assert int(keep_mask(scores, jnp.array([n]), 0.75, level).sum()) == 300_000


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
