"""matching.budgets: global per-head counts equal a numpy oracle (each head's best up to its cap, then one top-k per
row), are exact, respect the cap and the fit's static size; with no cap they are KVzip's own pair-level counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import matching, methods
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.matching.budgets import MIN_FIT_SIZE, fit_sizes, head_caps, head_counts, static_count
from tests.conftest import tiny_config


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
    counts = np.asarray(
        head_counts(0.1, jnp.asarray(lens), (L, B, K, n), "global", jnp.asarray(scores, jnp.float32), 1.0)
    )
    for b, length in enumerate(lens):
        flat = scores[:, b, :, :length].reshape(-1)
        threshold = np.sort(flat)[::-1][int(0.1 * L * K * length) - 1]
        np.testing.assert_array_equal(counts[:, b], (scores[:, b, :, :length] >= threshold).sum(-1))


@pytest.mark.parametrize("head_cap", [0.0, -0.5, 1.5, 4.0])
def test_head_cap_is_a_fraction(head_cap):
    with pytest.raises(ValueError, match="head_cap"):
        matching.MatchingConfig(head_cap=head_cap)


def test_fit_sizes_hold_every_count_with_little_padding():
    """From `size` down, each rung at least the one above over sqrt(2): every count in (0, size] has a rung that
    holds it, and the smallest such rung pads it by under 42% (counts below MIN_FIT_SIZE: MIN_FIT_SIZE's 42%)."""
    for size in [0, 1, 31, 32, 33, 45, 100, 204, 1536, 4097]:
        sizes = fit_sizes(size)
        assert sizes[0] == size and list(sizes) == sorted(set(sizes), reverse=True)
        assert len(sizes) == 1 or sizes[-1] >= MIN_FIT_SIZE
        for count in range(1, size + 1):
            fitted_at = min(s for s in sizes if s >= count)
            assert fitted_at <= max(MIN_FIT_SIZE, count) * 1.42


@pytest.mark.parametrize("ratio", [0.02, 0.1, 0.3])
def test_profile_counts_follow_the_shares(ratio):
    """Profile budgets: exact totals, a zero share keeps nothing, and (no cap reached) every head within one key of
    its share of the row's budget; at 0.3 the cap binds and the excess goes to the other heads."""
    L, B, K, n = 3, 2, 2, 400
    lens = np.array([400, 257])
    shares = np.array([[0.4, 0.0], [0.05, 0.25], [0.1, 0.2]])
    scores = matching.budgets.profile_scores(jnp.asarray(shares, jnp.float32), jnp.asarray(lens), n)
    counts = np.asarray(head_counts(ratio, jnp.asarray(lens), (L, B, K, n), "profile", scores, 0.75))
    totals = np.asarray(kept_count(ratio, L * K * lens))
    np.testing.assert_array_equal(counts.sum(axis=(0, 2)), totals)
    assert (counts[0, :, 1] == 0).all()
    caps = np.asarray(head_caps(ratio, 0.75, jnp.asarray(lens)))
    assert (counts <= caps[None, :, None]).all()
    want = shares[:, None, :] * totals[None, :, None]  # [L, B, K]
    if (want <= caps[None, :, None]).all():
        assert np.abs(counts - want).max() <= 1
    else:
        capped = want > caps[None, :, None]
        assert (counts[capped] == np.broadcast_to(caps[None, :, None], counts.shape)[capped]).all()
        assert (counts[~capped & (want > 0)] >= np.floor(want[~capped & (want > 0)])).all()


def test_profile_errors():
    from kvzip_jax.matching.budgets import BudgetProfileError, check_profile, load_profile

    with pytest.raises(BudgetProfileError, match="needs the model's profile"):
        matching.check_choices(tiny_config(2), matching.MatchingConfig(budget="profile"))
    with pytest.raises(BudgetProfileError, match="with budget 'profile' only"):
        matching.MatchingConfig(budget="global", profile=((1.0,),))
    with pytest.raises(BudgetProfileError, match="2 rows"):
        check_profile(((1.0, 1.0),), 2, 2)
    for bad in (((1.0, -0.1),), ((0.0, 0.0),), ((float("nan"), 1.0),)):
        with pytest.raises(BudgetProfileError, match="finite"):
            check_profile(bad, 1, 2)
    with pytest.raises(BudgetProfileError, match="budget_search.py --model no-such-model"):
        load_profile("no-such-model")
    with pytest.raises(BudgetProfileError, match="model's name"):
        methods.get("am-hak-pb").options_for()


def test_shipped_profiles_are_well_formed():
    """Every profile in the package: shaped for its model's compacted layers and KV heads, shares summing to 1, and
    am-hak-pb loads it by the model's name."""
    import json

    from kvzip_jax.matching.budgets import PROFILE_DIR, check_profile

    files = sorted(PROFILE_DIR.glob("*.json"))
    assert files, f"no budget profile in {PROFILE_DIR}"
    for path in files:
        data = json.loads(path.read_text())
        check_profile(data["profile"], len(data["layers"]), data["kv_heads"])
        assert abs(sum(map(sum, data["profile"])) - 1) < 1e-4
        config = methods.get("am-hak-pb").options_for(path.stem)
        assert config.budget == "profile" and np.allclose(config.profile, data["profile"])
