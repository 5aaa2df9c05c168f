"""bench/gpu.py, the prepared device script, runs end to end at tiny sizes on CPU (Pallas in interpret mode), so a
broken script is found here and not on the GPU machine's clock."""

import dataclasses
import re

import pytest

from kvzip_jax.errors import ModelFileError
from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from kvzip_jax.weights.checkpoint import save_checkpoint
from tests.conftest import bench_module, bundled_tokenizer

MODEL_SKIP = "skipped: past the model's maximum context of 512 tokens"


def _bench():
    return bench_module("gpu")


def _check_rows(out: str, mla: bool = False) -> None:
    """Every row printed, with numbers: prefill and scoring (not skipped) and decode of every cache form, per impl
    (an MLA case decodes under xla alone: no Pallas kernel takes its latent attention)."""
    for impl in ("xla", "pallas"):
        assert re.search(rf"\[{impl}\] prefill [0-9.]+ s", out) and "skipped" not in out.replace(MODEL_SKIP, "")
        if mla and impl == "pallas":
            assert "[pallas] decode: no Pallas kernel for MLA's latent attention" in out
            continue
        assert f"[{impl}] attention speed-up at 0.3" in out
        for form in ("full", "masked", "ragged", "ragged-int8", "ragged-int4", "ragged-k8v4"):
            assert f"[{impl}] decode {form:>11}:" in out
    assert "nan" not in out.lower()


@pytest.mark.heavy
def test_gpu_bench_runs_its_mla_case_and_a_registry_model_by_path_with_its_weights(tmp_path, capsys):
    """The smoke run's random-weight MLA case, then --models: a model loaded through the registry (here a tiny
    checkpoint folder of the smoke run's GQA shape; on the device, a bundled name) runs the same rows on its weights;
    a context past the model's maximum is skipped with a line saying so. (The smoke run's random-weight GQA case is
    that model's shape with random weights: the same rows, so it is not run again.)"""
    bench = _bench()
    tokenizer = bundled_tokenizer(registry.SMOLLM2)
    cfg = dataclasses.replace(bench.SMOKE, vocab_size=len(tokenizer), max_position=512)
    path = save_checkpoint(tmp_path / "tiny", cfg, init_params(cfg, seed=1, scale=0.15), tokenizer)
    assert (
        bench.main(
            [
                "--smoke",
                "--cases",
                "smoke-mla",
                "--models",
                str(path),
                "--model-batch",
                "2",
                "--model-contexts",
                "192,4096",
                "--decode-steps",
                "2",
                "--budget-s",
                "100000",  # no row skipped however loaded the machine
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    mla, model = out.split(f"== {path}, batch 2, 192 context tokens ==")
    assert "== smoke-mla, batch 2, 192 context tokens ==" in mla
    assert MODEL_SKIP in model
    _check_rows(mla, mla=True)
    _check_rows(model)


def test_gpu_bench_names_an_unknown_model_before_any_case_runs(capsys):
    with pytest.raises(ModelFileError, match="no-such-model.* neither a bundled model nor a path"):
        _bench().main(["--smoke", "--models", "no-such-model"])
    assert "==" not in capsys.readouterr().out  # the random-weight case did not start
