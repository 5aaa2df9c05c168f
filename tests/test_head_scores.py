"""Head-level (context-independent) KVzip: head scores are the max over a sample of KVzip's pair scores, head_keep
budgets are exact, dropped heads keep only the prefix, what follows the context and the sink/recent windows, the
scores file round-trips, and a head-level compressed cache decodes without NaN."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.errors import KvzipError, ModelFileError
from kvzip_jax.kvzip import head_level
from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer, tiny_config
from tests.test_kvzip_score import _inputs, oracle_scores

PREFIX, CONTEXT = 4, 36
RNG = np.random.default_rng(0)
SEQUENCE = RNG.integers(0, 101, PREFIX + CONTEXT).astype(np.int32)
QUESTION = RNG.integers(0, 101, 6).astype(np.int32)


def _scores(cfg, params, chunk_size=16):
    """(head scores [L, K], pair scores [L, K, n]) of SEQUENCE = [prefix | context] on a tiny model."""
    reread, _ = _inputs(cfg, SEQUENCE[:PREFIX], SEQUENCE[PREFIX:], chunk_size)
    heads = head_level.context_head_scores(params, cfg, SEQUENCE, reread)
    _, cache = gen.prefill(params, cfg, [SEQUENCE], capacity=64)
    pairs = np.asarray(kvzip.score(params, cfg, cache, reread))[:, 0, :, :CONTEXT]
    return heads, pairs


@pytest.mark.parametrize("num_kv_heads, chunk_size", [(2, 16), (6, 64)])
def test_head_scores_are_the_max_over_the_context_of_the_oracle_pair_scores(num_kv_heads, chunk_size):
    """Against the float64 numpy oracle of KVzip's definition (not the scoring function head scores call)."""
    cfg = tiny_config(num_kv_heads)
    params = init_params(cfg, seed=1, scale=0.15)
    reread, rereads = _inputs(cfg, SEQUENCE[:PREFIX], SEQUENCE[PREFIX:], chunk_size)
    heads = head_level.context_head_scores(params, cfg, SEQUENCE, reread)
    expected = oracle_scores(params, cfg, SEQUENCE[:PREFIX], SEQUENCE[PREFIX:], rereads, chunk_size).max(axis=-1)
    assert heads.shape == (cfg.num_layers, num_kv_heads) and heads.dtype == np.float32
    np.testing.assert_allclose(heads, expected, atol=1e-5, rtol=0)
    assert np.isfinite(heads).all() and heads.min() > 0
    assert len(set(np.round(heads.ravel(), 4))) == heads.size  # distinct heads: a mix-up of heads would show


def test_head_scores_of_a_text_use_its_first_tokens_as_a_context():
    tok = bundled_tokenizer(registry.SMOLLM2)
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=len(tok),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeSpec(1000.0),
    )
    params = init_params(cfg, seed=3, scale=0.15)
    text = head_level.sample_text()
    assert text == head_level.sample_text() and len(text) > 20_000  # deterministic, long
    tokens, prefix_len = head_level.sample_tokens(tok, text, 40)
    assert len(tokens) == prefix_len + 40
    heads = head_level.head_scores(params, cfg, tok, text, max_tokens=40, chunk_size=16)
    reread = kvzip.reread_inputs(tok, [prefix_len], [tokens[prefix_len:]], 16)
    rereads = [np.asarray(reread.tokens[t, 0, : int(reread.num_valid[t, 0])]) for t in range(reread.tokens.shape[0])]
    expected = oracle_scores(params, cfg, tokens[:prefix_len], tokens[prefix_len:], rereads, 16).max(axis=-1)
    np.testing.assert_allclose(heads, expected, atol=1e-5, rtol=0)


def _gemma():
    cfg = ModelConfig(
        architecture="gemma3",
        vocab_size=101,
        hidden_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeSpec(10000.0),
        rope_sliding=RopeSpec(100.0),
        layer_types=("sliding", "full", "sliding"),
        sliding_window=8,
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=48**0.5,
    )
    return cfg, init_params(cfg, seed=2, scale=0.15)


def test_sliding_layers_score_infinity_and_keep_their_context():
    cfg, params = _gemma()
    heads, pairs = _scores(cfg, params)
    assert np.isinf(heads[[0, 2]]).all() and np.isfinite(heads[1]).all()
    np.testing.assert_allclose(heads[1], pairs[1].max(-1), atol=1e-6, rtol=0)
    keep = np.asarray(head_level.head_keep(heads, [CONTEXT], CONTEXT, 0.5))  # evictable: the finite layer
    assert keep[[0, 2]].all()
    assert keep[1, 0].all(-1).sum() == 1 and not keep[1, 0].any(-1).all()  # one of two heads kept, whole


def _units_kept(keep, b, c):
    """[L, K] bool: (layer, head) units that keep their whole context in row b (context length c)."""
    return keep[:, b, :, :c].all(-1)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.3, 0.5, 0.6, 0.99, 1.0])
@pytest.mark.parametrize("tied", [False, True])
def test_head_keep_budgets_are_exact_and_dropped_heads_keep_nothing(ratio, tied):
    L, K, n = 5, 3, 20
    context_len = np.array([20, 7])
    heads = RNG.integers(0, 3, (L, K)).astype(np.float32) if tied else RNG.random((L, K)).astype(np.float32)
    keep = np.asarray(head_level.head_keep(heads, context_len, n, ratio))
    assert keep.shape == (L, 2, K, n) and keep.dtype == bool
    for b, c in enumerate(context_len):
        whole = _units_kept(keep, b, c)
        assert whole.sum() == int(ratio * L * K + 1e-9)
        assert not keep[:, b, :, c:].any()
        assert not keep[:, b][~whole].any()  # dropped heads keep no context pair
        assert heads[whole].min(initial=np.inf) >= heads[~whole].max(initial=-np.inf)  # the best heads win
        assert (whole == _units_kept(keep, 0, context_len[0])).all()  # the same heads in every row


def test_dropped_heads_keep_the_sink_and_recent_windows_on_top_of_the_ratio():
    L, K, n, sink, recent = 4, 2, 30, 3, 5
    context_len = np.array([30, 12, 6])  # the last row's windows cover its whole context
    heads = RNG.random((L, K)).astype(np.float32)
    keep = np.asarray(head_level.head_keep(heads, context_len, n, 0.5, sink=sink, recent=recent, evictable=(1, 2, 3)))
    winners = heads >= np.sort(heads[1:].ravel())[-3]  # floor(0.5 x 3 layers x 2 heads) = 3 whole heads
    offsets = np.arange(n)
    for b, c in enumerate(context_len):
        full = offsets < c
        window = ((offsets < sink) | (offsets >= c - recent)) & full
        np.testing.assert_array_equal(keep[0, b], np.broadcast_to(full, (K, n)))  # not evictable: all kept
        for layer in range(1, L):
            for head in range(K):
                np.testing.assert_array_equal(keep[layer, b, head], full if winners[layer, head] else window)


def test_save_and_load_round_trip_and_named_errors(tmp_path):
    cfg = tiny_config(2)
    scores = np.array([[0.25, np.inf], [1.0, 0.123456789]], np.float32)
    path = head_level.save_head_scores(tmp_path, scores, {"model": "tiny", "tokens": 40})
    assert path == tmp_path / head_level.FILENAME and [p.name for p in tmp_path.iterdir()] == [path.name]
    record = json.loads(path.read_text())
    assert record["model"] == "tiny" and record["tokens"] == 40 and record["shape"] == [2, 2]
    assert record["scores"][0][1] is None
    loaded = head_level.load_head_scores(tmp_path, cfg)
    np.testing.assert_array_equal(loaded, scores)
    np.testing.assert_array_equal(head_level.load_head_scores(path), scores)
    with pytest.raises(head_level.HeadScoresError, match="shape"):
        head_level.load_head_scores(tmp_path, tiny_config(6))
    with pytest.raises(head_level.HeadScoresError, match="kvzip-jax head-scores") as missing:
        head_level.load_head_scores(tmp_path / "elsewhere")
    assert isinstance(missing.value, ModelFileError) and isinstance(missing.value, KvzipError)
    path.write_text("{not json")
    with pytest.raises(head_level.HeadScoresError, match="not a head-scores file"):
        head_level.load_head_scores(tmp_path)


@pytest.mark.parametrize("ratio, sink, recent", [(0.5, 2, 4), (0.25, 0, 0)])
def test_decoding_from_a_head_level_cache_is_finite_and_ragged_equals_masked(ratio, sink, recent):
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    heads, _ = _scores(cfg, params)
    keep = head_level.head_keep(heads, [CONTEXT], CONTEXT, ratio, sink, recent)
    _, cache = gen.prefill(params, cfg, [SEQUENCE], capacity=64)
    masked = kv.mask_context(cache, keep, jnp.array([PREFIX]), jnp.array([CONTEXT]))
    kept = np.asarray(kv.kept_per_head(masked))[:, 0]  # [L, K]
    assert sorted(kept.ravel().tolist()) == sorted(
        [PREFIX + CONTEXT] * int(ratio * 4) + [PREFIX + min(sink + recent, CONTEXT)] * (4 - int(ratio * 4))
    )
    ragged = kv.pack(masked, 16)
    logits_m, masked = gen.prefill(params, cfg, [QUESTION], jax.tree.map(jnp.array, masked))
    logits_r, ragged = gen.prefill(params, cfg, [QUESTION], ragged)
    assert np.isfinite(np.asarray(logits_r)).all()
    np.testing.assert_allclose(np.asarray(logits_r), np.asarray(logits_m), atol=1e-4, rtol=0)
    out_m, _ = gen.decode(params, cfg, logits_m, masked, 8)
    out_r, _ = gen.decode(params, cfg, logits_r, ragged, 8)
    assert out_m == out_r and len(out_r[0]) == 8
