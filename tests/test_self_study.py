"""Self-study probes (matching.self_study) on a tiny random model with SmolLM2's tokenizer: the turns are sampled
reproducibly, the cache is left as it was, and they serve as reference queries for compact."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, matching, prompts
from kvzip_jax.kvzip import scoring
from kvzip_jax.matching import self_study
from kvzip_jax.models.transformer import forward
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer

from .test_compact import compact_jit_and_eager
from .test_eval_sweep import tiny_model

_queries = jax.jit(matching.reference_queries, static_argnames=("sources", "cap", "with_scores"))  # compiled once
_compact_with = jax.jit(matching.compact_with)
_forward = jax.jit(forward, static_argnames=("cfg", "logits"))


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(bundled_tokenizer(registry.SMOLLM2))
    texts = ["The code of the blue door is 4471. Ada keeps the key. " * 3, "Bo met Cy in Lima on May 2. " * 4]
    parts = [prompts.split_for_reuse(model.tokenizer, t, [])[0] for t in texts]
    _, cache = gen.prefill(model.params, model.cfg, [p.ids() for p in parts])  # capacity: exactly the prompts
    reread = kvzip.reread_inputs(
        model.tokenizer, [p.context_start for p in parts], [p.ids()[p.context_slice] for p in parts], chunk_size=32
    )
    return model, cache, reread


def test_probes_are_prompt_then_sampled_answer_reproducibly(setup):
    model, cache, _ = setup
    before = [np.asarray(x) for x in jax.tree.leaves(cache)]
    got = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=12, seed=3)
    again = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=12, seed=3)
    other = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=12, seed=4)
    P, B = len(self_study.PROMPTS), cache.batch_size
    assert got.tokens.shape[:2] == (P, B) and got.num_valid.shape == (P, B)
    for p, text in enumerate(self_study.PROMPTS):
        suffix = prompts.question_suffix(model.tokenizer, text)
        for b in range(B):
            n = int(got.num_valid[p, b])
            assert len(suffix) < n <= len(suffix) + 12  # the prompt, then at least one sampled token
            np.testing.assert_array_equal(np.asarray(got.tokens[p, b, : len(suffix)]), suffix)
            assert (np.asarray(got.tokens[p, b, n:]) == 0).all()
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(again.tokens))
    assert not np.array_equal(np.asarray(got.tokens), np.asarray(other.tokens))
    for a, b in zip(before, jax.tree.leaves(cache)):
        np.testing.assert_array_equal(a, np.asarray(b))  # the cache is left as it was (and not donated)


def test_probes_from_rows_right_pads_turns_already_written():
    rows = [[np.array([5, 6, 7], np.int32), np.array([8], np.int32)], [np.array([9, 10], np.int32)] * 2]  # [P][B]
    got = self_study.probes_from_rows(rows)
    np.testing.assert_array_equal(np.asarray(got.tokens), [[[5, 6, 7], [8, 0, 0]], [[9, 10, 0], [9, 10, 0]]])
    np.testing.assert_array_equal(np.asarray(got.num_valid), [[3, 1], [2, 2]])


@pytest.mark.heavy
def test_self_study_probes_serve_as_reference_queries(setup):
    """(On-policy with self-study runs in tests/test_cli.py, through compress --method kvzip-am-op --self-study.)"""
    model, cache, reread = setup
    probes = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=8)
    config = matching.MatchingConfig(ratio=0.3, sources=("repeat", "self-study"))
    out, _ = compact_jit_and_eager(model.params, model.cfg, cache, reread, config, probes)
    repeat_only, _ = matching.compact(model.params, model.cfg, cache, reread, matching.MatchingConfig(ratio=0.3))
    assert not np.allclose(np.asarray(out.layers[0].v), np.asarray(repeat_only.layers[0].v))  # the probes count


@pytest.mark.heavy
def test_samples_of_every_prompt_are_written_in_batches(setup):
    """samples=2: P x 2 turns, prompt-major, each its prompt then a sampled answer; two samples of one prompt differ
    (rows of one batch draw independently); max_rows bounds a batch without changing what the turns are made of."""
    model, cache, _ = setup
    P, B = len(self_study.PROMPTS), cache.batch_size
    for max_rows in (None, B):  # all 2 P B rows at once; one turn (B rows) per batch
        got = self_study.probes(
            model.params, model.cfg, model.tokenizer, cache, samples=2, max_new_tokens=10, seed=1, max_rows=max_rows
        )
        assert got.tokens.shape[:2] == (2 * P, B)
        for turn in range(2 * P):
            suffix = prompts.question_suffix(model.tokenizer, self_study.PROMPTS[turn // 2])
            for b in range(B):
                assert len(suffix) < int(got.num_valid[turn, b]) <= len(suffix) + 10
                np.testing.assert_array_equal(np.asarray(got.tokens[turn, b, : len(suffix)]), suffix)
        assert not np.array_equal(np.asarray(got.tokens[0]), np.asarray(got.tokens[1]))
    with pytest.raises(ValueError, match="samples"):
        self_study.probes(model.params, model.cfg, model.tokenizer, cache, samples=0)


def test_the_probes_pass_captures_each_probe_on_its_own_row(setup):
    """The self-study source runs every probe in one pass over the tiled cache; its captured queries equal an oracle
    that runs each probe alone on the cache (rows g R + p W + w: query head g, probe p, position w)."""
    model, cache, _ = setup
    cfg = model.cfg
    probes = self_study.probes(model.params, cfg, model.tokenizer, cache, max_new_tokens=6)
    P, B, W = probes.tokens.shape
    G = cfg.group_size
    got = _queries(model.params, cfg, kv.grown(cache, W), None, ("self-study",), cap=G * P * W, probes=probes)
    assert bool(got.self_study.all()) and got.self_study.shape == (G * P * W,)
    rows = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
    for p in range(P):
        _, _, aux = _forward(
            model.params,
            probes.tokens[p],
            scoring.after_cache(cache, W),
            kv.grown(cache, W),
            cfg=cfg,
            observer=matching.queries.QueryObserver(rows),
            num_new=probes.num_valid[p],
            logits=None,
        )
        for layer, (captured, _) in zip(got.q, aux["observed"]):  # captured [B, K, G, W, H]
            mine = layer.reshape(B, cfg.num_kv_heads, G, P, W, -1)[:, :, :, p]
            n = np.asarray(probes.num_valid[p])
            for b in range(B):
                np.testing.assert_allclose(
                    np.asarray(mine[b, :, :, : n[b]]), np.asarray(captured[b, :, :, : n[b]]), atol=1e-4, rtol=1e-4
                )  # float32 sums over another batch shape
        valid = np.asarray(got.valid).reshape(B, G, P, W)[:, :, p]
        assert (valid == (np.arange(W)[None, None, :] < np.asarray(probes.num_valid[p])[:, None, None])).all()


def test_thinned_keeps_evenly_spaced_self_study_rows_and_the_others(setup):
    """thinned(queries, n): exactly min(n, valid self-study rows) of each batch row's self-study rows stay valid,
    spread over them; the repeat rows are untouched; n = 0 leaves the repeat rows alone."""
    model, cache, reread = setup
    probes = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=8)
    queries = _queries(
        model.params,
        model.cfg,
        kv.grown(cache, probes.tokens.shape[2]),
        reread,
        ("repeat", "self-study"),
        cap=4096,
        probes=probes,
    )
    marked = np.asarray(queries.self_study)
    valid = np.asarray(queries.valid)
    studied = valid & marked[None, :]
    for n in (0, 5, 40, 10**6):
        thin = np.asarray(matching.thinned(queries, n).valid)
        np.testing.assert_array_equal(thin[:, ~marked], valid[:, ~marked])
        for b in range(cache.batch_size):
            kept = np.flatnonzero(thin[b] & marked)
            assert len(kept) == min(n, studied[b].sum())
            assert set(kept) <= set(np.flatnonzero(studied[b]))
            if 1 < n < studied[b].sum():  # evenly spaced: ranks among the studied rows step by total / n
                ranks = np.searchsorted(np.flatnonzero(studied[b]), kept)
                assert np.diff(ranks).max() <= -(-studied[b].sum() // n)
    with pytest.raises(ValueError, match="self_study_queries"):
        matching.MatchingConfig(self_study_queries=4)  # no self-study source


def test_no_self_study_rows_fit_as_the_reread_alone(setup):
    """self_study_queries=0 with both sources (every repeat row captured either way) compacts as the repeat source
    alone; more self-study rows change the fit."""
    model, cache, reread = setup
    probes = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=8)
    roomy = kv.grown(cache, probes.tokens.shape[2])
    both = _queries(model.params, model.cfg, roomy, reread, ("repeat", "self-study"), cap=8192, probes=probes)
    alone = _queries(model.params, model.cfg, roomy, reread, ("repeat",), cap=4096)
    config = matching.MatchingConfig(ratio=0.3, sources=("repeat", "self-study"))
    none, _ = _compact_with(both, model.cfg, roomy, reread, dataclasses.replace(config, self_study_queries=0))
    some, _ = _compact_with(both, model.cfg, roomy, reread, dataclasses.replace(config, self_study_queries=64))
    base, _ = _compact_with(alone, model.cfg, roomy, reread, matching.MatchingConfig(ratio=0.3))
    for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(some.layers[0].v), np.asarray(none.layers[0].v))
