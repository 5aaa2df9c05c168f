"""bench/ruler_throughput.py's parts that run no model: the subset both sides read, the table, and the refusals
before anything runs (an existing folder, a ratio out of range)."""

import json

import pytest

from tests.conftest import bench_module

bench = bench_module("ruler_throughput")


def rows():
    # two questions of a1, one each of a2, a3; b1 and b2 of another task, interleaved as a file may be
    ids = [("a", "a1"), ("a", "a1"), ("b", "b1"), ("a", "a2"), ("b", "b2"), ("a", "a3")]
    return [{"task": t, "id": i, "question": f"q{n}"} for n, (t, i) in enumerate(ids)]


def test_subset_keeps_the_first_contexts_of_each_task_with_all_their_questions_in_file_order():
    assert [r["question"] for r in bench.subset(rows(), ["a"], 2)] == ["q0", "q1", "q3"]
    assert [r["question"] for r in bench.subset(rows(), ["a", "b"], 1)] == ["q0", "q1", "q2"]
    assert len(bench.subset(rows(), ["a", "b"], 9)) == 6
    with pytest.raises(SystemExit, match=r"no rows of \['c'\]"):
        bench.subset(rows(), ["a", "c"], 1)


def test_table_by_hand():
    text = bench.table([("kvzip-jax", 30, 120.0), ("kvpress", 30, 600.0)])
    assert "| kvzip-jax | 30 | 120 | 15.00 |" in text and "| kvpress | 30 | 600 | 3.00 |" in text
    assert "ours over kvpress: **5.00x**" in text


def test_refuses_an_existing_folder_and_a_ratio_out_of_range_before_running(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    python = tmp_path / "python"
    python.write_text("")
    common = ["--model", "m", "--gguf", "g", "--dataset", str(data), "--tasks", "a", "--kvpress-python", str(python)]
    with pytest.raises(SystemExit):
        bench.main([*common, "--out", str(tmp_path)])
    assert "exists: a timing is never resumed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([*common, "--out", str(tmp_path / "new"), "--ratio", "1"])
    assert "--ratio must be in (0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
