"""KVzip answer quality on the real Qwen2.5-Coder-0.5B-Instruct: one bundled context, six questions asked of one
compressed cache (bench/quality.py runs all contexts and ratios)."""

import jax
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.eval import answering, metrics, tasks
from kvzip_jax.kvzip import scoring as kvscore
from kvzip_jax.models.params import init_params
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights import registry
from tests.conftest import _checkpoints_dir, tiny_config

from .conftest import bench_module, drop_compiled_and_freed
from .test_kvzip_score import oracle_scores

CONTEXT = "minutes"


def _bench_quality():
    return bench_module("quality")


@pytest.fixture(scope="module")
def qwen(qwen_gguf):
    drop_compiled_and_freed()
    return registry.load(registry.QWEN, _checkpoints_dir())


@pytest.fixture(scope="module")
def minutes(qwen):
    """Answers to the six questions of one context: full cache, and the masked cache at ratio 0.3 (ratio 1.0's
    equality with the full cache is checked on a tiny model: tests/test_compressed_cache.py)."""
    quality = _bench_quality()
    model = qwen
    item = quality.load_contexts([CONTEXT])[CONTEXT]
    records, _ = quality.run_context(model, CONTEXT, item, ratios=(0.3,), levels=("pair",))
    for r in records:
        print(f"{r.level} {r.ratio}: {r.question} -> {r.answer!r} (correct {r.correct}, equal {r.equal_to_full})")
    full = [r for r in records if r.level == quality.FULL]
    at = [r for r in records if r.level == "pair" and r.ratio == 0.3]
    assert len(full) == len(at) == 6
    return full, at


@pytest.mark.extended  # KVzip 0.3 answering right on these weights: the int4 regression test below (16-bit half)
@pytest.mark.slow
def test_ratio_0_3_holds_todays_floor(minutes):
    """The level measured today (5/6 right, full cache 6/6; 1/6 answers equal the full cache's), as a floor that a
    regression in scoring, eviction or the compressed cache would break."""
    full, at = minutes
    right, full_right = sum(r.correct for r in at), sum(r.correct for r in full)
    equal = sum(r.equal_to_full for r in at)
    assert full_right == 6 and right >= 5 and equal >= 1, (full_right, right, equal)


@pytest.mark.slow
def test_int4_after_kvzip_0_3_keeps_exact_values_behind_random_keys(qwen):
    """Exact retrieval from a KVzip 0.3 + int4 cache (the default format, groups of 16): every value the 16-bit
    KVzip cache gives right, the int4 one gives right too (k8v4's answers: the committed sweeps; its cache form:
    tests/test_quantized_cache.py). On this context int4 in groups of 64 (the format before
    studies/kv_quant_after_eviction) loses two of the three UUIDs KVzip keeps: layer 0's keys, whose largest RoPE
    channels set the scale of every other channel of a 64-wide group."""
    drop_compiled_and_freed()  # the programs of the tests before it (other shapes) would stack under its peak
    tok, params, cfg = qwen.tokenizer, qwen.params, qwen.cfg
    (example,) = tasks.generate("kv_retrieval", 1, seed=0, context_tokens=160)  # about 575 tokens, 4 questions
    context, suffixes = prompts.split_for_reuse(
        tok, example.context, list(example.questions), instruction=prompts.KVZIP_INSTRUCTION
    )
    _, full = gen.prefill(params, cfg, [context.ids()])
    reread = kvzip.reread_inputs(tok, [context.context_start], [context.ids()[context.context_slice]])
    masked, _ = jax.jit(kvzip.score_and_evict)(params, cfg, full, reread, 0.3)
    stops = prompts.stop_token_ids(tok)

    def right(cache) -> list[bool]:  # greedy answers to every question at once, one row each, decoded only past
        # their first departure from the reference
        references = [np.append(prompts.encode_text(tok, r[0]), stops[0]) for r in example.answers]
        rows = kv.tiled_rows(cache, len(suffixes))
        got, _ = answering.answer_forced(params, cfg, rows, suffixes, references, example.max_new_tokens, stops)
        return [
            bool(metrics.score(example.metric, tok.decode(tokens, skip_special_tokens=True), r))
            for tokens, r in zip(got.tokens, example.answers)
        ]

    at_16 = right(masked)
    drop_compiled_and_freed()  # the quantized cache's programs are its own: the 16-bit ones need not stay under them
    at_4 = right(kv.quantized(masked, quant.QuantFormat(bits=4)))
    print(f"KVzip 0.3 right: 16 bits {at_16}, int4 {at_4}")
    assert sum(at_16) >= 3, at_16  # the model retrieves these values from the compressed cache
    assert all(b for a, b in zip(at_16, at_4) if a), (at_16, at_4)


@pytest.mark.quality48
def test_kvzip_at_0_3_answers_right_nine_tenths_as_often_as_the_full_cache(qwen):
    """The bar as revised (issue 16; `make test-quality`, about 8 minutes here, so outside the default run, where
    the one-context floor above guards the same path): on the 48 bundled questions (8 contexts x 6, one cache per
    context), KVzip at 0.3 answers right at least 90% as often as the full cache (measured: 36/48 against 40/48).
    Answers word for word equal to the full cache's are printed, not gated (a question-and-answer-aware selection
    still changes 7 of 48 at 0.3 on this model)."""
    quality = _bench_quality()
    model = qwen
    records = []
    for name, item in quality.load_contexts().items():
        records += quality.run_context(model, name, item, ratios=(0.3,), levels=("pair",))[0]
    full = [r for r in records if r.level == quality.FULL]
    at = [r for r in records if r.level == "pair"]
    assert len(full) == len(at) == 48
    right, full_right = sum(r.correct for r in at), sum(r.correct for r in full)
    print(
        f"ratio 0.3: {right}/48 right (full cache {full_right}/48), "
        f"{sum(r.equal_to_full for r in at)}/48 equal to the full cache's answers"
    )
    assert right >= 0.9 * full_right, f"ratio 0.3: {right}/48 right, full cache {full_right}/48"


def test_oracle_span_scores_equal_the_numpy_oracle():
    """bench/quality.py --oracle: scores observed from one span (question and answer) in place of the reread."""
    quality = _bench_quality()
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(4)
    prefix, context, span = (rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (4, 40, 7))
    _, cache = gen.prefill(params, cfg, [np.concatenate([prefix, context])], capacity=128)
    seen = quality.observed_span_inputs(span, len(prefix), len(context))
    ours = np.asarray(jax.jit(kvscore.score, static_argnums=1)(params, cfg, cache, seen))[:, 0, :, : len(context)]
    expected = oracle_scores(params, cfg, prefix, context, [span], chunk_size=len(context))
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)


def test_resume_takes_back_only_the_contexts_held_in_full(tmp_path):
    """bench/quality.py --resume: a context whose rows cover the full cache and every (level, ratio) of the run is
    read back; one cut short, or run at other ratios, is run again."""
    quality = _bench_quality()

    def rows(context, cells, questions=2):
        return [
            quality.Record(context, f"q{i}", "a", level, ratio, "a", True, True, 1, 0.1)
            for level, ratio in cells
            for i in range(questions)
        ]

    full = (quality.FULL, None)
    records = (
        rows("done", [full, ("pair", 0.3), ("pair", 0.1)])
        + rows("cut", [full, ("pair", 0.3)])
        + rows("other", [full, ("pair", 0.5), ("pair", 0.1)])
    )
    path = tmp_path / "q.json"
    quality._write_json_atomically(str(path), [vars(r) for r in records])
    done = quality.resumed(str(path), ["done", "cut", "other", "absent"], (0.3, 0.1), ("pair",))
    assert list(done) == ["done"] and len(done["done"]) == 6
    assert quality.resumed(str(tmp_path / "none.json"), ["done"], (0.3,), ("pair",)) == {}
