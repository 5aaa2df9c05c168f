"""A sweep's results file without a model: kept compressed (results.jsonl.gz) it is read, resumed and merged as the
plain file is; a partial last line is cut as before; compress writes the .gz atomically and loses nothing."""

import gzip
import json
import os

import pytest

from kvzip_jax.eval import report, results
from kvzip_jax.eval.results import RESULTS_VERSION, ResultsFile, SweepMismatchError, record_key

SETTINGS = dict(version=RESULTS_VERSION, model="tiny", instruction=None, chunk_size=64, seed=0)


def answers(examples=("toy-0", "toy-1", "toy-2"), settings=SETTINGS, method="full", ratio=1.0) -> list[dict]:
    """One record per example, of these settings."""
    mode = "full" if method == "full" else "reuse"
    return [
        dict(
            config=results.fingerprint(settings),
            example_hash=f"h-{e}",
            model="tiny",
            task="toy",
            example=e,
            question=0,
            method=method,
            mode=mode,
            ratio=ratio,
            prediction="100",
            references=["100"],
            metric="contains",
            score=1.0,
            agree=True,
            kl=0.0,
            flip=0.0,
            seconds=0.1,
        )
        for e in examples
    ]


def lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines()]


def unpacked(path) -> list[dict]:
    return lines(gzip.decompress(results.packed_path(path).read_bytes()))


def test_a_compressed_file_is_read_and_resumed_as_the_plain_one(tmp_path):
    path = tmp_path / "sweep" / "results.jsonl"
    first, later = answers()[:2], answers()[2:]
    ResultsFile(path, SETTINGS).append(first)
    plain = path.read_bytes()
    packed = results.compress(path)
    assert packed == tmp_path / "sweep" / "results.jsonl.gz" and not path.exists()
    assert gzip.decompress(packed.read_bytes()) == plain and results.read_bytes(packed) == plain
    assert results.settings_path(packed) == results.settings_path(path) and results.settings_path(path).exists()

    for opened in (path, packed):  # either name opens the one file
        resumed = ResultsFile(opened, SETTINGS, write=False)
        assert resumed.path == path and resumed.done == {record_key(r) for r in first}
    resumed = ResultsFile(path, SETTINGS)
    with pytest.raises(SweepMismatchError, match="another example toy/toy-0"):
        resumed.check_example("toy", "toy-0", "other")
    resumed.append(later)  # beside the .gz, which a sweep never rewrites
    assert lines(path.read_bytes()) == later and unpacked(path) == first
    assert lines(results.read_bytes(path)) == report.read_records(path) == report.read_records(packed) == first + later
    assert ResultsFile(path, SETTINGS).done == {record_key(r) for r in first + later}

    with pytest.raises(SweepMismatchError, match="other sweep settings.*chunk_size"):
        ResultsFile(path, {**SETTINGS, "chunk_size": 32})
    results.settings_path(path).unlink()
    path.unlink()
    with pytest.raises(SweepMismatchError, match="without a settings file"):
        ResultsFile(path, SETTINGS)


def test_compress_folds_the_plain_file_into_the_gz_each_answer_once(tmp_path):
    path = tmp_path / "results.jsonl"
    ResultsFile(path, SETTINGS).append(answers()[:2])
    results.compress(path)
    ResultsFile(path, SETTINGS).append(answers()[2:])
    results.compress(path)
    assert unpacked(path) == answers() and not path.exists()
    assert results.compress(path) == results.packed_path(path)  # already compressed: left as it is
    assert unpacked(path) == answers()
    with pytest.raises(FileNotFoundError):
        results.compress(tmp_path / "none.jsonl")

    # a compress cut off between writing the .gz and removing the plain file: each answer read once
    left = tmp_path / "left" / "results.jsonl"
    ResultsFile(left, SETTINGS).append(answers())
    kept = left.read_bytes()
    results.compress(left)
    left.write_bytes(kept)
    assert lines(results.read_bytes(left)) == report.read_records(left) == answers()
    resumed = ResultsFile(left, SETTINGS)
    resumed.append(answers(method="kvzip", ratio=0.5)[:1])
    assert lines(results.read_bytes(left)) == answers() + answers(method="kvzip", ratio=0.5)[:1]
    results.compress(left)
    assert unpacked(left) == answers() + answers(method="kvzip", ratio=0.5)[:1]


def test_a_partial_last_line_is_cut_off_plain_or_beside_a_gz(tmp_path):
    cut = '{"task": "toy", "exa'
    for packed in (False, True):
        path = tmp_path / str(packed) / "results.jsonl"
        ResultsFile(path, SETTINGS).append(answers()[:1])
        if packed:
            results.compress(path)
        ResultsFile(path, SETTINGS).append(answers()[1:])
        with open(path, "a") as f:  # a write cut off by a kill
            f.write(cut)
        with_cut = path.read_bytes()
        assert report.read_records(path) == answers()  # a reader drops it, and leaves the file be
        assert ResultsFile(path, SETTINGS, write=False).done == {record_key(r) for r in answers()}
        assert path.read_bytes() == with_cut
        resumed = ResultsFile(path, SETTINGS)  # a writer cuts it off
        assert path.read_bytes() == with_cut[: -len(cut)] and resumed.done == {record_key(r) for r in answers()}
        extra = answers(method="kvzip", ratio=0.5)
        resumed.append(extra)
        assert report.read_records(path) == answers() + extra
        with open(path, "a") as f:
            f.write(cut)
        results.compress(path)  # leaves the partial line out
        assert unpacked(path) == answers() + extra and not path.exists()


def test_compress_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    ResultsFile(path, SETTINGS).append(answers())
    before = sorted(p.name for p in tmp_path.iterdir())
    plain = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    for where, name in ((os, "fsync"), (os, "replace"), (gzip, "compress")):
        with monkeypatch.context() as m:
            m.setattr(where, name, fail)
            with pytest.raises(OSError, match="disk full"):
                results.compress(path)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name  # no .gz, no temporary file
        assert path.read_bytes() == plain
    results.compress(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl.gz", "results.jsonl.settings.json"]
    assert unpacked(path) == answers()


def test_compressed_shares_merge_as_plain_ones(tmp_path):
    folders = {}
    for form in ("plain", "gz", "mixed"):
        folder = folders[form] = tmp_path / form
        for i, examples in enumerate((("toy-0", "toy-1"), ("toy-1", "toy-2"))):  # toy-1 answered by both
            share = folder / results.results_name(i, 2)
            ResultsFile(share, SETTINGS).append(answers(examples))
            if form == "gz" or (form == "mixed" and i == 1):
                results.compress(share)
    assert results.results_files(folders["gz"]) == [
        folders["gz"] / "results.0-of-2.jsonl",
        folders["gz"] / "results.1-of-2.jsonl",
    ]
    merged = {form: results.merge(folder) for form, folder in folders.items()}
    for form, path in merged.items():
        assert path == folders[form] / "results.jsonl"
        assert path.read_bytes() == merged["plain"].read_bytes(), form
        assert [r["example"] for r in lines(path.read_bytes())] == ["toy-0", "toy-1", "toy-2"]

    # a compressed sweep folder stays compressed through a merge, and its report reads it
    folder = folders["gz"]
    results.compress(folder / "results.jsonl")
    ResultsFile(folder / results.results_name(0, 2), SETTINGS).append(answers(("toy-3",)))
    path = results.merge(folder)
    assert not path.exists() and [r["example"] for r in unpacked(path)] == ["toy-0", "toy-1", "toy-2", "toy-3"]
    written = report.write_report(path, folder)
    assert "4 answers (results.jsonl)" in written["markdown"].read_text()

    other = {**SETTINGS, "version": RESULTS_VERSION + 1}
    ResultsFile(tmp_path / "mixed-settings" / results.results_name(0, 2), SETTINGS).append(answers())
    ResultsFile(tmp_path / "mixed-settings" / results.results_name(1, 2), other).append(answers(settings=other))
    results.compress(tmp_path / "mixed-settings" / results.results_name(1, 2))
    with pytest.raises(SweepMismatchError, match=r"results\.1-of-2\.jsonl holds the results of other sweep settings"):
        results.merge(tmp_path / "mixed-settings")
