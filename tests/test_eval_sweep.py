"""The sweep on a tiny random model with SmolLM2's tokenizer: batched == one by one, resumable after a kill,
data-parallel over two (simulated) devices == one device."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from kvzip_jax import methods, prompts
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.eval import batches, report, runner
from kvzip_jax.eval import sweep as sw
from kvzip_jax.eval.results import ResultsFile, record_key
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from kvzip_jax.weights.registry import LoadedModel
from tests.conftest import bundled_tokenizer, simulated_devices_flags, tokenizer_folder

METHODS = ("kvzip", "snapkv", "pyramidkv", "h2o", "streamingllm", "random")
CONFIG = sw.SweepConfig(methods=METHODS, ratios=(1.0, 0.5, 0.2), modes=("reuse", "first", "oracle"), batch_size=3)


def tiny_model(tokenizer) -> LoadedModel:
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        max_position=2048,
        rope=RopeSpec(theta=10000.0),
        tie_embeddings=True,
    )
    params = init_params(cfg, seed=0, scale=0.3)  # large weights: peaky logits, no near-ties between tokens
    return LoadedModel("tiny", cfg, params, tokenizer)


def examples() -> list[Example]:
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((60, 90, 75)):
        context = " ".join(rng.choice(words, n)) + f". The code is {1000 + i}."
        out.append(
            Example(
                "toy",
                f"toy-{i}",
                context,
                ("What is the code?", "Which word comes first?")[: 1 + i % 2],
                (("100",), ("alpha",))[: 1 + i % 2],
                max_new_tokens=6,
            )
        )
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model(bundled_tokenizer(registry.SMOLLM2))


@pytest.fixture(scope="module")
def batched_path(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("batched") / "results.jsonl"
    sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    return path


@pytest.fixture(scope="module")
def batched(batched_path):
    return _by_key(batched_path)


def _by_key(path) -> dict:
    records = [json.loads(line) for line in open(path)]
    by_key = {record_key(r): r for r in records}
    assert len(by_key) == len(records), "a key was written twice"
    return by_key


def _expected_keys() -> set:
    keys = set()
    for ex in examples():
        for i in range(len(ex.questions)):
            keys.add((ex.task, ex.id, "full", "full", 1.0, i, 16))
            for method in METHODS:
                for mode in CONFIG.modes_of(method):
                    keys |= {(ex.task, ex.id, method, mode, r, i, 16) for r in CONFIG.ratios}
    return keys


def test_every_answer_is_recorded_once_with_its_metrics(batched):
    assert set(batched) == _expected_keys()
    fingerprints = {r["config"] for r in batched.values()}
    assert len(fingerprints) == 1 and None not in fingerprints
    hashes = {ex.id: batches.example_hash(ex) for ex in examples()}
    for r in batched.values():
        assert 0.0 <= r["score"] <= 1.0 and r["kl"] >= 0.0 and 0.0 <= r["flip"] <= 1.0
        assert np.isfinite(r["kl"]) and r["example_hash"] == hashes[r["example"]]
        if r["method"] == "full" or r["ratio"] == 1.0:
            assert r["agree"] and r["kl"] == 0.0 and r["flip"] == 0.0


def test_prepare_ends_each_question_with_the_answer_prefix_and_keeps_prompts_without_one(model):
    tokenizer, instruction = model.tokenizer, prompts.KVZIP_INSTRUCTION
    plain = examples()[1]
    prefixed = dataclasses.replace(plain, answer_prefix="The code is")
    (_, context, suffixes), (_, prefixed_context, prefixed_suffixes) = (
        batches.prepare(tokenizer, [ex], instruction)[0] for ex in (plain, prefixed)
    )
    header = prompts.chat_layout(tokenizer).answer_header
    assert (
        context == prefixed_context == prompts.split_for_reuse(tokenizer, plain.context, [], instruction=instruction)[0]
    )
    for question, suffix, with_prefix in zip(plain.questions, suffixes, prefixed_suffixes):
        text = "\n\n" + question + header  # the layout before answer prefixes, id for id
        assert suffix.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert with_prefix[: len(suffix)].tolist() == suffix.tolist()
        assert tokenizer.decode(with_prefix[len(suffix) :].tolist()) == "The code is"
    fields = [
        plain.context,
        list(plain.questions),
        [list(a) for a in plain.answers],
        plain.metric,
        plain.max_new_tokens,
    ]
    assert batches.example_hash(plain) == hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]
    assert batches.example_hash(prefixed) != batches.example_hash(plain)


def test_compression_moves_distributions_more_the_less_it_keeps(batched):
    """Every method's mean next-token KL grows as the ratio falls (0 at 1.0), and at 0.2 answers change."""
    mean_kl = lambda method, ratio: np.mean(
        [r["kl"] for r in batched.values() if r["method"] == method and r["ratio"] == ratio]
    )
    for method in METHODS:
        assert mean_kl(method, 1.0) == 0.0 < mean_kl(method, 0.5) < mean_kl(method, 0.2), method
    rate = lambda field, ratio: np.mean([r[field] for r in batched.values() if r["ratio"] == ratio])
    print({ratio: (rate("agree", ratio), rate("flip", ratio)) for ratio in CONFIG.ratios})
    assert rate("agree", 1.0) == 1.0 > rate("agree", 0.5) >= rate("agree", 0.2)
    assert rate("flip", 1.0) == 0.0 < rate("flip", 0.5) < rate("flip", 0.2)


def test_a_cache_that_keeps_every_pair_answers_as_the_full_cache(model, tmp_path, monkeypatch):
    """Full and compressed answers come from one computation: with the keep-everything shortcut off, ratio 1.0
    agrees with the full cache 100% with KL exactly 0, even when the step-by-step draft differs from what the
    teacher-forced pass would pick (as float near-ties between the two can make it: simulated by bending the last
    token of every draft)."""
    real_answer = runner.answering.answer

    def bent_drafts(*args, **kwargs):
        got, cache = real_answer(*args, **kwargs)
        bend = lambda tokens: tokens[:-1] + [(tokens[-1] + 1) % model.cfg.vocab_size] if tokens else tokens
        return runner.answering.Answers([bend(t) for t in got.tokens]), cache

    monkeypatch.setattr(runner.answering, "answer", bent_drafts)
    monkeypatch.setattr(runner, "keeps_everything", lambda compressed, cache: False)
    config = sw.SweepConfig(methods=("kvzip", "snapkv", "random"), ratios=(1.0, 0.5), batch_size=3)
    sw.run_sweep(model, examples(), config, tmp_path / "results.jsonl", progress=False)
    records = _by_key(tmp_path / "results.jsonl")
    full = {(r["example"], r["question"]): r["prediction"] for r in records.values() if r["method"] == "full"}
    at_one = [r for r in records.values() if r["ratio"] == 1.0 and r["method"] != "full"]
    assert len(at_one) == 3 * sum(len(ex.questions) for ex in examples())
    for r in at_one:
        assert r["agree"] and r["prediction"] == full[r["example"], r["question"]], r
        assert r["kl"] == 0.0 and r["flip"] == 0.0


def test_another_configuration_is_never_merged_into_a_results_file(model, batched, tmp_path):
    """A rerun into the same file with another prompt, model or example set is refused, naming what differs; a
    grown grid (another ratio) resumes."""
    from kvzip_jax.eval.results import SweepMismatchError

    path = tmp_path / "results.jsonl"
    config = sw.SweepConfig(methods=("kvzip",), ratios=(0.5,), batch_size=3)
    sw.run_sweep(model, examples(), config, path, progress=False)
    before = path.read_bytes()
    with pytest.raises(SweepMismatchError, match="instruction"):
        sw.run_sweep(model, examples(), dataclasses.replace(config, instruction=None), path, progress=False)
    with pytest.raises(SweepMismatchError, match="chunk_size"):
        sw.run_sweep(model, examples(), dataclasses.replace(config, chunk_size=64), path, progress=False)
    other = LoadedModel(model.name, model.cfg, jax.tree.map(lambda x: x * 1.01, model.params), model.tokenizer)
    with pytest.raises(SweepMismatchError, match="model_params"):
        sw.run_sweep(other, examples(), config, path, progress=False)
    changed = [
        dataclasses.replace(ex, context=ex.context + " One more line.") if i == 1 else ex
        for i, ex in enumerate(examples())
    ]
    with pytest.raises(SweepMismatchError, match="toy/toy-1"):
        sw.run_sweep(model, changed, config, path, progress=False)
    assert path.read_bytes() == before  # nothing written by a refused run
    sw.run_sweep(model, examples(), dataclasses.replace(config, ratios=(0.5, 0.2)), path, progress=False)
    grown = _by_key(path)
    assert {k[4] for k in grown if k[2] == "kvzip"} == {0.5, 0.2}
    for key, r in grown.items():
        if key in batched:
            assert r["prediction"] == batched[key]["prediction"], key
    old = tmp_path / "old" / "results.jsonl"  # records of a kvzip-jax before settings files
    old.parent.mkdir()
    old.write_text(path.read_text())
    with pytest.raises(SweepMismatchError, match="without a settings file"):
        sw.run_sweep(model, examples(), config, old, progress=False)


@pytest.mark.heavy
def test_a_batched_sweep_equals_one_by_one(model, batched, tmp_path):
    path = tmp_path / "one.jsonl"
    sw.run_sweep(model, examples(), sw.SweepConfig(**{**CONFIG.__dict__, "batch_size": 1}), path, progress=False)
    single = _by_key(path)
    assert set(single) == set(batched)
    for key, r in single.items():
        assert r["prediction"] == batched[key]["prediction"], key
        assert r["kl"] == pytest.approx(batched[key]["kl"], abs=1e-4), key
        assert r["flip"] == pytest.approx(batched[key]["flip"], abs=1e-6), key


class Killed(Exception):
    pass


def test_a_killed_sweep_resumes_without_redoing_or_losing_answers(model, batched, batched_path, tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    appended = []
    real_append = ResultsFile.append

    def append_then_die(self, records):
        real_append(self, records)
        appended.append(len(records))
        if len(appended) == 7:
            with open(self.path, "a") as f:  # a write cut off by the kill
                f.write('{"task": "toy", "exa')
            raise Killed

    monkeypatch.setattr(ResultsFile, "append", append_then_die)
    with pytest.raises(Killed):
        sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    first_part = [json.loads(line) for line in open(path).read().splitlines()[:-1]]
    assert len(first_part) == sum(appended)

    monkeypatch.setattr(ResultsFile, "append", real_append)
    calls = []
    monkeypatch.setattr(runner.Sweep, "_record", _counting(runner.Sweep._record, calls))
    sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    resumed = _by_key(path)  # asserts no key twice
    assert set(resumed) == set(batched)
    assert [json.loads(line) for line in open(path).read().splitlines()[: len(first_part)]] == first_part
    for key, r in resumed.items():
        assert r["prediction"] == batched[key]["prediction"]
        assert r["versions"]["jax"] == jax.__version__ and r["config"] == batched[key]["config"]
    tables = [report.write_report(p, tmp_path / f"report-{i}") for i, p in enumerate((path, batched_path))]
    for name in ("markdown", "csv"):  # the interrupted and resumed sweep's tables are the uninterrupted one's
        assert tables[0][name].read_bytes() == tables[1][name].read_bytes()
    # a rerun of a finished sweep does nothing
    calls.clear()
    sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    assert calls == [] and len(open(path).read().splitlines()) == len(resumed)


def _counting(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


def test_sweep_config_rejects_bad_choices():
    with pytest.raises(ValueError, match="unknown method"):
        sw.SweepConfig(methods=("kvzip", "nope"))
    with pytest.raises(ValueError, match="modes"):
        sw.SweepConfig(modes=("sometimes",))
    with pytest.raises(ValueError, match="ratio"):
        sw.SweepConfig(ratios=(0.0,))


@pytest.mark.extended  # covered by test_eval_distributed (a 4-device replica answers as a 2-device process) and
def test_two_devices_give_the_same_answers_as_one(tmp_path):  # test_sharding's (8, 1, 1) mesh
    script = textwrap.dedent(f"""
        import json, sys
        import jax
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_eval_sweep import tiny_model, examples
        from kvzip_jax import sharding
        from kvzip_jax.eval import placement, sweep as sw
        from kvzip_jax.weights.tokenizer import tokenizer_from_hf
        assert jax.device_count() == 2
        model = tiny_model(tokenizer_from_hf({str(tokenizer_folder(registry.SMOLLM2))!r}))
        config = sw.SweepConfig(methods=("kvzip", "snapkv"), ratios=(0.5,), batch_size=3)
        mesh = sharding.data_mesh()
        assert mesh.axis_names == ("data", "seq", "tensor") and mesh.devices.shape == (2, 1, 1)
        placed = placement.split_batch(jax.numpy.zeros((4, 3)), mesh)
        assert len(placed.sharding.device_set) == 2 and placed.addressable_shards[0].data.shape == (2, 3)
        sw.run_sweep(model, examples(), config, {str(tmp_path / "two.jsonl")!r}, progress=False, mesh=mesh)
        one = sharding.make_mesh(data=1)
        sw.run_sweep(model, examples(), config, {str(tmp_path / "one.jsonl")!r}, progress=False, mesh=one)
    """)
    env = {**os.environ, "XLA_FLAGS": simulated_devices_flags(2), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two, one = _by_key(tmp_path / "two.jsonl"), _by_key(tmp_path / "one.jsonl")
    assert set(two) == set(one) and len(two) > 0
    for key in one:
        assert two[key]["prediction"] == one[key]["prediction"]
        assert two[key]["kl"] == pytest.approx(one[key]["kl"], abs=1e-4)


@pytest.mark.heavy
def test_memory_does_not_pile_up_over_tasks(model, tmp_path):
    """No array outlives the sweep; the programs compiled for one task's shapes are dropped when the next task
    starts, so a sweep holds those of one task at a time; the params are not copied onto a one-device mesh."""
    from kvzip_jax import generate as gen
    from kvzip_jax import sharding
    from kvzip_jax.eval import placement

    assert placement.replicate(model.params, sharding.data_mesh()) is model.params
    config = sw.SweepConfig(methods=("kvzip", "snapkv"), ratios=(0.5,), batch_size=3)
    second = [dataclasses.replace(ex, task="toy2") for ex in examples()]  # a second task, its own shapes
    jax.clear_caches()
    sw.run_sweep(model, second, config, tmp_path / "alone.jsonl", progress=False)
    one_task = (gen.forward_step._cache_size(), gen._decode_loop._cache_size(), runner._kvzip_scores._cache_size())
    longer = [dataclasses.replace(ex, context=ex.context + " " + ex.context) for ex in examples()]  # other shapes
    live = {id(x) for x in jax.live_arrays()}
    sw.run_sweep(model, longer + second, config, tmp_path / "both.jsonl", progress=False)
    assert [x.shape for x in jax.live_arrays() if id(x) not in live] == []
    assert (
        gen.forward_step._cache_size(),
        gen._decode_loop._cache_size(),
        runner._kvzip_scores._cache_size(),
    ) == one_task


@pytest.mark.heavy
def test_attention_matching_methods_run_in_the_sweep(model, tmp_path):
    """The AM methods (off- and on-policy) sweep beside KVzip from one shared reference pass: every answer recorded,
    ratio 1 answers as the full cache, a compacted cache moves the distributions (finite KL > 0) at 0.2."""
    methods = ("kvzip", "kvzip-am", "am-hak-op")
    config = sw.SweepConfig(methods=methods, ratios=(1.0, 0.2), batch_size=3)
    path = tmp_path / "results.jsonl"
    sw.run_sweep(model, examples(), config, path, progress=False)
    got = _by_key(path)
    want = {
        (ex.task, ex.id, m, "reuse", r, i, 16)
        for ex in examples()
        for i in range(len(ex.questions))
        for m in methods
        for r in config.ratios
    }
    assert set(got) - {k for k in got if k[2] == "full"} == want
    for method in methods:
        at = lambda ratio: [r for r in got.values() if r["method"] == method and r["ratio"] == ratio]
        assert all(r["agree"] and r["kl"] == 0.0 for r in at(1.0)), method
        kls = [r["kl"] for r in at(0.2)]
        assert np.isfinite(kls).all() and np.mean(kls) > 0.0, method


@pytest.mark.heavy
def test_self_study_turns_join_the_attention_matching_fit(model, tmp_path):
    """--self-study: the model's own turns about each context join the reread's reference queries (off- and
    on-policy), so the fitted caches answer differently; the setting is part of the results file's identity."""
    from kvzip_jax.eval.results import SweepMismatchError

    config = sw.SweepConfig(methods=("am-hak", "am-hak-op"), ratios=(0.2,), batch_size=3)
    plain, studied = tmp_path / "plain" / "results.jsonl", tmp_path / "studied" / "results.jsonl"
    sw.run_sweep(model, examples(), config, plain, progress=False)
    # 8 sampled tokens a turn, not the default 64: the same probes and fit, an eighth of the sampling steps
    study = dataclasses.replace(config, self_study=True, self_study_tokens=8)
    sw.run_sweep(model, examples(), study, studied, progress=False)
    a, b = _by_key(plain), _by_key(studied)
    assert set(a) == set(b)
    for method in config.methods:
        keys = [k for k in a if k[2] == method]
        assert all(np.isfinite(b[k]["kl"]) for k in keys)
        assert any(a[k]["kl"] != b[k]["kl"] for k in keys), method  # the probes' queries changed the fit
    with pytest.raises(SweepMismatchError, match="self_study"):
        sw.run_sweep(model, examples(), config, studied, progress=False)
    with pytest.raises(ValueError, match="self_study"):
        sw.SweepConfig(methods=("kvzip",), self_study=True)


def test_self_study_turns_and_query_cap_are_part_of_a_sweeps_identity(model):
    """How many and how long the self-study turns are, and a query cap other than the default, change the answers:
    the results file's settings name them; bad counts fail when the config is made."""
    config = sw.SweepConfig(methods=("am-hak",), self_study=True, self_study_samples=4, self_study_tokens=32)
    settings = config.settings(model)
    assert settings["self_study"] == dict(samples=4, max_new_tokens=32) and "query_cap" not in settings
    assert dataclasses.replace(config, query_cap=100).settings(model)["query_cap"] == 100
    for field in ("self_study_samples", "self_study_tokens", "query_cap"):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(config, **{field: 0})


def test_a_method_option_the_shared_capture_would_ignore_is_refused():
    """The sweep captures reference queries once per batch for every method (--query-cap, --self-study): a method
    spec asking for another cap or other sources fails when the config is made instead of being ignored."""
    with pytest.raises(methods.MethodError, match="--query-cap 32768"):
        sw.SweepConfig(methods=("am-hak-kb:query_cap=32768",))
    with pytest.raises(methods.MethodError, match="other sources are not captured"):
        sw.SweepConfig(methods=("am-hak:sources='context'",))
    with pytest.raises(methods.MethodError, match="other sources are not captured"):
        sw.SweepConfig(methods=("am-hak:sources=('repeat', 'self-study')",))  # without --self-study
    sw.SweepConfig(methods=("am-hak:query_cap=100",), query_cap=100)  # the sweep's own cap, said twice: fine
    sw.SweepConfig(methods=("am-hak:sources=('repeat', 'self-study')",), self_study=True)
    sw.SweepConfig(methods=("kvzip", "am-hak-kb:value_ridge=1000.0"))  # other options are the method's own


def test_a_profile_method_needs_the_models_searched_budgets(model, tmp_path, monkeypatch):
    """am-hak-pb takes the model's budget profile: none for this model fails before any work, naming the search;
    with one it sweeps, every answer recorded with a finite KL."""
    from kvzip_jax import matching
    from kvzip_jax.matching import budgets

    config = sw.SweepConfig(methods=("am-hak-pb",), ratios=(0.2,), batch_size=3)
    path = tmp_path / "results.jsonl"
    monkeypatch.setattr(budgets, "PROFILE_DIR", tmp_path / "profiles")
    with pytest.raises(matching.BudgetProfileError, match="budget_search.py --model tiny"):
        sw.run_sweep(model, examples(), config, path, progress=False)
    assert not path.exists()
    L, K = model.cfg.num_layers, model.cfg.num_kv_heads
    budgets.PROFILE_DIR.mkdir()
    (budgets.PROFILE_DIR / "tiny.json").write_text(
        json.dumps({"profile": [[1.0 + (i + k) % 3 for k in range(K)] for i in range(L)]})
    )
    sw.run_sweep(model, examples(), config, path, progress=False)
    got = [r for r in _by_key(path).values() if r["method"] == "am-hak-pb"]
    assert len(got) == sum(len(ex.questions) for ex in examples())
    assert np.isfinite([r["kl"] for r in got]).all()


def test_fitted_latents_are_refused_before_any_work_on_a_model_without_a_latent_cache(model, tmp_path):
    from kvzip_jax import matching

    path = tmp_path / "results.jsonl"
    with pytest.raises(matching.LatentValuesError, match="this model has no latent cache"):
        sw.run_sweep(
            model,
            examples(),
            sw.SweepConfig(methods=("kvzip", "am-hak-fl"), ratios=(0.2,), batch_size=3),
            path,
            progress=False,
        )
    assert not path.exists()


def test_kv_bits_quantize_every_cache_and_the_report_plots_score_against_bytes(model, tmp_path):
    """--kv-bits 16,4: every cache also answers with int4 kept pairs, the full cache too (quantization alone); the
    records carry the bytes of each context's kept pairs, int4 at exactly the format's share; ratio 1 in int4 answers
    as the full cache in int4; a grid grown by k8v4 resumes with only the new answers; the report has a bytes table
    and a Pareto plot."""
    config = sw.SweepConfig(
        methods=("kvzip",), ratios=(1.0, 0.5), batch_size=3, kv_bits=(16, 4), kv_group=8, kv_center=False
    )  # bytes at exactly the format's share: no key centres
    path = tmp_path / "results.jsonl"
    sw.run_sweep(model, examples(), config, path, progress=False)
    got = _by_key(path)
    questions = [(ex.id, i) for ex in examples() for i in range(len(ex.questions))]
    want = {("toy", e, "full", "full", 1.0, i, b) for e, i in questions for b in (16, 4)}
    want |= {("toy", e, "kvzip", "reuse", r, i, b) for e, i in questions for r in (1.0, 0.5) for b in (16, 4)}
    assert set(got) == want
    for e, i in questions:
        at = lambda method, ratio, bits: got["toy", e, method, "full" if method == "full" else "reuse", ratio, i, bits]
        full, full4 = at("full", 1.0, 16), at("full", 1.0, 4)
        # head dim 8, float32: 64 bytes a pair; int4 in groups of 8 with bf16 scales and zeros: 2 x (4 + 4) = 16
        assert full4["bytes"] * 4 == full["bytes"] and at("kvzip", 0.5, 4)["bytes"] * 4 == at("kvzip", 0.5, 16)["bytes"]
        assert at("kvzip", 0.5, 16)["bytes"] < full["bytes"]
        assert full4["kl"] > 0.0 and np.isfinite(full4["kl"])
        same = at("kvzip", 1.0, 4)
        assert (same["prediction"], same["kl"], same["bytes"]) == (full4["prediction"], full4["kl"], full4["bytes"])

    grown = dataclasses.replace(config, kv_bits=(16, 4, "8/4"))  # int8's bytes: test_cli's compress with --kv-bits
    sw.run_sweep(model, examples(), grown, path, progress=False)
    added = set(_by_key(path)) - set(got)
    assert added and {key[-1] for key in added} == {"8/4"}
    grown_records = _by_key(path)
    for e, i in questions:  # int8 keys beside int4 values: an int8 key (12 bytes) and an int4 value (8) a pair
        assert (
            grown_records["toy", e, "full", "full", 1.0, i, "8/4"]["bytes"] * 64
            == got["toy", e, "full", "full", 1.0, i, 16]["bytes"] * 20
        )

    written = report.write_report(path, tmp_path / "report")
    assert written["pareto"].stat().st_size > 0
    rows = report.summarize(report.read_records(path))
    shares = {(r["method"], r["ratio"]): r["bytes_share"] for r in rows}
    assert shares["full", 1.0] == 100.0 and shares["int4", 1.0] == 25.0
    assert shares["k8v4", 1.0] == 31.25 and ("kvzip+k8v4", 0.5) in shares
    assert shares["kvzip+int4", 0.5] == pytest.approx(shares["kvzip", 0.5] / 4)
    assert "## Bytes of the kept pairs" in written["markdown"].read_text()
    with pytest.raises(ValueError, match="kv_bits"):
        sw.SweepConfig(kv_bits=(16, 2))
    # Centred keys (the default) answer otherwise than the files written before them: their settings say so.
    centred = dataclasses.replace(config, kv_center=True)
    assert centred.settings(model)["kv_quant"] == {**config.settings(model)["kv_quant"], "center": True}
    assert "kv_quant" not in dataclasses.replace(config, kv_group=64).settings(model)
    assert "kv_quant" not in dataclasses.replace(centred, kv_group=64, kv_bits=(16,)).settings(model)
    # Default groups (int4 in 16s since studies/kv_quant_after_eviction) are recorded for every width, whatever the
    # sweep's widths: a grid grown by a width keeps its settings; a sweep that quantizes nothing records none.
    default = dataclasses.replace(centred, kv_group=None)
    assert default.settings(model)["kv_quant"]["group"] == {"8": 64, "4": 16}
    assert default.settings(model) == dataclasses.replace(default, kv_bits=(16, 8, 4)).settings(model)
    assert "kv_quant" not in dataclasses.replace(default, kv_bits=(16,)).settings(model)
