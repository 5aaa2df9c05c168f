"""bench/kvpress_ruler.py's helpers, which need no kvpress (this venv has none): reading and grouping kvpress-format
rows into contexts, the bad rows it names, the runs, the output's resume bookkeeping (an interrupted last line, a
context and press cut short) and main()'s paths that load no model (a bad dataset: status 2, nothing written; an
output already complete: nothing to run). The pipeline itself is checked by the manual command in the script's
docstring (bench/README.md), in .venv-kvpress."""

import json
import sys

import pyarrow
import pytest
from pyarrow import parquet

from tests.conftest import bench_module

bench = bench_module("kvpress_ruler")


def row(task, example, question, context="some context " * 10, answer=("a",), max_new_tokens=16, prefix="Answer:"):
    return dict(
        task=task,
        id=example,
        context=context,
        question=question,
        answer=list(answer) if isinstance(answer, tuple) else answer,
        answer_prefix=prefix,
        max_new_tokens=max_new_tokens,
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    row("t1", "t1-0", "q0", context="first", max_new_tokens=8),
    row("t2", "t2-0", "p0", context="second", answer="b"),
    row("t1", "t1-0", "q1", context="first", answer=("c", "d"), max_new_tokens=32),
    row("t1", "t1-3", "q2", context="third"),
    row("t2", 7, "p1", context="fourth"),
]


def test_import_needs_no_kvpress():
    assert "kvpress" not in sys.modules and "torch" not in vars(bench)


def test_group_contexts_by_task_and_id_in_row_order():
    contexts = bench.group_contexts(ROWS, "d.jsonl")
    assert [(c.task, c.example, c.rows) for c in contexts] == [
        ("t1", "t1-0", (0, 2)),
        ("t2", "t2-0", (1,)),
        ("t1", "t1-3", (3,)),
        ("t2", "7", (4,)),
    ]
    first = contexts[0]
    assert (first.context, first.questions, first.answer_prefix) == ("first", ("q0", "q1"), "Answer:")
    assert first.references == (("a",), ("c", "d")) and first.max_new_tokens == 8  # the first row's, as kvpress
    assert contexts[1].references == (("b",),)  # one string: one reference


def test_bad_rows_are_named():
    with pytest.raises(bench.InputError, match=r"d.jsonl row 1: missing column\(s\) answer_prefix, id"):
        bench.group_contexts(
            [ROWS[0], {k: v for k, v in ROWS[1].items() if k not in ("answer_prefix", "id")}], "d.jsonl"
        )
    with pytest.raises(bench.InputError, match="row 2: its context differs from row 0's"):
        bench.group_contexts([ROWS[0], ROWS[1], row("t1", "t1-0", "q1", context="other")], "d.jsonl")
    with pytest.raises(bench.InputError, match="row 1: its answer_prefix differs"):
        bench.group_contexts([ROWS[0], row("t1", "t1-0", "q1", context="first", prefix="")], "d.jsonl")
    with pytest.raises(bench.InputError, match="row 0: max_new_tokens must be an integer >= 1"):
        bench.group_contexts([row("t1", "x", "q", max_new_tokens=0)], "d.jsonl")
    with pytest.raises(bench.InputError, match="row 0: answer must be"):
        bench.group_contexts([row("t1", "x", "q", answer=[])], "d.jsonl")
    with pytest.raises(bench.InputError, match="holds no rows"):
        bench.group_contexts([], "d.jsonl")


def test_read_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:2])
    path.write_text(path.read_text() + "\n")  # a blank line is not a row
    assert bench.read_rows(path) == ROWS[:2]
    with pytest.raises(bench.InputError, match="no dataset file .*missing.jsonl"):
        bench.read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(bench.InputError, match=r"bad.jsonl line 2 \(row 1\): not JSON"):
        bench.read_rows(tmp_path / "bad.jsonl")
    rows = [ROWS[0], {**ROWS[1], "answer": ["b"]}]  # a parquet column holds one type
    parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "d.parquet")
    contexts = bench.group_contexts(bench.read_rows(tmp_path / "d.parquet"), "d.parquet")
    assert [(c.example, c.references) for c in contexts] == [("t1-0", (("a",),)), ("t2-0", (("b",),))]


def test_select_and_runs():
    contexts = bench.group_contexts(ROWS, "d.jsonl")
    assert [c.example for c in bench.select(contexts, None, 1)] == ["t1-0", "t2-0"]  # the first context per task
    assert [c.example for c in bench.select(contexts, ["t2"], None)] == ["t2-0", "7"]
    with pytest.raises(bench.InputError, match="no task t9 in the dataset; its tasks: t1, t2"):
        bench.select(contexts, ["t9"], None)
    assert bench.runs(["none", "kvzip", "none"], [0.7, 0.5]) == [("none", 0.0), ("kvzip", 0.7), ("kvzip", 0.5)]


def answers(c, press, ratio, predictions=None):
    predictions = predictions or [f"{press} {i}" for i in range(len(c.questions))]
    return bench.answer_records(c, press, ratio, predictions, 3.0, 100, "m", "0.5.5")


def test_answer_records():
    c = bench.group_contexts(ROWS, "d.jsonl")[0]
    records = answers(c, "kvzip", 0.7)
    assert [r["question"] for r in records] == [0, 1]
    assert records[1] == {
        "task": "t1",
        "example": "t1-0",
        "question": 1,
        "press": "kvzip",
        "compression_ratio": 0.7,
        "prediction": "kvzip 1",
        "references": ["c", "d"],
        "seconds": 1.5,  # the call's 3 s over its 2 questions
        "context_seconds": 3.0,
        "context_tokens": 100,
        "model": "m",
        "kvpress_version": "0.5.5",
    }
    with pytest.raises(ValueError, match="1 answers for 2 questions"):
        answers(c, "kvzip", 0.7, ["only one"])


def test_resume_bookkeeping(tmp_path, capsys):
    c1, c2 = bench.group_contexts(ROWS, "d.jsonl")[:2]  # 2 questions, 1 question
    pairs = bench.runs(["none", "kvzip"], [0.7])
    out = tmp_path / "out.jsonl"
    assert bench.read_output(out) == ([], False)
    other = answers(c1, "snapkv", 0.7)  # not asked for in this run: kept as it is
    done = answers(c1, "none", 0.0) + answers(c2, "none", 0.0)
    cut = answers(c1, "kvzip", 0.7)[:1]  # its second line never written
    bench.write_records(out, other + done + cut, mode="w")
    out.write_text(out.read_text() + '{"task": "t2", "exam')  # an interrupted last line
    records, dirty = bench.read_output(out)
    assert records == other + done + cut and dirty
    assert "line 7: ignoring an invalid last line" in capsys.readouterr().err
    kept, keys = bench.settle(records, [c1, c2], pairs)
    assert kept == other + done
    assert keys == {("t1", "t1-0", "none", 0.0), ("t2", "t2-0", "none", 0.0)}
    bench.write_records(out, kept, mode="w")
    bench.write_records(out, answers(c1, "kvzip", 0.7) + answers(c2, "kvzip", 0.70000001))
    records, dirty = bench.read_output(out)
    assert not dirty and len(bench.settle(records, [c1, c2], pairs)[1]) == 4

    out.write_text(json.dumps(done[0]))  # a valid line without its newline: appending would join two lines
    assert bench.read_output(out) == ([done[0]], True)
    out.write_text("not json\n" + json.dumps(done[0]) + "\n")
    with pytest.raises(bench.InputError, match="line 1: not a JSON object"):
        bench.read_output(out)
    out.write_text(json.dumps({"task": "t1"}) + "\n")
    with pytest.raises(bench.InputError, match="line 1: lacks example, press, compression_ratio, question"):
        bench.read_output(out)


def test_main_without_a_model(tmp_path, capsys):
    """A missing file or column: status 2 and nothing written; an output holding every answer: nothing to run, so no
    model (nor kvpress) is loaded."""
    out = tmp_path / "out.jsonl"
    common = ["--gguf", "unused.gguf", "--presses", "none,kvzip", "--out", str(out)]
    assert bench.main(["--dataset", str(tmp_path / "missing.jsonl"), *common]) == 2
    assert "error: no dataset file" in capsys.readouterr().err
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {k: v for k, v in ROWS[1].items() if k != "task"}])
    assert bench.main(["--dataset", str(bad), *common]) == 2
    assert "bad.jsonl row 1: missing column(s) task" in capsys.readouterr().err
    assert not out.exists()

    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    contexts = bench.group_contexts(ROWS, "d.jsonl")
    complete = [r for c in contexts for p, ratio in bench.runs(["none", "kvzip"], [0.7]) for r in answers(c, p, ratio)]
    bench.write_records(out, complete, mode="w")
    before = out.read_text()
    assert bench.main(["--dataset", str(data), *common]) == 0
    assert "8 already in" in capsys.readouterr().err and out.read_text() == before
    with pytest.raises(SystemExit):
        bench.main(["--dataset", str(data), *common, "--compression-ratios", "1"])
    assert "--compression-ratios must lie in (0, 1)" in capsys.readouterr().err
