"""kvzip-jax train-scorer end to end on a tiny random model (with SmolLM2's tokenizer): the model writes texts, their
features are extracted, a linear scorer and a gate are fitted and saved with their manifests; a rerun resumes
without recomputing; eval then runs fast-kvzip and kvzap from the saved scorers; a scorer of another model is a
named error; compress --decode-budget answers with the cache cut back while decoding."""

import json

import numpy as np
import pytest

from kvzip_jax import cli
from kvzip_jax.cli import train_scorer
from kvzip_jax.eval import sweep
from kvzip_jax.scorers import data, pipeline, scorer, store
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer
from tests.test_eval_sweep import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(bundled_tokenizer(registry.SMOLLM2))


def train(kind, *extra):
    argv = ["train-scorer", "--model", "tiny", "--kind", kind, "--texts", "3", "--held-out", "1"]
    argv += ["--max-new-tokens", "40", "--batch", "3", "--tokens-per-text", "16", "--quiet", *extra]
    return cli.main(argv)


def test_train_both_kinds_resume_then_eval_reads_them(model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": model)
    monkeypatch.setenv("KVZIP_CHECKPOINTS", str(tmp_path))
    root = tmp_path / "tiny" / "scorers"
    assert train("linear") == 0
    texts = data.read_texts(root / "data")
    assert len(texts) == 3 and all(t["text"] and t["prompt"].startswith("Write ") for t in texts)
    shards = sorted((root / "data" / "features").glob("*.npz"))
    assert [p.name for p in shards] == ["00000.npz", "00001.npz", "00002.npz"]
    first = data.load_features(shards[0])
    L, K, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.hidden_size
    n = first["kvzip"].shape[-1]
    assert first["hidden"].shape == (L, min(16, n), D) and first["kvzip_plus"].shape == (L, K, n)
    assert np.all((first["kvzip"] >= 0) & (first["kvzip"] <= 1))
    manifest = json.loads((root / "linear" / store.MANIFEST).read_text())
    assert manifest["model"] == "tiny" and manifest["kind"] == "linear" and manifest["texts"] == 3
    assert 0 <= manifest["top30_overlap"] <= 1 and np.isfinite(manifest["held_out_loss"])
    out = capsys.readouterr().out
    assert "top-30% overlap with KVzip" in out and f"wrote {root / 'linear'}" in out

    other = tmp_path / "other-data"  # another model's data folder, reading these texts instead of writing its own
    assert train("linear", "--data", str(other), "--texts-from", str(root / "data"), "--out", str(tmp_path / "l2")) == 0
    assert data.read_texts(other) == texts and len(list((other / "features").glob("*.npz"))) == 3
    assert json.loads((tmp_path / "l2" / store.MANIFEST).read_text())["texts_from"] == str(root / "data")
    capsys.readouterr()

    stamps = [p.stat().st_mtime_ns for p in shards]
    assert train("gate", "--steps", "20", "--train-batch", "16") == 0  # the same texts and features, reused
    assert [p.stat().st_mtime_ns for p in shards] == stamps and len(data.read_texts(root / "data")) == 3
    gate_manifest = json.loads((root / "gate" / store.MANIFEST).read_text())
    assert gate_manifest["config"]["group"] == 2 and len(gate_manifest["history"]) >= 2
    assert train("gate", "--steps", "20") == cli.EXIT_USER_ERROR  # the folder exists: --overwrite to replace
    assert "already exists" in capsys.readouterr().err

    argv = ["eval", "--model", "tiny", "--tasks", "passkey", "--contexts", "2", "--context-tokens", "100"]
    argv += ["--methods", "fast-kvzip,kvzap,kvzap:threshold=0", "--ratios", "1,0.3", "--batch-size", "2"]
    assert cli.main([*argv, "--no-progress", "--out", str(tmp_path / "run")]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {(r["method"], r["ratio"]) for r in records} == {("full", 1.0)} | {
        (m, r) for m in ("fast-kvzip", "kvzap", "kvzap:threshold=0") for r in (1.0, 0.3)
    }
    by_threshold = {r["ratio"]: r["bytes"] for r in records if r["method"] == "kvzap:threshold=0"}
    assert by_threshold[1.0] == by_threshold[0.3]  # a threshold ignores the ratio
    settings = json.loads((tmp_path / "run" / "results.jsonl.settings.json").read_text())
    assert set(settings["scorers"]) == {"gate", "linear"}
    argv[argv.index("--methods") + 1 : argv.index("--batch-size")] = ["kvzap", "--ratios", "0.5"]  # the linear alone
    assert cli.main([*argv, "--no-progress", "--out", str(tmp_path / "run")]) == 0  # the same sweep, grown
    grown = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {(r["method"], r["ratio"]) for r in grown[len(records) :]} == {("kvzap", 0.5)}
    assert grown[: len(records)] == records and {r["config"] for r in grown} == {records[0]["config"]}
    assert json.loads((tmp_path / "run" / "results.jsonl.settings.json").read_text()) == settings

    context = tmp_path / "context.txt"
    context.write_text(" ".join(f"word{i % 37}" for i in range(160)))
    argv = ["compress", "--model", "tiny", "--context", str(context), "--ratio", "0.5", "--method", "kvzap"]
    argv += ["--decode-budget", "140", "--question", "Go on.", "--max-new-tokens", "300", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Q: Go on." in out and " pairs after 256 tokens" in out  # cut after the second block of 128

    argv = ["compress", "--model", "tiny", "--context", str(context), "--threshold", "0", "--method", "kvzap"]
    assert cli.main([*argv, "--question", "Go on.", "--max-new-tokens", "8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "at threshold 0.0: " in out and "tokens kept: " in out, out

    other = tiny_model(model.tokenizer)
    other = type(other)("other", other.cfg, other.params, other.tokenizer)
    with pytest.raises(store.ScorerMismatchError, match="trained for model 'tiny', not 'other'"):
        scorer.load(other, "linear", root / "linear")
    with pytest.raises(scorer.ScorerMissingError, match="train one with `kvzip-jax train-scorer --model other"):
        scorer.load(other, "gate")


def test_texts_from_another_folder_seed_once_and_must_agree(tmp_path):
    source, ours = tmp_path / "source", tmp_path / "ours"
    for i in range(3):
        data.append_text(source, f"Write {i}", f"text {i}")
    pipeline.adopt_texts(ours, source, 2)
    assert [t["text"] for t in data.read_texts(ours)] == ["text 0", "text 1"]
    pipeline.adopt_texts(ours, source / "texts.jsonl", 3)  # grown by the source's next text, nothing rewritten
    assert data.read_texts(ours) == data.read_texts(source)
    with pytest.raises(data.ScorerDataError, match="fewer than the 4"):
        pipeline.adopt_texts(ours, source, 4)
    data.append_text(tmp_path / "else", "Write 0", "another text")
    with pytest.raises(data.ScorerDataError, match="holds other texts"):
        pipeline.adopt_texts(tmp_path / "else", source, 2)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(data.ScorerDataError, match="not a data folder's texts.jsonl"):
        pipeline.adopt_texts(ours, tmp_path / "notes.txt", 2)


def test_texts_from_a_missing_folder_or_of_other_prompts_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train("linear", "--texts-from", str(tmp_path / "nowhere"))
    assert exit_info.value.code == 2 and "--texts-from: no such folder" in capsys.readouterr().err
    data.append_text(tmp_path / "prose", "Write an essay about volcanoes. Use at least 800 words.", "text")
    with pytest.raises(SystemExit) as exit_info:
        train("linear", "--texts-from", str(tmp_path / "prose"), "--prompts", "mixed")
    assert exit_info.value.code == 2 and "answer the prose prompts" in capsys.readouterr().err


def test_mixed_prompts_take_turns_with_the_prose_and_a_folder_keeps_one_set(tmp_path):
    prose, mixed = data.writing_prompts(400), data.writing_prompts(8, "mixed")
    assert prose[:2] == ["Write an essay about the history of bridges. Use at least 800 words."] + [
        "Write a short story about the history of bridges. Use at least 800 words."
    ]
    assert len(set(prose[:180])) == 180 and prose[180:360] == prose[:180]  # every (style, topic) pair, then again
    assert mixed[0::2] == prose[:4] and all("with at least 60 entries" in p for p in mixed[1::2])
    with pytest.raises(ValueError, match="prompt_set must be one of"):
        data.writing_prompts(2, "poems")
    folder = tmp_path / "data"
    data.append_text(folder, prose[0], "a text written before prompts.json")  # such a folder holds prose
    data.check_prompt_set(folder, "prose")
    with pytest.raises(data.ScorerDataError, match="holds texts of the prose prompts, not mixed"):
        data.check_prompt_set(folder, "mixed")
    data.check_prompt_set(tmp_path / "new", "mixed")
    assert data.prompt_set_of(tmp_path / "new") == "mixed"
    data.append_text(tmp_path / "new", mixed[0], "text")
    pipeline.adopt_texts(tmp_path / "copy", tmp_path / "new", 1)  # the copy answers the same prompts
    assert data.prompt_set_of(tmp_path / "copy") == "mixed"
    dirs = train_scorer.default_dirs("m", "gate", "mixed")  # beside the prose scorers, where --scorers reads them
    assert [d.relative_to(d.parents[3]).as_posix() for d in dirs] == ["m/scorers/mixed/data", "m/scorers/mixed/gate"]


def test_a_sweep_reading_fewer_of_a_folders_scorers_is_that_folders_sweep():
    stored = {"model": "m", "seed": 1, "scorers": {"gate": "g1", "linear": "l1"}}
    assert sweep.reading_fewer_scorers(None, {"model": "m"}) == {"model": "m"}
    assert sweep.reading_fewer_scorers(stored, {"model": "m", "seed": 1, "scorers": {"linear": "l1"}}) is stored
    assert sweep.reading_fewer_scorers(stored, {"model": "m", "seed": 1}) is stored  # no scorer read at all
    for other in (
        {"model": "m", "seed": 1, "scorers": {"linear": "l2"}},  # another linear scorer
        {"model": "m", "seed": 2, "scorers": {"linear": "l1"}},  # another setting
        {"model": "m", "seed": 1, "scorers": {"gate": "g1", "linear": "l1", "mlp": "m1"}},  # a scorer it lacks
    ):
        assert sweep.reading_fewer_scorers(stored, other) is other


def test_progress_into_a_log_is_plain_lines_at_most_so_often(monkeypatch, capsys):
    from argparse import Namespace

    from kvzip_jax.cli import common

    clock = iter([0.0, 10.0, 61.0, 62.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    on_step, close = common.progress(Namespace(quiet=False), "fitting", unit="step", log_seconds=60)
    for done in (1, 2, 3, 4):  # stderr under capsys is not a terminal
        on_step(done, 4)
    close()
    assert capsys.readouterr().err.splitlines() == ["fitting: 1/4 step", "fitting: 3/4 step", "fitting: 4/4 step"]
    on_chunk, close = common.progress(Namespace(quiet=False), "prefill")  # no log_seconds: silent, as before
    on_chunk(1, 2)
    close()
    on_step, close = common.progress(Namespace(quiet=True), "fitting", log_seconds=60)
    on_step(4, 4)
    close()
    assert capsys.readouterr().err == ""
