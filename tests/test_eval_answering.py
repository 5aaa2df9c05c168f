"""answer's and answer_forced's greedy answers (decoded in segments, regathering the rows still decoding) equal one
plain greedy decoding loop, whatever answer is forced; the cache comes back as it was."""

import jax
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.eval import answering
from kvzip_jax.models.params import init_params


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        max_position=512,
        rope=RopeSpec(theta=10000.0),
        tie_embeddings=True,
    )
    return cfg, init_params(cfg, seed=3, scale=0.3)


def test_forced_greedy_answers_equal_plain_greedy_decoding(model):
    cfg, params = model
    rng = np.random.default_rng(0)
    contexts = [rng.integers(10, 64, n).astype(np.int32) for n in (40, 55, 31)]
    suffixes = [rng.integers(10, 64, n).astype(np.int32) for n in (6, 9, 4)]
    _, cache = gen.prefill(params, cfg, contexts, capacity=128)
    keep = jax.random.uniform(jax.random.key(1), (cfg.num_layers, 3, cfg.num_kv_heads, 64)) < 0.6
    prefix, context_len = np.array([2, 2, 2]), np.array([n - 2 for n in (40, 55, 31)])
    masked = kv.mask_context(cache, keep, prefix, context_len)

    def oracle(stops):  # one plain greedy decoding loop
        logits, once = gen.prefill(params, cfg, suffixes, answering.copy_cache(masked))
        return gen.decode(params, cfg, logits, once, 12, stop_tokens=stops)[0]

    free = oracle(())
    # A stop token that ends one row within the first segment while another row decodes past it.
    stops = next(
        (t,)
        for t in range(cfg.vocab_size)
        if any(t in row[: answering.SEGMENT - 1] for row in free) and any(t not in row[:9] for row in free)
    )
    greedy = oracle(stops)
    assert min(map(len, greedy)) < answering.SEGMENT < max(map(len, greedy))
    work = answering.copy_cache(masked)
    plain, work = answering.answer(params, cfg, work, suffixes, 12, stops)  # decoded in segments, then regathered
    assert plain.tokens == greedy
    full, work = answering.answer(params, cfg, work, suffixes, 12, ())  # other answers to force
    wrong = [[(t[0] + 1) % cfg.vocab_size] for t in plain.tokens]  # a first token greedy would not pick
    forced_cases = [
        plain.tokens,
        full.tokens,
        [t[:1] for t in full.tokens],
        [[11], plain.tokens[1], [12, 13]],
        [plain.tokens[0], wrong[1], plain.tokens[2]],  # one row to decode: in a gathered copy
        wrong,
    ]  # every row to decode: in place
    for forced in forced_cases:
        before = [np.asarray(x) for x in jax.tree.leaves(kv.mark(work))]
        got, work = answering.answer_forced(params, cfg, work, suffixes, forced, 12, stops)
        assert got.tokens == plain.tokens
        assert got.logits.shape[:2] == got.valid.shape == (3, max(map(len, forced)))
        after = [np.asarray(x) for x in jax.tree.leaves(kv.mark(work))]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
