"""bench/gpu.py, the prepared device script, runs end to end at tiny sizes on CPU (Pallas in interpret mode), so a
broken script is found here and not on the GPU machine's clock."""

import importlib.util
from pathlib import Path


def test_gpu_bench_smoke_run(capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", Path(__file__).resolve().parents[1] / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    for impl in ("xla", "pallas"):
        assert f"[{impl}] prefill" in out and f"[{impl}] attention speed-up at 0.3" in out
        for form in ("full", "masked", "ragged"):
            assert f"[{impl}] decode {form:>6}" in out
    assert "nan" not in out.lower()
