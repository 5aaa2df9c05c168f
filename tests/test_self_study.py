"""Self-study probes (matching.self_study) on a tiny random model with SmolLM2's tokenizer: the turns are sampled
reproducibly, the cache is left as it was, and they serve as reference queries for compact."""

import jax
import numpy as np
import pytest

from kvzip_jax import generate as gen
from kvzip_jax import kvzip, matching, prompts
from kvzip_jax.matching import self_study
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer

from .test_compact import compact_jit_and_eager
from .test_eval_sweep import tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(bundled_tokenizer(registry.SMOLLM2))
    texts = ["The code of the blue door is 4471. Ada keeps the key. " * 3, "Bo met Cy in Lima on May 2. " * 4]
    parts = [prompts.split_for_reuse(model.tokenizer, t, [])[0] for t in texts]
    _, cache = gen.prefill(model.params, model.cfg, [p.ids() for p in parts])  # capacity: exactly the prompts
    reread = kvzip.reread_inputs(model.tokenizer, [p.context_start for p in parts],
                                 [p.ids()[p.context_slice] for p in parts], chunk_size=32)
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
            np.testing.assert_array_equal(np.asarray(got.tokens[p, b, :len(suffix)]), suffix)
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


def test_self_study_probes_serve_as_reference_queries(setup):
    """(On-policy with self-study runs in tests/test_cli.py, through compress --method kvzip-am-op --self-study.)"""
    model, cache, reread = setup
    probes = self_study.probes(model.params, model.cfg, model.tokenizer, cache, max_new_tokens=8)
    config = matching.MatchingConfig(ratio=0.3, sources=("repeat", "self-study"))
    out, _ = compact_jit_and_eager(model.params, model.cfg, cache, reread, config, probes)
    repeat_only, _ = matching.compact(model.params, model.cfg, cache, reread,
                                      matching.MatchingConfig(ratio=0.3))
    assert not np.allclose(np.asarray(out.layers[0].v), np.asarray(repeat_only.layers[0].v))  # the probes count
