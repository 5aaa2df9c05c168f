"""KVzip answer quality on the real Qwen2.5-Coder-0.5B-Instruct: one bundled context, six questions asked of one
compressed cache (bench/quality.py runs all contexts and ratios)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from kvzip_jax.weights import registry

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality.py"
CONTEXT = "minutes"


def _bench_quality():
    spec = importlib.util.spec_from_file_location("bench_quality", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_qwen_answers_from_a_cache_compressed_to_30_percent_match_the_full_cache(qwen_gguf):
    quality = _bench_quality()
    model = registry.load(registry.QWEN, qwen_gguf.parent.parent)  # <checkpoints>/_gguf/<name>.gguf
    item = quality.load_contexts([CONTEXT])[CONTEXT]
    records, _ = quality.run_context(model, CONTEXT, item, ratios=(1.0, 0.3), levels=("pair",))
    full = [r for r in records if r.level == quality.FULL]
    at = lambda ratio: [r for r in records if r.level == "pair" and r.ratio == ratio]
    for r in records:
        print(f"{r.level} {r.ratio}: {r.question} -> {r.answer!r} (correct {r.correct}, equal {r.equal_to_full})")
    assert len(full) == len(at(0.3)) == 6
    assert all(r.equal_to_full for r in at(1.0)), "ratio 1.0 keeps every pair: answers must equal the full cache's"
    right, full_right = sum(r.correct for r in at(0.3)), sum(r.correct for r in full)
    assert right >= full_right, f"ratio 0.3: {right}/6 right, full cache {full_right}/6"
    equal = sum(r.equal_to_full for r in at(0.3))
    assert equal >= 5, f"ratio 0.3: {equal}/6 answers equal the full cache's"
