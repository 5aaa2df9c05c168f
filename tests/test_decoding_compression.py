"""Compression while decoding (kvzip_jax/scorers/decoding.py) on a tiny random model: every cut leaves at most the
budget (the first tokens and the recent window kept, each head with room for the next block), the scores move with
their pairs, a budget that holds everything decodes exactly as plain greedy decoding, a threshold keeps what
passes, teacher-forced tokens replay a greedy generation cut for cut (and, uncut, predict as the full cache), and bad
settings are named."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.models.params import init_params
from kvzip_jax.scorers import decoding
from kvzip_jax.scorers.scorer import Scorer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(2)
    params = init_params(cfg, seed=3, scale=0.3)
    rng = np.random.default_rng(0)
    scorer = Scorer(
        {
            "w": jnp.asarray(rng.normal(size=(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads)), jnp.float32),
            "b": jnp.zeros((cfg.num_layers, cfg.num_kv_heads), jnp.float32),
        },
        "linear",
    )
    prompt = rng.integers(0, cfg.vocab_size, 20).astype(np.int32)
    return cfg, params, scorer, prompt


def test_every_cut_leaves_the_budget_first_and_recent_tokens_kept(model):
    cfg, params, scorer, prompt = model
    budget, interval, first, window = 24, 16, 2, 6
    tokens, cache, cuts = decoding.generate(
        params, cfg, prompt, 120, scorer=scorer, budget=budget, interval=interval, first=first, window=window
    )
    assert len(tokens) == 120 and len(cuts) >= 3
    units = cfg.num_layers * cfg.num_kv_heads
    for cut in cuts:
        assert cut.held > budget * units and cut.kept <= budget * units and cut.bytes > 0
    per_head = np.asarray(kv.kept_per_head(cache))[:, 0]  # [L, K] after the last block
    assert len(set(per_head.ravel().tolist())) > 1  # budgets differ by head
    capacity = cache.layers[0].capacity
    assert per_head.max() <= capacity and int(cache.next_position[0]) == prompt.size + 120
    # The first tokens keep their slots and keys: the prefill's.
    _, full = gen.prefill(params, cfg, [prompt], capacity=capacity)
    for layer, ref in zip(cache.layers, full.layers):
        np.testing.assert_allclose(np.asarray(layer.k[:, :, :first]), np.asarray(ref.k[:, :, :first]), atol=1e-5)


def test_a_budget_holding_everything_decodes_as_plain_greedy(model):
    cfg, params, scorer, prompt = model
    tokens, _, cuts = decoding.generate(params, cfg, prompt, 40, scorer=scorer, budget=200, interval=16, window=8)
    logits, cache = gen.prefill(params, cfg, [prompt], capacity=512)
    plain, _ = gen.decode(params, cfg, logits, cache, 40)
    assert cuts == [] and tokens == plain[0]


def test_threshold_keeps_what_passes(model):
    cfg, params, scorer, prompt = model
    tokens, cache, cuts = decoding.generate(
        params, cfg, prompt, 48, scorer=scorer, threshold=0.0, interval=16, window=4, first=2, capacity=96
    )
    assert len(tokens) == 48 and len(cuts) == 2  # a cut after every block but the last
    assert all(cut.kept < cut.held for cut in cuts)


def test_bad_settings_are_named(model):
    cfg, params, scorer, prompt = model
    with pytest.raises(ValueError, match="a budget or a threshold"):
        decoding.generate(params, cfg, prompt, 8, scorer=scorer)
    with pytest.raises(ValueError, match="a budget above first \\+ window"):
        decoding.generate(params, cfg, prompt, 8, scorer=scorer, budget=10, window=8, first=4)
    with pytest.raises(ValueError, match="holds no prompt"):
        decoding.generate(params, cfg, prompt, 8, scorer=scorer, budget=20, window=4, first=2, interval=16, capacity=24)


def test_a_cut_moves_each_pairs_score_with_it(model):
    cfg, params, scorer, prompt = model
    _, cache = gen.prefill(params, cfg, [prompt], capacity=40)
    L, K, C = cfg.num_layers, cfg.num_kv_heads, 40
    rng = np.random.default_rng(1)
    scores = np.where(np.arange(C) < prompt.size, rng.normal(size=(L, 1, K, C)), -np.inf).astype(np.float32)
    cut, moved = decoding._cut(cache, jnp.asarray(scores), 6, None, 2, 3, 8)
    assert int(kv.kept_per_head(cut).sum()) == 6 * L * K
    for layer, (new, old) in enumerate(zip(cut.layers, cache.layers)):
        for head in range(K):
            old_keys = np.asarray(old.k[0, head, : prompt.size])
            for slot in range(int(new.lengths[0, head])):
                (source,) = np.flatnonzero((old_keys == np.asarray(new.k[0, head, slot])).all(-1))
                assert moved[layer, 0, head, slot] == scores[layer, 0, head, source]
            kept_sources = [np.flatnonzero((old_keys == np.asarray(new.k[0, head, s])).all(-1))[0] for s in range(2)]
            assert kept_sources == [0, 1]  # the first tokens stay first


def test_forced_tokens_replay_a_greedy_generation_cut_for_cut(model):
    """Teacher forcing the tokens a greedy cut generation wrote cuts at the same places and predicts each next one."""
    cfg, params, scorer, prompt = model
    settings = dict(scorer=scorer, budget=24, interval=16, first=2, window=6)
    tokens, cache, cuts = decoding.generate(params, cfg, prompt, 80, **settings)
    predicted, replayed, replayed_cuts = decoding.generate(params, cfg, prompt, 80, forced=tokens, **settings)
    assert replayed_cuts == cuts and len(cuts) >= 2
    assert predicted[:-1] == tokens[1:]
    np.testing.assert_array_equal(np.asarray(kv.kept_per_head(replayed)), np.asarray(kv.kept_per_head(cache)))


def test_forced_tokens_without_a_cut_predict_as_the_full_cache(model):
    cfg, params, scorer, prompt = model
    text = np.random.default_rng(2).integers(0, cfg.vocab_size, 40).astype(np.int32)
    predicted, _, cuts = decoding.generate(params, cfg, prompt, 99, scorer=scorer, budget=200, interval=16, forced=text)
    logits, cache = gen.prefill(params, cfg, [prompt], capacity=128)
    full, _ = gen.forward_step(params, jnp.asarray(text[None]), jnp.full((1,), 40), cache, cfg, logits="all")
    assert cuts == [] and len(predicted) == 40
    assert predicted == np.asarray(jnp.argmax(full[0], axis=-1)).tolist()
