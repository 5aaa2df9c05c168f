"""The trained scorers inside the model and the registry (kvzip_jax/scorers/features.py, methods/trained.py), on a
tiny random model: the attention inputs fed again over the prefix are the prefill's own, chunk by chunk; a scorer's
scores are its function of them; fast-kvzip and kvzap keep exactly KVzip's budget of the scorer's top pairs, the
recent window first; jit equals eager; a scorer of the other kind is a named error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import generate as gen
from kvzip_jax import methods
from kvzip_jax.kvzip.budget import kept_count
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.models.params import init_params
from kvzip_jax.models.transformer import forward
from kvzip_jax.scorers import features, gate
from kvzip_jax.scorers.scorer import Scorer
from tests.conftest import tiny_config

PREFIX = 4


@pytest.fixture(scope="module")
def setup():
    """A tiny random model's cache of [prefix 4 | context] for two rows of 40 and 29 context tokens, the rows, and
    the inputs the trained methods read."""
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 101, PREFIX + n).astype(np.int32) for n in (40, 29)]
    _, cache = gen.prefill(params, cfg, rows, capacity=128)
    tokens = np.zeros((2, 64), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row) - PREFIX] = row[PREFIX:]
    inputs = methods.Inputs(
        jnp.full((2,), PREFIX, jnp.int32), jnp.array([40, 29], jnp.int32), context_tokens=jnp.asarray(tokens)
    )
    return cfg, params, cache, inputs, rows


def prefill_hidden(params, cfg, row) -> np.ndarray:
    """[L, T, D] the attention inputs of one sequence in one forward from an empty cache."""
    from kvzip_jax import cache as kv

    tokens = jnp.asarray(row[None], jnp.int32)
    positions = jnp.arange(len(row), dtype=jnp.int32)[None]
    cache = kv.init_cache(cfg, 1, 64, jnp.float32)
    _, _, aux = forward(params, tokens, positions, cache, cfg, features.HiddenObserver(), logits=None)
    return np.asarray(jnp.stack(aux["observed"]))[:, 0]


def scorers(cfg):
    layers, width, heads = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads
    gate_cfg = gate.GateConfig(layers, width, heads, cfg.num_heads // heads, rank=4, sinks=3)
    gates = gate.init_gates(gate_cfg, jax.random.key(0))
    gates = {**gates, "k_base": 0.3 * jax.random.normal(jax.random.key(1), gates["k_base"].shape)}
    rng = np.random.default_rng(2)
    weights = {
        "w": jnp.asarray(rng.normal(size=(layers, width, heads)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(layers, heads)), jnp.float32),
    }
    return Scorer(gates, "gate", gate_cfg), Scorer(weights, "linear")


@pytest.mark.parametrize("chunk", [8, 64])
def test_context_hidden_is_the_prefills_own_in_every_chunk(setup, chunk):
    cfg, params, cache, inputs, rows = setup
    hidden = features.context_hidden(
        params, cfg, cache, inputs.prefix_len, inputs.context_len, inputs.context_tokens, chunk
    )  # [L, B, n, D]
    for b, row in enumerate(rows):
        n = len(row) - PREFIX
        want = prefill_hidden(params, cfg, row)[:, PREFIX:]  # [L, n, D]
        np.testing.assert_allclose(np.asarray(hidden[:, b, :n]), want, atol=1e-5, rtol=1e-5)


def test_scores_are_the_scorers_function_of_the_hidden_states_and_minus_inf_past_the_context(setup):
    cfg, params, cache, inputs, _ = setup
    args = (params, cfg, cache, inputs.prefix_len, inputs.context_len, inputs.context_tokens)
    hidden = features.context_hidden(*args)  # [L, B, n, D]
    for scorer in scorers(cfg):
        got = np.asarray(jax.jit(features.context_scores)(*args, scorer))  # [L, B, K, n]
        for layer in range(cfg.num_layers):
            want = np.asarray(scorer.layer_scores(layer, hidden[layer]))  # [B, K, n]
            for b, n in enumerate(np.asarray(inputs.context_len)):
                np.testing.assert_allclose(got[layer, b, :, :n], want[b, :, :n], atol=1e-5, rtol=1e-5)
                assert np.all(np.isneginf(got[layer, b, :, n:]))
        if scorer.kind == "gate":
            finite = got[np.isfinite(got)]
            assert finite.min() > 0 and finite.max() < 1
    one = scorers(cfg)[1]  # the linear scorer by hand: w . h + b
    by_hand = np.einsum("btd,dk->bkt", np.asarray(hidden[0]), np.asarray(one.params["w"][0]))
    by_hand += np.asarray(one.params["b"][0])[None, :, None]
    np.testing.assert_allclose(
        np.asarray(features.context_scores(*args, one))[0, 0, :, :40], by_hand[0, :, :40], atol=1e-4
    )


@pytest.mark.parametrize("name", ["fast-kvzip", "kvzap"])
def test_a_trained_method_keeps_kvzips_budget_of_its_scorers_top_pairs_recent_window_first(setup, name):
    cfg, params, cache, inputs, _ = setup
    gate_scorer, linear_scorer = scorers(cfg)
    method = methods.get(name)
    scorer = gate_scorer if name == "fast-kvzip" else linear_scorer
    given = methods.Inputs(inputs.prefix_len, inputs.context_len, context_tokens=inputs.context_tokens, scorer=scorer)
    options = method.options_for(window=5)
    got = jax.jit(method.compress)(params, cfg, cache, given, 0.3, options)
    scores = np.array(
        features.context_scores(
            params, cfg, cache, inputs.prefix_len, inputs.context_len, inputs.context_tokens, scorer
        )
    )
    for b, n in enumerate(np.asarray(inputs.context_len)):
        scores[:, b, :, n - 5 : n] = np.inf
    keep = np.asarray(keep_mask(jnp.asarray(scores), inputs.context_len, 0.3))  # [L, B, K, n]
    for layer, (new, old) in enumerate(zip(got.layers, cache.layers)):
        for b, n in enumerate(np.asarray(inputs.context_len)):  # the context's slots
            np.testing.assert_array_equal(np.asarray(new.keep)[b, :, PREFIX : PREFIX + n], keep[layer, b, :, :n])
        assert np.all(np.asarray(new.keep)[:, :, :PREFIX])  # the prefix stays
    for b, n in enumerate(np.asarray(inputs.context_len)):
        total = sum(int(np.asarray(layer.keep)[b, :, PREFIX : PREFIX + n].sum()) for layer in got.layers)
        assert total == int(kept_count(0.3, cfg.num_layers * cfg.num_kv_heads * int(n)))
        for layer in got.layers:
            assert np.all(np.asarray(layer.keep)[b, :, PREFIX + n - 5 : PREFIX + n])  # the recent window is kept
    eager = method.compress(params, cfg, cache, given, 0.3, options)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    other = methods.Inputs(
        inputs.prefix_len,
        inputs.context_len,
        context_tokens=inputs.context_tokens,
        scorer=linear_scorer if name == "fast-kvzip" else gate_scorer,
    )
    with pytest.raises(methods.MethodError, match="reads a .* scorer; the one given is a"):
        method.compress(params, cfg, cache, other, 0.3)
    with pytest.raises(methods.MethodError, match="needs the input"):
        method.jitted_prepare(params, cfg, cache, methods.Inputs(inputs.prefix_len, inputs.context_len), options)


def test_scores_during_the_prefill_equal_the_scores_of_the_context_fed_again(setup):
    """One pass: the prefill itself scores every token (generate.prefill_observed), as context_scores does after it,
    and its cache is the plain prefill's."""
    cfg, params, cache, inputs, rows = setup
    _, linear_scorer = scorers(cfg)
    _, observed_cache, during = features.prefill_scores(params, cfg, rows, linear_scorer, capacity=128, chunk=16)
    after = features.context_scores(
        params, cfg, cache, inputs.prefix_len, inputs.context_len, inputs.context_tokens, linear_scorer
    )
    for b, row in enumerate(rows):
        n = len(row) - PREFIX
        np.testing.assert_allclose(
            np.asarray(during[:, b, :, PREFIX : PREFIX + n]), np.asarray(after[:, b, :, :n]), atol=1e-4, rtol=1e-5
        )
    for a, e in zip(observed_cache.layers, cache.layers):
        np.testing.assert_allclose(np.asarray(a.k), np.asarray(e.k), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(e.lengths))


def test_threshold_keeps_what_passes_in_each_head_and_the_window(setup):
    """With a threshold the ratio is an outcome: every context pair scoring at least T stays, the rest go, outside
    the recent window; heads keep different counts."""
    cfg, params, cache, inputs, _ = setup
    _, linear_scorer = scorers(cfg)
    method = methods.get("kvzap")
    given = methods.Inputs(
        inputs.prefix_len, inputs.context_len, context_tokens=inputs.context_tokens, scorer=linear_scorer
    )
    scores = np.asarray(
        features.context_scores(
            params, cfg, cache, inputs.prefix_len, inputs.context_len, inputs.context_tokens, linear_scorer
        )
    )
    threshold = float(np.median(scores[np.isfinite(scores)]))
    options = method.options_for(window=5, threshold=threshold)
    got = jax.jit(method.compress)(params, cfg, cache, given, 1.0, options)
    counts = set()
    for layer, new in enumerate(got.layers):
        for b, n in enumerate(np.asarray(inputs.context_len)):
            want = scores[layer, b, :, :n] >= threshold
            want[:, n - 5 :] = True
            np.testing.assert_array_equal(np.asarray(new.keep)[b, :, PREFIX : PREFIX + n], want)
            counts |= set(want.sum(axis=-1).tolist())
    assert len(counts) > 1  # per-head budgets differ


def test_the_default_window_is_2_percent_with_a_ratio_and_128_tokens_with_a_threshold():
    """Both methods keep the recent 2% of each context under a ratio (Fast KVzip's prefill), DMSPress's 128 tokens
    under a threshold, and an explicit window either way; never more than the context."""
    from kvzip_jax.methods.trained import THRESHOLD_WINDOW, ScorerOptions, recent_window

    assert THRESHOLD_WINDOW == 128
    context_len = jnp.array([0, 49, 50, 1000, 6400, 100], jnp.int32)
    for name in ("fast-kvzip", "kvzap"):
        options = methods.get(name).options_for()
        assert isinstance(options, ScorerOptions) and options.window is None
        np.testing.assert_array_equal(recent_window(context_len, options), [0, 0, 1, 20, 128, 2])
        thresholded = methods.get(name).options_for(threshold=-4.0)
        np.testing.assert_array_equal(recent_window(context_len, thresholded), [0, 49, 50, 128, 128, 100])
        for threshold in (None, -4.0):
            fixed = methods.get(name).options_for(window=64, threshold=threshold)
            np.testing.assert_array_equal(recent_window(context_len, fixed), [0, 49, 50, 64, 64, 64])


def test_compress_threshold_flag_is_checked_before_loading(tmp_path, capsys):
    from kvzip_jax import cli

    context = tmp_path / "c.txt"
    context.write_text("some context")
    base = ["compress", "--model", "no-such-model", "--context", str(context)]
    for extra, message in (
        (["--method", "kvzip", "--threshold", "-4"], "--threshold is an option of fast-kvzip and kvzap"),
        (["--method", "kvzap"], "give --ratio, or --threshold"),
        (["--method", "kvzap", "--ratio", "0.3", "--threshold", "-4"], "give --ratio, or --threshold"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(base + extra)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
