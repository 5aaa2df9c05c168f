"""matching.compact on a tiny random model: jit and eager agree, budgets are exact (uniform and global), the
compacted cache is a masked cache with fitted values and a bias at the kept slots, and nothing is NaN."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, matching, methods
from kvzip_jax.kvzip import scoring
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.models.params import init_params
from tests.conftest import tiny_config


def _reread(prefix_lens, contexts, chunk, rng, prompt=5):
    """RereadInputs with random reread prompts (the tiny model has no tokenizer)."""
    C, B = max(-(-len(c) // chunk) for c in contexts), len(contexts)
    rows = [
        [np.concatenate([rng.integers(0, 101, prompt), c[t * chunk : (t + 1) * chunk]]) for t in range(C)]
        for c in contexts
    ]
    W = max(len(r) for rr in rows for r in rr)
    tokens, valid, lens = np.zeros((C, B, W), np.int32), np.zeros((C, B), np.int32), np.zeros((C, B), np.int32)
    for b, rr in enumerate(rows):
        for t, r in enumerate(rr):
            tokens[t, b, : len(r)], valid[t, b] = r, len(r)
            lens[t, b] = len(contexts[b][t * chunk : (t + 1) * chunk])
    starts = np.asarray(prefix_lens)[None, :] + chunk * np.arange(C)[:, None]
    return scoring.RereadInputs(
        jnp.asarray(tokens),
        jnp.asarray(valid),
        jnp.asarray(starts, jnp.int32),
        jnp.asarray(lens),
        jnp.asarray(prefix_lens, jnp.int32),
        jnp.asarray([len(c) for c in contexts], jnp.int32),
        chunk,
    )


def compact_jit_and_eager(params, cfg, cache, reread, config, probes=None, eager=True):
    """matching.compact under jit, all finite, after checking (eager=True) that eager gives the same counts and
    arrays."""
    out, counts = jax.jit(matching.compact)(params, cfg, cache, reread, config, probes)
    for a in jax.tree.leaves(out):
        assert np.isfinite(np.asarray(a, np.float64)).all()
    if eager:
        eager_out, eager_counts = matching.compact(params, cfg, cache, reread, config, probes)
        np.testing.assert_array_equal(np.asarray(counts), np.asarray(eager_counts))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(eager_out)):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-4, rtol=1e-4)
    return out, counts


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 101, 4).astype(np.int32) for _ in range(2)]
    contexts = [rng.integers(0, 101, n).astype(np.int32) for n in (40, 27)]
    _, cache = gen.prefill(params, cfg, [np.concatenate([p, c]) for p, c in zip(prefixes, contexts)], capacity=128)
    return cfg, params, cache, _reread([4, 4], contexts, 16, rng)


# Eager runs op by op (slow): each selector and each budget is run eagerly once, every pair under jit.
EAGER = {("uniform", "hak"), ("global", "omp"), ("uniform", "kvzip"), ("profile", "hak")}
# make test-fast runs each selector and each budget once, eagerly once (the others are marked heavy).
FAST = {("uniform", "hak"), ("global", "kvzip"), ("profile", "omp")}


@pytest.mark.parametrize(
    "budget,selector",
    [
        pytest.param(b, s, marks=() if (b, s) in FAST else pytest.mark.heavy)
        for b in matching.BUDGETS
        for s in matching.SELECTORS
    ],
)
def test_compact_jit_eager_budgets(setup, selector, budget):
    assert {s for _, s in EAGER} == set(matching.SELECTORS) and {b for b, _ in EAGER} == set(matching.BUDGETS)
    assert {s for _, s in FAST} == set(matching.SELECTORS) and {b for b, _ in FAST} == set(matching.BUDGETS)
    cfg, params, cache, reread = setup
    # shares of (layer, KV head), one none, one above half a head's keys (16 of 27 kept: a value fit over this random
    # model's near-uniform attention that is ill-conditioned, which normal equations alone left to the third digit)
    profile = ((0.5, 0.0), (0.2, 0.3)) if budget == "profile" else None
    config = matching.MatchingConfig(
        ratio=0.3, selector=selector, budget=budget, sources=("repeat", "context"), profile=profile
    )
    out, counts = compact_jit_and_eager(params, cfg, cache, reread, config, eager=(budget, selector) in EAGER)
    ratio = matching.effective_ratio(config, cache)
    L, K = cfg.num_layers, cfg.num_kv_heads
    want = np.asarray(kept_count(ratio, reread.context_len * (1 if budget == "uniform" else L * K)))
    per_row = np.asarray(counts).sum(axis=(0, 2)) if budget != "uniform" else np.asarray(counts)[0, :, 0]
    if budget == "profile":
        assert (np.asarray(counts)[0, :, 1] == 0).all()  # a head of share 0 keeps none of its context
    np.testing.assert_array_equal(per_row, want)
    kept = np.asarray(kv.kept_per_head(out)) - 4  # the prefix is never compacted
    np.testing.assert_array_equal(kept, np.asarray(counts))
    for layer, old in zip(out.layers, cache.layers):
        dropped = ~np.asarray(layer.keep)
        assert (np.asarray(layer.bias)[dropped] == 0).all()
        np.testing.assert_array_equal(np.asarray(layer.k), np.asarray(old.k))  # keys stay where they were


def test_ratio_one_returns_the_cache(setup):
    cfg, params, cache, reread = setup
    out, counts = matching.compact(params, cfg, cache, reread, matching.MatchingConfig(ratio=1.0))
    assert out is cache
    np.testing.assert_array_equal(np.asarray(counts)[0, :, 0], np.asarray(reread.context_len))


def test_on_policy_jit_eager_and_first_layer(setup):
    """On-policy compaction: jit and eager agree; layer 0 sees the same queries as off-policy (nothing before it is
    compacted), so its fit is the off-policy one; a later layer's is not (its queries come from compacted layers).
    The kvzip selector takes the per-layer KVzip scores of the on-policy pass (tests/test_eval_sweep.py runs HAK
    on-policy)."""
    cfg, params, cache, reread = setup
    config = matching.MatchingConfig(ratio=0.3, selector="kvzip", budget="global", on_policy=True)
    out, counts = compact_jit_and_eager(params, cfg, cache, reread, config)
    off, off_counts = matching.compact(params, cfg, cache, reread, dataclasses.replace(config, on_policy=False))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(off_counts))  # budgets from the full cache's pass
    first, last = (out.layers[0], off.layers[0]), (out.layers[-1], off.layers[-1])
    np.testing.assert_array_equal(np.asarray(first[0].keep), np.asarray(first[1].keep))
    np.testing.assert_allclose(np.asarray(first[0].v), np.asarray(first[1].v), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(first[0].bias), np.asarray(first[1].bias), atol=1e-4, rtol=1e-4)
    assert not np.allclose(np.asarray(last[0].v), np.asarray(last[1].v), atol=1e-3, rtol=1e-3)


def test_on_policy_choices_are_checked(setup):
    cfg, params, cache, reread = setup
    with pytest.raises(ValueError, match="on-policy"):
        matching.MatchingConfig(on_policy=True, sources=("repeat", "context"))
    queries = matching.reference_queries(params, cfg, cache, reread, with_scores=True)
    with pytest.raises(ValueError, match="call compact"):
        matching.compact_with(queries, cfg, cache, reread, matching.MatchingConfig(on_policy=True))


def test_refined_compaction_moves_only_beta_and_values_of_kept_slots(setup):
    cfg, params, cache, reread = setup
    base = matching.MatchingConfig(ratio=0.3, budget="uniform")
    closed, counts = jax.jit(matching.compact)(params, cfg, cache, reread, base)
    refined, refined_counts = jax.jit(matching.compact)(
        params, cfg, cache, reread, dataclasses.replace(base, refine_steps=20)
    )
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(refined_counts))
    for a, b in zip(closed.layers, refined.layers):
        np.testing.assert_array_equal(np.asarray(a.keep), np.asarray(b.keep))
        np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
        moved = ~np.isclose(np.asarray(a.v), np.asarray(b.v), atol=1e-6).all(-1)  # [B, K, C]
        assert moved.any() and not (moved & ~np.asarray(a.keep)).any()
        assert np.isfinite(np.asarray(b.bias)).all() and np.isfinite(np.asarray(b.v)).all()


def test_without_the_bias_fit_the_compacted_cache_carries_and_counts_no_bias(setup):
    """fit_bias=False: the compacted layers carry no bias (refined or not), their bytes are the kept pairs' alone,
    and same_bytes keeps floor(ratio x context) per head (no bias bytes to make room for)."""
    cfg, params, cache, reread = setup
    config = matching.MatchingConfig(ratio=0.3, budget="uniform", fit_bias=False)
    closed, counts = jax.jit(matching.compact)(params, cfg, cache, reread, config)
    refined, _ = jax.jit(matching.compact)(params, cfg, cache, reread, dataclasses.replace(config, refine_steps=20))
    np.testing.assert_array_equal(np.asarray(counts)[0, :, 0], np.asarray(kept_count(0.3, reread.context_len)))
    pair = 2 * cfg.head_dim * cache.layers[0].k.dtype.itemsize
    for out in (closed, refined):
        assert all(layer.bias is None for layer in out.layers)
        assert kv.used_bytes(out) == int(np.asarray(kv.kept_per_head(out)).sum()) * pair
    assert not np.allclose(np.asarray(closed.layers[0].v), np.asarray(refined.layers[0].v), atol=1e-6)


def test_one_head_of_compact_equals_the_numpy_oracle(setup):
    """The whole closed-form compaction of one head, written out in numpy: HAK (rms over the reference queries'
    attention) picks the uniform count of keys, then the float64 fit (tests/test_matching.py's oracle) gives the bias
    and values that compact writes at those slots."""
    from .test_matching import _numpy_fit

    cfg, params, cache, reread = setup
    config = matching.MatchingConfig(ratio=0.3, selector="hak", budget="uniform")
    queries = matching.reference_queries(params, cfg, cache, reread)
    out, counts = matching.compact_with(queries, cfg, cache, reread, config)
    layer, row, head = 1, 1, 0
    prefix, n = int(reread.prefix_len[row]), int(reread.context_len[row])
    q = np.asarray(queries.q[layer][row, head], np.float64)[np.asarray(queries.valid[row])]
    k = np.asarray(cache.layers[layer].k[row, head, prefix : prefix + n], np.float64)
    v = np.asarray(cache.layers[layer].v[row, head, prefix : prefix + n], np.float64)
    z = cfg.query_scale * q @ k.T
    attention = np.exp(z - z.max(axis=1, keepdims=True))
    attention /= attention.sum(axis=1, keepdims=True)
    count = int(counts[layer, row, head])
    assert count == int(kept_count(matching.effective_ratio(config, cache), np.asarray([n]))[0])
    selected = np.sort(np.argsort(-np.sqrt((attention**2).mean(axis=0)), kind="stable")[:count])
    _, beta, c_v = _numpy_fit(q, k, v, selected, cfg.query_scale, float(np.exp(-3)), float(np.exp(3)), 2)
    compacted = out.layers[layer]
    kept = np.flatnonzero(np.asarray(compacted.keep[row, head, prefix : prefix + n]))
    np.testing.assert_array_equal(kept, selected)
    np.testing.assert_allclose(np.asarray(compacted.bias[row, head, prefix + kept]), beta, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(compacted.v[row, head, prefix + kept]), c_v, atol=2e-3, rtol=2e-3)


def test_am_hak_kb_keeps_kvzips_own_per_head_counts(setup):
    """am-hak-kb: KVzip's uncapped budgets, so each head keeps as many pairs as KVzip's pair-level eviction keeps
    there (at the same bytes' ratio), while its keys are HAK's and its values fitted."""
    cfg, params, cache, reread = setup
    config = dataclasses.replace(methods.get("am-hak-kb").options, ratio=0.3)
    out, counts = jax.jit(matching.compact)(params, cfg, cache, reread, config)
    evicted, _ = kvzip.score_and_evict(params, cfg, cache, reread, matching.effective_ratio(config, cache))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(kv.kept_per_head(evicted)) - 4)  # 4: the prefix
    assert np.asarray(counts).std() > 0  # budgets are uneven, or the test would not tell them from uniform ones


@pytest.mark.heavy
def test_each_head_is_its_own_fit_whatever_its_fit_size(setup, monkeypatch):
    """Global budgets fit each head at the smallest static size of budgets.fit_sizes that holds its count, padded
    to the largest: every head of the compacted cache holds what fit_head gives for that head alone, at exactly its
    count (its HAK keys, no padding). The ladder goes down to 4 here, so that this model's few keys span it."""
    monkeypatch.setattr(matching.budgets, "MIN_FIT_SIZE", 4)
    cfg, params, cache, reread = setup
    config = matching.MatchingConfig(ratio=0.3, selector="hak", budget="global")
    n = reread.chunk_size * reread.tokens.shape[0]
    ratio = matching.effective_ratio(config, cache)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads)
    sizes = np.array(matching.budgets.fit_sizes(matching.budgets.static_count(ratio, n, "global", config.head_cap)))
    queries = matching.reference_queries(params, cfg, cache, reread, with_scores=True)  # global budgets rank these
    out, counts = jax.jit(lambda *a: matching.compact_with(*a))(queries, cfg, cache, reread, config)  # traced here
    fitted_at = {int(sizes[sizes >= c].min()) for c in np.asarray(counts).ravel() if c > 0}
    assert len(fitted_at) > 2  # the heads ran at several fit sizes
    lower, upper, iters = config.nnls_bounds()
    # each head alone, under one jit per shape (eager ran the fit op by op, compiling each op at each count)
    scores_of = jax.jit(matching.attention_key_scores, static_argnames=("scale",))
    fit_of = jax.jit(matching.fit_head, static_argnames=("scale", "lower", "upper", "iters"))
    for l, b, k in np.ndindex(*shape):
        start, length, count = int(reread.prefix_len[b]), int(reread.context_len[b]), int(counts[l, b, k])
        q, rows = queries.q[l][b, k], queries.valid[b]
        keys, values = (x[b, k, start : start + length] for x in (cache.layers[l].k, cache.layers[l].v))
        scores = scores_of(q, keys, scale=cfg.query_scale, query_valid=rows)
        selected = jnp.sort(jax.lax.top_k(scores, count)[1])
        _, beta, c_v = fit_of(
            q, keys, values, selected, scale=cfg.query_scale, query_valid=rows, lower=lower, upper=upper, iters=iters
        )
        slots = start + np.asarray(selected)
        layer = out.layers[l]
        kept = np.flatnonzero(np.asarray(layer.keep[b, k, start : start + length])) + start
        np.testing.assert_array_equal(kept, slots)
        np.testing.assert_allclose(np.asarray(layer.bias[b, k, slots]), np.asarray(beta), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(layer.v[b, k, slots]), np.asarray(c_v), atol=1e-4, rtol=1e-4)
