"""Saved caches (kvzip_jax.cache_io) on SmolLM2: masked, ragged and compacted caches come back identical; a new
process answers token for token as the cache did before saving; every mismatch gets its named error; a save killed
midway leaves nothing that loads; the CLI's compress --save and ask --cache."""

import dataclasses
import gc
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import cache_io, cli, kvzip, matching, prompts
from kvzip_jax import generate as gen
from kvzip_jax.quant.groups import QuantFormat
from tests.test_cli import CONTEXT, QUESTION, restored, smollm2, smollm2_checkpoint  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def caches(restored):
    """{form: cache} of the CONTEXT at ratio 0.5: KVzip masked, the same packed ragged, AM-compacted ragged, and
    quantized: the ragged one in int4 with uncentred keys, the compacted one (dense, with its bias) in int8, the
    masked one in int8 keys beside int4 values."""
    context, suffixes = prompts.split_for_reuse(restored.tokenizer, CONTEXT, [QUESTION])
    _, cache = gen.prefill(restored.params, restored.cfg, [context.ids()])
    reread = kvzip.reread_inputs(restored.tokenizer, [context.context_start], [context.ids()[context.context_slice]])
    masked, _ = jax.jit(kvzip.score_and_evict)(restored.params, restored.cfg, cache, reread, 0.5)
    compacted, _ = jax.jit(matching.compact)(  # uniform budgets: one fit size to compile (global's ladder, several)
        restored.params, restored.cfg, cache, reread, matching.MatchingConfig(ratio=0.5, budget="uniform")
    )
    int4, int8 = QuantFormat(bits=4, group=32), QuantFormat(bits=8, group=64, scale_dtype="float16")
    return {
        "masked": masked,
        "ragged": kv.pack(masked, 64),
        "compacted": kv.pack(compacted, 64),
        "ragged-int4": kv.quantized(kv.pack(masked, 64), int4, window=32, center=False),
        "compacted-int8": kv.quantized(compacted, int8),
        "masked-k8v4": kv.quantized(masked, QuantFormat(bits=8), value_fmt=QuantFormat(bits=4)),
    }, suffixes[0]


def _answer(model, cache, suffix):
    return gen.ask(model.params, model.cfg, cache, suffix, 12, stop_tokens=prompts.stop_token_ids(model.tokenizer))[0]


def test_save_then_load_in_a_new_process_answers_token_for_token(
    tmp_path,
    smollm2_checkpoint,
    restored,
    caches,
):
    forms, suffix = caches
    want = {}
    for form, cache in forms.items():
        cache_io.save(tmp_path / form, cache, restored, meta={"form": form})
        back, manifest = cache_io.load(tmp_path / form, restored)  # same process: every array identical
        assert jax.tree.structure(back) == jax.tree.structure(cache) and manifest["meta"] == {"form": form}
        for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        layout = manifest["layers"][0]
        if form == "ragged-int4":  # the format is in the manifest; a cache without quantized layers stays layout 1
            assert (layout["kind"], layout["store"], layout["bits"], layout["group"], layout["window"]) == (
                "quantized",
                "ragged",
                4,
                32,
                32,
            ) and manifest["layout_version"] == 2
        elif form == "ragged":
            assert layout["kind"] == "ragged" and manifest["layout_version"] == 1
        elif form == "compacted-int8":  # centred keys: their centres saved beside the store
            assert "key_center" in layout["fields"] and manifest["layout_version"] == 3
        elif form == "masked-k8v4":  # values in other bits than keys
            assert (layout["bits"], layout["v_bits"], manifest["layout_version"]) == (8, 4, 4)
        if form == "ragged":  # a new process answers from it; the others' arrays (int4 too) are checked here
            want[form] = _answer(restored, jax.tree.map(jnp.copy, cache), suffix)
    script = textwrap.dedent(f"""
        import json, sys
        from kvzip_jax import cache_io, generate as gen, prompts
        from kvzip_jax.weights import registry
        model = registry.load({str(smollm2_checkpoint)!r})
        out = {{}}
        for form in ("ragged",):
            cache, _ = cache_io.load({str(tmp_path)!r} + "/" + form, model)
            out[form] = gen.ask(model.params, model.cfg, cache, {list(map(int, suffix))!r}, 12,
                                stop_tokens=prompts.stop_token_ids(model.tokenizer))[0]
        print(json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == want
    assert all(len(answer) > 0 for answer in want.values())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's readers of damaged files
def test_every_mismatch_gets_its_named_error(tmp_path, restored, caches):
    forms, _ = caches
    saved = cache_io.save(tmp_path / "c", forms["ragged"], restored)
    first = jax.tree_util.tree_leaves_with_path(restored.params)[0][0]
    other = dataclasses.replace(
        restored,
        params=jax.tree_util.tree_map_with_path(lambda path, x: x * 1.01 if path == first else x, restored.params),
    )  # another model: one tensor retrained
    with pytest.raises(cache_io.CacheMismatchError, match="weights differ"):
        cache_io.load(saved, other)
    bf16 = dataclasses.replace(restored, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), restored.params))
    with pytest.raises(cache_io.CacheMismatchError, match="saved in float32"):
        cache_io.load(saved, bf16)
    manifest = json.loads((saved / cache_io.MANIFEST).read_text())
    (saved / cache_io.MANIFEST).write_text(json.dumps({**manifest, "layout_version": cache_io.LAYOUT_VERSION + 1}))
    with pytest.raises(cache_io.CacheFormatError, match="upgrade kvzip-jax"):
        cache_io.load(saved, restored)
    (saved / cache_io.MANIFEST).write_text(json.dumps({**manifest, "tokenizer": "0" * 16}))
    with pytest.raises(cache_io.CacheMismatchError, match="tokenizer"):
        cache_io.load(saved, restored)
    (saved / cache_io.MANIFEST).write_text(json.dumps(manifest))
    cache_io.load(saved, restored)  # the manifest restored: it loads again

    data = max((f for f in (saved / cache_io.ARRAYS).rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    original = data.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    with pytest.raises(cache_io.CacheCorruptError):
        cache_io.load(saved, restored)
    data.write_bytes(original[: len(original) // 3])
    with pytest.raises(cache_io.CacheCorruptError):
        cache_io.load(saved, restored)
    gc.collect()  # orbax's abandoned shard readers of the damaged files go here, under this test's filter, not later
    with pytest.raises(cache_io.CacheCorruptError, match="not a saved cache"):
        cache_io.load(tmp_path / "absent", restored)


def test_a_save_killed_midway_leaves_nothing_that_loads(tmp_path, smollm2_checkpoint, restored):
    """A subprocess saves a cache and is killed (SIGKILL) after the arrays are written, before the manifest."""
    target = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import os, signal
        from kvzip_jax import cache as kv, cache_io
        from kvzip_jax.weights import registry
        model = registry.load({str(smollm2_checkpoint)!r})
        cache = kv.init_cache(model.cfg, 1, 16)  # any cache: no forward to compile
        cache_io._write_manifest = lambda path, manifest: os.kill(os.getpid(), signal.SIGKILL)
        cache_io.save({str(target)!r}, cache, model)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert not target.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".killed.tmp-")]
    assert leftovers and (leftovers[0] / cache_io.ARRAYS).exists()  # the arrays were written, then the kill
    for path in (target, leftovers[0]):
        with pytest.raises(cache_io.CacheCorruptError, match="not a saved cache"):
            cache_io.load(path, restored)


def test_cli_compress_save_then_ask_or_chat_without_prefill(
    capsys,
    monkeypatch,
    smollm2,
    restored,
    tmp_path,
):
    context_file = tmp_path / "context.txt"
    context_file.write_text(CONTEXT)
    saved = tmp_path / "doc.kv"
    argv = [
        "compress",
        "--model",
        str(smollm2),
        "--context",
        str(context_file),
        "--ratio",
        "0.5",
        "--question",
        QUESTION,
        "--max-new-tokens",
        "12",
        "--save",
        str(saved),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"saved to {saved}/" in out and "bytes on disk" in out and "bytes in memory" in out
    answer = next(line for line in out.splitlines() if line.startswith("A: "))
    manifest = cache_io.read_manifest(saved)
    assert manifest["meta"]["method"] == "kvzip" and manifest["meta"]["ratio"] == 0.5
    assert manifest["meta"]["model_source"] == str(smollm2)

    assert cli.main(["ask", "--cache", str(saved), "--question", QUESTION, "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "no prefill or scoring" in out and "prefill:" not in out
    assert next(line for line in out.splitlines() if line.startswith("A: ")) == answer
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))  # a chat over the saved cache: the same answer
    assert cli.main(["chat", "--cache", str(saved), "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "no prefill, no scoring" in out and f"> {answer[3:]}\n" in out and out.rstrip().endswith("bye")
    assert (
        cli.main(
            [
                "compress",
                "--model",
                str(smollm2),
                "--context",
                str(context_file),
                "--ratio",
                "0.5",
                "--save",
                str(saved),
            ]
        )
        == cli.EXIT_USER_ERROR
    )  # exists: refused, not overwritten
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["ask", "--cache", str(tmp_path / "absent"), "--question", QUESTION]) == cli.EXIT_USER_ERROR
    assert "not a saved cache" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "absent")
