"""Baselines (H2O, SnapKV, PyramidKV, StreamingLLM, random) against numpy oracles on tiny random models, and their
budget rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvzip_jax import baselines
from kvzip_jax import generate as gen
from kvzip_jax.baselines.h2o import H2OObserver, h2o_scores
from kvzip_jax.baselines.observe import observe_span
from kvzip_jax.baselines.pyramidkv import pyramid_budgets
from kvzip_jax.baselines.snapkv import snapkv_scores, window_sizes
from kvzip_jax.baselines.streaming import streaming_scores
from kvzip_jax.kvzip.budget import RatioError
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.models.params import init_params
from tests.conftest import tiny_config
from tests.test_kvzip_score import numpy_queries_and_keys


def oracle_probs(params, cfg, sequence):
    """Per layer, the causal softmax weights [N, T, T] (query, key) of one float64 pass over sequence [T]."""
    T, G = len(sequence), cfg.group_size
    out = []
    for q, k, _, _ in numpy_queries_and_keys(params, cfg, sequence):
        logits = np.einsum("tnh,snh->nts", q, k[:, np.arange(cfg.num_heads) // G]) * cfg.head_dim**-0.5
        logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        out.append(probs / probs.sum(-1, keepdims=True))
    return out


def group_max(x, cfg):
    """[N, n] per query head -> [K, n] max over each KV head's group."""
    return x.reshape(cfg.num_kv_heads, cfg.group_size, -1).max(axis=1)


def window_of(n, q):
    return 16 if n < 1024 else 32


def oracle_h2o(params, cfg, prefix, context, question):
    """[L, K, n]: per query head, the weights a context key accumulates over every context and question row, then
    the max over the group; the context columns among the last w tokens of [context | question] +inf."""
    P, n, q = len(prefix), len(context), len(question)
    first = n + q - window_of(n, q)  # first context column inside the window
    out = []
    for probs in oracle_probs(params, cfg, np.concatenate([prefix, context, question])):
        scores = group_max(probs[:, P:, P : P + n].sum(axis=1), cfg)  # [K, n]
        out.append(np.where(np.arange(n) >= first, np.inf, scores))
    return np.stack(out)


def oracle_snapkv(params, cfg, prefix, context, question, kernel=7):
    """[L, K, n]: per query head, the last w rows' summed weights, max-pooled over the context columns before the
    window, then the max over the group; the window's context columns +inf."""
    P, n, q = len(prefix), len(context), len(question)
    T = P + n + q
    w = window_of(n, q)
    first = n + q - w  # first context column inside the window
    columns = np.arange(n)
    before = columns < min(first, n)
    out = []
    for probs in oracle_probs(params, cfg, np.concatenate([prefix, context, question])):
        sums = probs[:, max(T - w, P) :, P : P + n].sum(axis=1)  # [N, n]
        x = np.pad(np.where(before, sums, -np.inf), ((0, 0), (kernel // 2, kernel // 2)), constant_values=-np.inf)
        pooled = np.stack([x[:, j : j + kernel].max(axis=1) for j in range(n)], axis=1)  # [N, n]
        scores = np.where(before, group_max(pooled, cfg), -np.inf)
        out.append(np.where(columns >= first, np.inf, scores))
    return np.stack(out)


def make_batch(cfg, prefix_lens, context_lens, question_lens, capacity, seed=0):
    """Two rows of [prefix | context] prefilled; context and question tokens right-padded with junk tokens."""
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(seed)
    draw = lambda size: rng.integers(0, cfg.vocab_size, size).astype(np.int32)
    prefixes, contexts, questions = map(
        lambda lens: [draw(m) for m in lens], (prefix_lens, context_lens, question_lens)
    )
    _, cache = gen.prefill(params, cfg, [np.concatenate(pc) for pc in zip(prefixes, contexts)], capacity=capacity)
    pad = lambda rows: np.stack([np.concatenate([r, draw(max(map(len, rows)) - len(r))]) for r in rows])
    lengths = lambda lens: jnp.asarray(lens, jnp.int32)
    return dict(
        params=params,
        cache=cache,
        prefixes=prefixes,
        contexts=contexts,
        questions=questions,
        prefix_len=lengths(prefix_lens),
        context_len=lengths(context_lens),
        context_tokens=jnp.asarray(pad(contexts)),
        question=(jnp.asarray(pad(questions)), lengths(question_lens)),
    )


def check_against_oracle(ours, oracle, batch, with_question, atol=1e-5):
    ours = np.asarray(ours)
    for b, (prefix, context, question) in enumerate(zip(batch["prefixes"], batch["contexts"], batch["questions"])):
        n = len(context)
        expected = oracle(prefix, context, question if with_question else question[:0])
        np.testing.assert_allclose(ours[:, b, :, :n], expected, atol=atol, rtol=0)
        assert np.all(np.isneginf(ours[:, b, :, n:]))


@pytest.mark.parametrize("num_kv_heads, qkv_bias", [(2, False), (6, True)])  # GQA group 3; no GQA
@pytest.mark.parametrize("with_question", [False, True])
def test_h2o_and_snapkv_equal_the_numpy_oracle(num_kv_heads, qkv_bias, with_question):
    # Questions of 5 and 20 tokens: row 0's window straddles context and question, row 1's lies in the question.
    # Capacity 64 < 7 + 40 + 20: the question's last keys have no cache slot (dropped).
    cfg = tiny_config(num_kv_heads, qkv_bias)
    batch = make_batch(cfg, [4, 7], [23, 40], [5, 20], capacity=64)
    args = (
        batch["params"],
        cfg,
        batch["cache"],
        batch["prefix_len"],
        batch["context_len"],
        batch["context_tokens"],
        batch["question"] if with_question else None,
    )
    h2o = jax.jit(h2o_scores, static_argnames="chunk")(*args, chunk=16)  # three chunks; row 0's last one empty
    oracle = lambda p, c, q: oracle_h2o(batch["params"], cfg, p, c, q)
    check_against_oracle(h2o, oracle, batch, with_question)
    np.testing.assert_allclose(np.asarray(jax.jit(h2o_scores)(*args)), np.asarray(h2o), atol=1e-5)  # one chunk
    snap = jax.jit(snapkv_scores)(*args)
    oracle = lambda p, c, q: oracle_snapkv(batch["params"], cfg, p, c, q)
    check_against_oracle(snap, oracle, batch, with_question)


def test_windows_of_32_above_1024_context_tokens():
    """Rows of 1,100 and 900 context tokens in one batch: windows of 32 and 16; H2O over three chunks. The model's
    float32 RoPE angles past position 1,000 already move its queries by ~4e-5 from the float64 oracle's, hence
    the wider tolerance (a window of 16 instead of 32 would be off by far more)."""
    cfg = tiny_config(2, max_position=2048)
    batch = make_batch(cfg, [3, 5], [1100, 900], [6, 40], capacity=1152)
    args = (
        batch["params"],
        cfg,
        batch["cache"],
        batch["prefix_len"],
        batch["context_len"],
        batch["context_tokens"],
        batch["question"],
    )
    oracle = lambda p, c, q: oracle_snapkv(batch["params"], cfg, p, c, q)
    check_against_oracle(jax.jit(snapkv_scores)(*args), oracle, batch, True, atol=1e-4)
    oracle = lambda p, c, q: oracle_h2o(batch["params"], cfg, p, c, q)
    check_against_oracle(jax.jit(h2o_scores)(*args), oracle, batch, True, atol=1e-4)


def test_window_sizes():
    np.testing.assert_array_equal(window_sizes(jnp.array([5, 1023, 1024, 5000])), [16, 16, 32, 32])
    np.testing.assert_array_equal(window_sizes(jnp.array([5, 5000]), window=8), [8, 8])


def test_observe_span_leaves_the_cache_unchanged():
    cfg = tiny_config(2)
    batch = make_batch(cfg, [4, 7], [23, 40], [5, 20], capacity=64)
    cache = batch["cache"]
    before = [np.array(x) for x in jax.tree.leaves(cache)]
    tokens, start, num_valid = batch["context_tokens"][:, 10:20], batch["prefix_len"] + 10, jnp.array([10, 10])
    for run in (observe_span, jax.jit(observe_span)):
        observed = run(batch["params"], cfg, cache, tokens, start, num_valid, H2OObserver(num_valid))
        assert len(observed) == cfg.num_layers and observed[0].shape == (2, cfg.num_kv_heads, cfg.group_size, 64)
        for x, y in zip(before, jax.tree.leaves(cache)):
            assert not y.is_deleted()
            np.testing.assert_array_equal(x, np.asarray(y))


def oracle_pyramid(percent, L, K, n, w=None, beta=20.0):
    """[L] real pairs per layer from KVCache-Factory's PyramidKVCluster schedule (float64), per head C = the uniform
    budget, a line over C - w and the window on top of every layer; uniform when n < 2 (C - w)."""
    w = min(window_of(n, 0) if w is None else w, n)
    uniform = K * n * percent // 100
    chosen = uniform / K - w
    if n < 2 * chosen or chosen <= 0 or L == 1:
        return np.full(L, float(uniform))
    low = chosen / beta
    high = 2 * chosen - low
    if high > n - w:
        high, low = n - w, 2 * chosen - (n - w)
    return K * (high - np.arange(L) * (high - low) / (L - 1) + w)


@pytest.mark.heavy
@settings(max_examples=60, deadline=None)
@given(
    percent=st.integers(1, 100),
    num_layers=st.integers(1, 32),
    num_kv_heads=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 3000), min_size=2, max_size=2),
)
def test_pyramid_budgets_follow_the_published_schedule_with_an_exact_total(percent, num_layers, num_kv_heads, lengths):
    L, K = num_layers, num_kv_heads
    counts = np.asarray(pyramid_budgets(percent / 100, jnp.asarray(lengths), L, K))
    assert counts.shape == (L, 2) and counts.dtype == np.int32
    for b, n in enumerate(lengths):
        column = counts[:, b]
        assert np.all(np.diff(column) <= 0) and np.all(column >= 0) and np.all(column <= K * n)
        assert column.sum() == L * (K * n * percent // 100)  # what uniform layer budgets spend, exactly
        ideal = oracle_pyramid(percent, L, K, n)
        assert np.abs(column - ideal).max() < 2, (column, ideal)  # integer rounding of the published line
        w = min(window_of(n, 0), n)
        if K * n * percent // 100 >= K * w:  # a budget that pays for the window keeps it in every layer
            assert column.min() >= K * w


def test_pyramid_budgets_jit_with_a_traced_ratio_fallback_and_clamp():
    lengths = jnp.array([100, 3000])
    jitted = jax.jit(pyramid_budgets, static_argnums=(2, 3))(jnp.float32(0.3), lengths, 5, 2)
    eager = pyramid_budgets(0.3, lengths, 5, 2)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
    # 100 tokens at 0.3, window 16: C = 30 per head, 100 >= 2 (30 - 16), so a line 27.3 .. 0.7 plus the window
    np.testing.assert_array_equal(np.asarray(eager)[:, 0], [87, 73, 60, 47, 33])
    at_06 = np.asarray(pyramid_budgets(0.6, lengths, 5, 2))
    # 3,000 tokens at 0.6: 3,000 < 2 (1,800 - 32), so every layer gets the uniform budget
    np.testing.assert_array_equal(at_06[:, 1], [3600] * 5)
    # 100 tokens at 0.6: the line's top 85.8 passes n - w = 84, so it is clamped there (the first layer keeps all)
    np.testing.assert_array_equal(at_06[:, 0], [200, 160, 120, 80, 40])


L, B, K, N = 3, 2, 2, 17
CONTEXT = np.array([N, 9], np.int32)


def oracle_keep_by_layer(scores, context_len, counts, share=0.2):
    """keep [L, B, K, n] from the allocation rule, pair by pair: +inf pairs first, then each head's best
    floor(share x rest / K), then the layer's best (ties to the lower head, then the lower column)."""
    L, B, K, n = scores.shape
    keep = np.zeros(scores.shape, bool)
    for layer in range(L):
        for b in range(B):
            c = context_len[b]
            s = scores[layer, b, :, :c]
            forced = np.isposinf(s)
            rest = max(int(counts[layer, b]) - int(forced.sum()), 0)
            floor = int(share * 10**6) * rest // 10**6 // K
            chosen = forced.copy()
            for head in range(K):
                open_ = [i for i in range(c) if not forced[head, i]]
                for i in sorted(open_, key=lambda i: (-s[head, i], i))[:floor]:
                    chosen[head, i] = True
            left = rest - int((chosen & ~forced).sum())
            open_ = [(h, i) for h in range(K) for i in range(c) if not chosen[h, i]]
            for h, i in sorted(open_, key=lambda hi: (-s[hi], hi))[:left]:
                chosen[h, i] = True
            keep[layer, b, :, :c] = chosen
    return keep


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(["random", "tied", "constant"]),
    windows=st.lists(st.integers(0, 6), min_size=2, max_size=2),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 12)),
)
def test_keep_by_layer_equals_the_allocation_rule(seed, kind, windows, shape):
    """Windows (+inf) always kept, a per-head floor, then the layer's best: against a pair-by-pair oracle, with any
    counts (0, small, more than the layer holds), ties and windows larger than the budget."""
    L, K, n = shape
    rng = np.random.default_rng(seed)
    scores = {
        "random": rng.random((L, 2, K, n)),
        "tied": rng.integers(0, 3, (L, 2, K, n)).astype(float),
        "constant": np.full((L, 2, K, n), 0.5),
    }[kind].astype(np.float32)
    context_len = np.array([n, rng.integers(1, n + 1)], np.int32)
    for b, w in enumerate(windows):
        scores[:, b, :, max(context_len[b] - w, 0) : context_len[b]] = np.inf
    counts = rng.integers(0, K * n + 3, (L, 2)).astype(np.int32)
    keep = np.asarray(
        jax.jit(baselines.keep_by_layer)(jnp.asarray(scores), jnp.asarray(context_len), jnp.asarray(counts))
    )
    np.testing.assert_array_equal(keep, oracle_keep_by_layer(scores, context_len, counts))
    for layer in range(L):
        for b, c in enumerate(context_len):
            forced = K * min(windows[b], c)
            assert keep[layer, b].sum() == max(min(counts[layer, b], K * c), forced)  # exact unless the window
            assert not keep[layer, b, :, c:].any()  # alone exceeds it


def test_a_late_pyramid_layer_starves_no_head():
    """One head attends far more than the others: with the window paid first and a per-head floor, every head of
    the last (smallest) pyramid layer keeps its window and a share of the rest."""
    L, K, n = 8, 4, 600
    scores = np.random.default_rng(0).random((L, 1, K, n)).astype(np.float32)
    scores[:, :, 0] += 10.0  # head 0 outscores every other head
    scores[..., n - 16 :] = np.inf  # SnapKV's window of 16 (a context under 1,024 tokens)
    context_len = jnp.array([n])
    keep = np.asarray(baselines.keep_for("pyramidkv", jnp.asarray(scores), context_len, 0.2))
    counts = np.asarray(pyramid_budgets(0.2, context_len, L, K))[:, 0]
    assert counts[-1] < counts[0] and keep.sum() == L * (K * n // 5)
    last = keep[-1, 0]  # [K, n]
    rest = counts[-1] - K * 16
    for head in range(K):
        assert last[head, n - 16 :].all()  # the window, in every layer
        assert last[head, : n - 16].sum() >= rest // 5 // K  # the per-head floor


def expected_total(method, c, percent, evicted_layers=L):
    if method == "kvzip":
        return evicted_layers * K * c * percent // 100
    if method == "streamingllm":
        return evicted_layers * K * (c * percent // 100)
    return evicted_layers * (K * c * percent // 100)  # layer budgets, pyramidkv's summing to the uniform total


@pytest.mark.parametrize("method", baselines.METHODS)
def test_keep_for_budgets_and_jit(method):
    scores = jnp.asarray(np.random.default_rng(2).random((L, B, K, N)), jnp.float32)
    context_len = jnp.asarray(CONTEXT)
    eager = np.asarray(baselines.keep_for(method, scores, context_len, 0.3))
    jitted = jax.jit(baselines.keep_for, static_argnames=("method", "evictable"))(
        scores=scores, context_len=context_len, ratio=jnp.float32(0.3), method=method
    )
    np.testing.assert_array_equal(eager, np.asarray(jitted))
    for b, c in enumerate(CONTEXT):
        assert not eager[:, b, :, c:].any()
        assert eager[:, b].sum() == expected_total(method, c, 30)
    if method in ("h2o", "snapkv", "random", "pyramidkv"):
        budget = pyramid_budgets if method == "pyramidkv" else baselines.uniform_layer_counts
        counts = np.asarray(budget(0.3, context_len, L, K))
        np.testing.assert_array_equal(eager, oracle_keep_by_layer(np.asarray(scores), CONTEXT, counts))
    if method == "kvzip":
        np.testing.assert_array_equal(eager, np.asarray(keep_mask(scores, context_len, 0.3, "pair")))
    partial = np.asarray(baselines.keep_for(method, scores, context_len, 0.3, evictable=(1,)))
    for b, c in enumerate(CONTEXT):
        assert partial[[0, 2], b, :, :c].all() and not partial[:, b, :, c:].any()
        assert partial[1, b].sum() == expected_total(method, c, 30, evicted_layers=1)
    with pytest.raises(RatioError):
        baselines.keep_for(method, scores, context_len, 1.5)


@pytest.mark.parametrize("percent", [10, 30, 80])
def test_streaming_keeps_sinks_and_the_most_recent(percent):
    context_len = jnp.asarray(CONTEXT)
    scores = streaming_scores(context_len, L, K, N)
    keep = np.asarray(baselines.keep_for("streamingllm", scores, context_len, percent / 100))
    for b, c in enumerate(CONTEXT):
        count = c * percent // 100
        expected = set(range(min(count, 4))) | set(range(c - max(count - 4, 0), c))
        for layer in range(L):
            for head in range(K):
                assert set(np.flatnonzero(keep[layer, b, head])) == expected


def test_random_scores_are_deterministic_per_key():
    cfg = tiny_config(2)
    context_len = jnp.asarray(CONTEXT)
    tokens = jnp.zeros((B, N), jnp.int32)
    score = lambda key: np.asarray(
        baselines.baseline_scores("random", None, cfg, None, None, context_len, tokens, key=key)
    )
    first, again, other = score(jax.random.key(0)), score(jax.random.key(0)), score(jax.random.key(1))
    np.testing.assert_array_equal(first, again)
    assert first.shape == (cfg.num_layers, B, cfg.num_kv_heads, N)
    assert not np.array_equal(first, other)
    assert np.all(np.isneginf(first[:, 1, :, 9:])) and np.all((first[:, 1, :, :9] >= 0) & (first[:, 1, :, :9] < 1))
    with pytest.raises(ValueError, match="PRNG key"):
        baselines.baseline_scores("random", None, cfg, None, None, context_len, tokens)
    # one key per row: a row's scores follow its own key, whatever the other rows
    rows = jnp.stack([jax.random.key(5), jax.random.key(6)])
    swapped = jnp.stack([jax.random.key(7), jax.random.key(5)])
    per_row, other_rows = score(rows), score(swapped)
    np.testing.assert_array_equal(per_row[:, 0, :, :9], other_rows[:, 1, :, :9])
    assert not np.array_equal(per_row[:, 0], per_row[:, 1])
    wider = np.asarray(
        baselines.baseline_scores(
            "random", None, cfg, None, None, context_len, jnp.zeros((B, N + 5), jnp.int32), key=rows
        )
    )
    np.testing.assert_array_equal(wider[..., :N], per_row)  # independent of the padded width


@pytest.mark.parametrize("method", ["kvzip", "nope"])
def test_unknown_methods_are_refused(method):
    cfg = tiny_config(2)
    with pytest.raises(ValueError, match="h2o"):
        baselines.baseline_scores(method, None, cfg, None, None, jnp.asarray(CONTEXT), jnp.zeros((B, N), jnp.int32))
    if method == "nope":
        with pytest.raises(ValueError, match="streamingllm"):
            baselines.keep_for(method, jnp.zeros((L, B, K, N)), jnp.asarray(CONTEXT), 0.3)


def test_streaming_scores_dispatch():
    cfg = tiny_config(2)
    context_len = jnp.asarray(CONTEXT)
    scores = baselines.baseline_scores("streamingllm", None, cfg, None, None, context_len, jnp.zeros((B, N)))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(streaming_scores(context_len, cfg.num_layers, K, N)))
