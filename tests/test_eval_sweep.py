"""The sweep on a tiny random model with SmolLM2's tokenizer: batched == one by one, resumable after a kill,
data-parallel over two (simulated) devices == one device."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.eval import sweep as sw
from kvzip_jax.eval.results import ResultsFile, record_key
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.models.params import init_params
from kvzip_jax.weights.registry import LoadedModel

METHODS = ("kvzip", "snapkv", "pyramidkv", "h2o", "streamingllm", "random")
CONFIG = sw.SweepConfig(methods=METHODS, ratios=(1.0, 0.5, 0.2), modes=("reuse", "first", "oracle"), batch_size=3)


def tiny_model(tokenizer) -> LoadedModel:
    cfg = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, max_position=2048,
                      rope=RopeSpec(theta=10000.0), tie_embeddings=True)
    params = init_params(cfg, seed=0, scale=0.3)  # large weights: peaky logits, no near-ties between tokens
    return LoadedModel("tiny", cfg, params, tokenizer)


def examples() -> list[Example]:
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate((60, 90, 75)):
        context = " ".join(rng.choice(words, n)) + f". The code is {1000 + i}."
        out.append(Example("toy", f"toy-{i}", context, ("What is the code?", "Which word comes first?")[: 1 + i % 2],
                           (("100",), ("alpha",))[: 1 + i % 2], max_new_tokens=6))
    return out


@pytest.fixture(scope="module")
def model(smollm2_gguf):
    from kvzip_jax.weights.tokenizer import tokenizer_from_gguf

    return tiny_model(tokenizer_from_gguf(smollm2_gguf))


@pytest.fixture(scope="module")
def batched(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("batched") / "results.jsonl"
    sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    return _by_key(path)


def _by_key(path) -> dict:
    records = [json.loads(line) for line in open(path)]
    by_key = {record_key(r): r for r in records}
    assert len(by_key) == len(records), "a key was written twice"
    return by_key


def _expected_keys() -> set:
    keys = set()
    for ex in examples():
        for i in range(len(ex.questions)):
            keys.add((ex.task, ex.id, "full", "full", 1.0, i))
            for method in METHODS:
                for mode in CONFIG.modes_of(method):
                    keys |= {(ex.task, ex.id, method, mode, r, i) for r in CONFIG.ratios}
    return keys


def test_every_answer_is_recorded_once_with_its_metrics(batched):
    assert set(batched) == _expected_keys()
    for r in batched.values():
        assert 0.0 <= r["score"] <= 1.0 and r["kl"] >= 0.0 and 0.0 <= r["flip"] <= 1.0
        assert np.isfinite(r["kl"])
        if r["method"] == "full" or r["ratio"] == 1.0:
            assert r["agree"] and r["kl"] == 0.0 and r["flip"] == 0.0


def test_compression_changes_some_answers_and_distributions(batched):
    low = [r for r in batched.values() if r["ratio"] == 0.2]
    assert any(r["kl"] > 1e-3 for r in low)


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


def test_a_killed_sweep_resumes_without_redoing_or_losing_answers(model, batched, tmp_path, monkeypatch):
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
    monkeypatch.setattr(sw.Sweep, "_record", _counting(sw.Sweep._record, calls))
    sw.run_sweep(model, examples(), CONFIG, path, progress=False)
    resumed = _by_key(path)  # asserts no key twice
    assert set(resumed) == set(batched)
    assert [json.loads(line) for line in open(path).read().splitlines()[:len(first_part)]] == first_part
    for key, r in resumed.items():
        assert r["prediction"] == batched[key]["prediction"]
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


def test_two_devices_give_the_same_answers_as_one(smollm2_gguf, tmp_path):
    script = textwrap.dedent(f"""
        import json, sys
        import jax
        from jax.sharding import Mesh
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_eval_sweep import tiny_model, examples
        from kvzip_jax.eval import sweep as sw, sharding
        from kvzip_jax.weights.tokenizer import tokenizer_from_gguf
        assert jax.device_count() == 2
        model = tiny_model(tokenizer_from_gguf({str(smollm2_gguf)!r}))
        config = sw.SweepConfig(methods=("kvzip", "snapkv"), ratios=(0.5,), batch_size=3)
        mesh = sharding.data_mesh()
        placed = sharding.split_batch(jax.numpy.zeros((4, 3)), mesh)
        assert len(placed.sharding.device_set) == 2
        sw.run_sweep(model, examples(), config, {str(tmp_path / "two.jsonl")!r}, progress=False, mesh=mesh)
        one = Mesh(jax.local_devices()[:1], (sharding.DATA_AXIS,))
        sw.run_sweep(model, examples(), config, {str(tmp_path / "one.jsonl")!r}, progress=False, mesh=one)
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two, one = _by_key(tmp_path / "two.jsonl"), _by_key(tmp_path / "one.jsonl")
    assert set(two) == set(one) and len(two) > 0
    for key in one:
        assert two[key]["prediction"] == one[key]["prediction"]
        assert two[key]["kl"] == pytest.approx(one[key]["kl"], abs=1e-4)
