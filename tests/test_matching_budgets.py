"""matching.budgets: global per-head counts equal a numpy oracle (each head's best up to its cap, then one top-k per
row), are exact, respect the cap and the fit's static size; with no cap they are KVzip's own pair-level counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import matching
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.matching.budgets import fit_tiers, head_caps, head_counts, static_count


def oracle_counts(ratio, head_cap, lens, scores):
    """counts [L, B, K] by the rule in plain numpy; ties go to the lower index, as everywhere in the library."""
    L, B, K, n = scores.shape
    counts = np.zeros((L, B, K), np.int64)
    for b, length in enumerate(lens):
        cap = min(length, max(int(np.floor(head_cap * length + 1e-9)), int(np.floor(ratio * length + 1e-9)) + 1))
        candidates = []  # (score, flat index) of each head's `cap` best keys
        for l in range(L):
            for k in range(K):
                order = np.argsort(-scores[l, b, k, :length], kind="stable")[:cap]
                candidates += [(scores[l, b, k, j], (l * K + k) * n + j) for j in order]
        total = int(np.floor(ratio * L * K * length + 1e-9))
        for _, flat in sorted(candidates, key=lambda c: (-c[0], c[1]))[:total]:
            counts[flat // (K * n), b, flat // n % K] += 1
    return counts


@pytest.mark.parametrize("ratio", [0.02, 0.05, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("head_cap", [0.05, 0.2, 0.75, 1.0])
def test_global_counts_match_oracle_and_caps(ratio, head_cap):
    rng = np.random.default_rng(int(ratio * 100) + int(head_cap * 10))
    L, B, K, n = 3, 3, 2, 60
    lens = np.array([60, 37, 1])
    scores = rng.normal(size=(L, B, K, n)).round(1).astype(np.float32)  # rounded: ties happen
    scores = np.where(np.arange(n) < lens[None, :, None, None], scores, -np.inf)
    counts = np.asarray(head_counts(ratio, jnp.asarray(lens), (L, B, K, n), "global", jnp.asarray(scores), head_cap))
    np.testing.assert_array_equal(counts, oracle_counts(ratio, head_cap, lens, scores))
    np.testing.assert_array_equal(counts.sum(axis=(0, 2)), np.asarray(kept_count(ratio, L * K * lens)))
    assert (counts <= np.asarray(head_caps(ratio, head_cap, jnp.asarray(lens)))[None, :, None]).all()
    assert counts.max() <= static_count(ratio, n, "global", head_cap)


def test_no_cap_is_kvzip_pair_level():
    """head_cap 1: one top-k over every pair of a row, KVzip's global eviction, counted per head."""
    rng = np.random.default_rng(3)
    L, B, K, n = 4, 2, 2, 50
    lens = np.array([50, 33])
    scores = np.where(np.arange(n) < lens[None, :, None, None], rng.normal(size=(L, B, K, n)), -np.inf)
    counts = np.asarray(head_counts(0.1, jnp.asarray(lens), (L, B, K, n), "global", jnp.asarray(scores, jnp.float32),
                                    1.0))
    for b, length in enumerate(lens):
        flat = scores[:, b, :, :length].reshape(-1)
        threshold = np.sort(flat)[::-1][int(0.1 * L * K * length) - 1]
        np.testing.assert_array_equal(counts[:, b], (scores[:, b, :, :length] >= threshold).sum(-1))


@pytest.mark.parametrize("head_cap", [0.0, -0.5, 1.5, 4.0])
def test_head_cap_is_a_fraction(head_cap):
    with pytest.raises(ValueError, match="head_cap"):
        matching.MatchingConfig(head_cap=head_cap)


def test_fit_tiers_hold_every_head():
    """Any counts of at most `size` summing to at most `total`, sorted from the largest, fit their tier's size; the
    tiers cover every head once."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        heads, size = int(rng.integers(1, 40)), int(rng.integers(0, 300))
        total = int(rng.integers(0, heads * size + 1))
        if rng.random() < 0.5:  # the bound's worst case: m equal heads share the total
            m = int(rng.integers(1, heads + 1))
            counts = np.array([min(size, total // m)] * m + [0] * (heads - m))
        else:  # a random split, uneven or nearly even
            share = rng.dirichlet(np.full(heads, 10.0 ** rng.uniform(-2, 2)))
            counts = np.minimum(np.floor(share * total), size).astype(np.int64)
        counts = np.sort(counts)[::-1]
        tiers = fit_tiers(size, total, heads)
        assert sum(h for h, _ in tiers) == heads
        sizes = np.repeat([s for _, s in tiers], [h for h, _ in tiers])
        assert (counts <= sizes).all() and (sizes <= size).all()
        assert list(sizes) == sorted(sizes, reverse=True)
