"""The leaderboard over tasks (kvzip_jax/eval/leaderboard.py) by hand on synthetic records, its section of the
report, paired differences, and bench/ruler_pairs.py on two tiny hand-made files."""

import csv
import json

import numpy as np
import pytest

from kvzip_jax.eval import leaderboard, report
from tests.conftest import bench_module, sweep_record

TASKS = ["ruler_cwe", "ruler_niah_single_1", "ruler_vt"]


def rec(task, example, question, method, ratio, score, **extra):
    full = method == "full"
    mode, ratio = ("full", 1.0) if full else ("reuse", ratio)
    return sweep_record(task, example, question, method, mode, ratio, score, metric="string_match_all", **extra)


# (task, example, question) -> score, per (method, ratio); kvzip at 0.3 never answered ruler_vt
SCORES = {
    ("full", 1.0): {
        ("ruler_cwe", "e0", 0): 1.0,
        ("ruler_cwe", "e0", 1): 0.5,
        ("ruler_cwe", "e1", 0): 0.0,
        ("ruler_niah_single_1", "e0", 0): 1.0,
        ("ruler_niah_single_1", "e1", 0): 1.0,
        ("ruler_vt", "e0", 0): 0.5,
        ("ruler_vt", "e1", 0): 1.0,
    },
    ("kvzip", 0.5): {
        ("ruler_cwe", "e0", 0): 1.0,
        ("ruler_cwe", "e0", 1): 0.0,
        ("ruler_cwe", "e1", 0): 0.0,
        ("ruler_niah_single_1", "e0", 0): 1.0,
        ("ruler_niah_single_1", "e1", 0): 0.0,
        ("ruler_vt", "e0", 0): 0.5,
        ("ruler_vt", "e1", 0): 0.5,
    },
    ("kvzip", 0.3): {
        ("ruler_cwe", "e0", 0): 0.0,
        ("ruler_cwe", "e0", 1): 0.0,
        ("ruler_cwe", "e1", 0): 0.0,
        ("ruler_niah_single_1", "e0", 0): 1.0,
        ("ruler_niah_single_1", "e1", 0): 0.0,
    },
}


@pytest.fixture
def records():
    return [rec(*key, method, ratio, s) for (method, ratio), scores in SCORES.items() for key, s in scores.items()]


def test_leaderboard_by_hand(records):
    rows = leaderboard.leaderboard(records)
    assert [(r["method"], r["ratio"], r["compression_ratio"], r["n_contexts"]) for r in rows] == [
        ("full", 1.0, 0.0, 6),
        ("kvzip", 0.5, 0.5, 6),
        ("kvzip", 0.3, 0.7, 4),
    ]
    assert list(rows[0]) == [*leaderboard.FIELDS, *TASKS] and leaderboard.tasks_of(rows) == TASKS
    full, half, third = rows
    assert [full[t] for t in TASKS] == [50.0, 100.0, 75.0]  # cwe: (1 + 0.5 + 0) / 3 over its 3 answers
    assert full["average"] == 75.0 and full["of_full"] == 100.0
    assert [half[t] for t in TASKS] == pytest.approx([100 / 3, 50.0, 50.0])
    assert half["average"] == pytest.approx(100 * (1 / 3 + 0.5 + 0.5) / 3)
    assert half["of_full"] == pytest.approx(100 * half["average"] / 75.0)
    for row in (full, half):
        assert row["average_lo"] <= row["average"] <= row["average_hi"]
        assert row["average_lo"] < row["average_hi"]
    # kvzip at 0.3 lacks ruler_vt, which the full cache has: no average over the other two
    assert [third[t] for t in TASKS] == [0.0, 50.0, None]
    assert (third["average"], third["average_lo"], third["average_hi"], third["of_full"]) == (None,) * 4
    assert leaderboard.leaderboard(records) == rows  # deterministic
    assert leaderboard.leaderboard(records[::-1]) == rows  # whatever the records' order


def test_leaderboard_interval_degenerate_when_every_score_is_equal(records):
    rows = leaderboard.leaderboard([{**r, "score": 0.5} for r in records if r["ratio"] != 0.3])
    for row in rows:
        assert row["average"] == row["average_lo"] == row["average_hi"] == 50.0


def test_bootstrap_average_resamples_each_task():
    # one task of two contexts, right and wrong: the resampled means are 0, 0.5 and 1
    assert leaderboard.bootstrap_average([np.array([[1.0, 1.0], [0.0, 1.0]])]) == (0.0, 1.0)
    # a context's questions stay together: 2 of 2 right and 0 of 1 right
    low, high = leaderboard.bootstrap_average([np.array([[2.0, 2.0], [0.0, 1.0]]), np.array([[1.0, 1.0]])])
    assert (low, high) == (0.5, 1.0)  # the first task's resampled means: 0, 2/3 or 1; the second's always 1


def test_leaderboard_errors(records):
    with pytest.raises(ValueError, match="several models"):
        leaderboard.leaderboard(records + [{**records[0], "model": "other"}])
    with pytest.raises(ValueError, match="no rows"):
        leaderboard.markdown([])


def test_markdown_and_csv(tmp_path, records):
    rows = leaderboard.leaderboard(records)
    lines = leaderboard.markdown(rows).strip().splitlines()
    assert (
        lines[0] == "| method | ratio | compression_ratio | average [lo, hi] | % of full | cwe | niah_single_1 | vt |"
    )
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|---:|"
    full = rows[0]
    assert lines[2] == (
        f"| full | 1 | 0 | 75.0 [{full['average_lo']:.1f}, {full['average_hi']:.1f}] | 100.0 | 50.0 | 100.0 | 75.0 |"
    )
    assert lines[4] == "| kvzip | 0.3 | 0.7 | - | - | 0.0 | 50.0 | - |"
    assert leaderboard.markdown(rows, ["ruler_vt"]).splitlines()[0].endswith("| % of full | vt |")
    path = leaderboard.write_csv(rows, tmp_path / "board.csv")
    with path.open() as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == [*leaderboard.FIELDS, *TASKS] and len(got) == 3
    assert float(got[0]["average"]) == 75.0 and got[2]["average"] == "" and got[2]["ruler_vt"] == ""
    assert [p.name for p in tmp_path.iterdir()] == ["board.csv"]  # no temporary file left behind


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_report_leaderboard_only_for_several_tasks(tmp_path, records):
    paths = report.write_report(write_jsonl(tmp_path / "many.jsonl", records), tmp_path / "many")
    assert paths["leaderboard"] == tmp_path / "many" / "leaderboard.csv" and paths["leaderboard"].exists()
    md = paths["markdown"].read_text()
    assert md.index("## Leaderboard: average over tasks") < md.index("## Score normalised")
    assert "| kvzip | 0.3 | 0.7 | - | - | 0.0 | 50.0 | - |" in md
    one = [r for r in records if r["task"] == "ruler_vt"]
    paths = report.write_report(write_jsonl(tmp_path / "one.jsonl", one), tmp_path / "one")
    assert "leaderboard" not in paths and not (tmp_path / "one" / "leaderboard.csv").exists()
    assert "Leaderboard" not in paths["markdown"].read_text()


def test_paired_difference():
    per_task, average = leaderboard.paired_difference(
        {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.5, 0.5]}, {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.5, 0.5]}
    )
    a, b = per_task["a"], per_task["b"]
    assert (a["n"], a["ours"], a["theirs"], a["difference"]) == (4, 75.0, 50.0, 25.0)
    assert a["difference_lo"] == 0.0 and a["difference_hi"] > 25.0
    assert (b["difference"], b["difference_lo"], b["difference_hi"]) == (0.0, 0.0, 0.0)  # equal pairs: no spread
    assert (average["n"], average["ours"], average["theirs"], average["difference"]) == (6, 62.5, 50.0, 12.5)
    # b's differences are all 0: the average's resamples are a's halved
    assert (average["difference_lo"], average["difference_hi"]) == (0.0, a["difference_hi"] / 2)
    with pytest.raises(ValueError, match="as many scores"):
        leaderboard.paired_difference({"a": [1.0]}, {"a": [1.0, 0.0]})
    with pytest.raises(ValueError, match="same tasks"):
        leaderboard.paired_difference({"a": [1.0]}, {"b": [1.0]})


def test_ruler_pairs(tmp_path, capsys):
    bench = bench_module("ruler_pairs")

    def ours(task, example, method, prediction, references):
        score = bench.metrics.score("string_match_all", prediction, references)
        return {**rec(task, example, 0, method, 0.5, score), "prediction": prediction}

    def theirs(task, example, press, prediction, references):
        ratio = 0.0 if press == "none" else 0.5
        return dict(
            task=task,
            example=example,
            question=0,
            press=press,
            compression_ratio=ratio,
            prediction=prediction,
            references=references,
        )

    x, w = ["x1", "x2"], ["w1", "w2"]
    our_file = write_jsonl(
        tmp_path / "results.jsonl",
        [
            ours("ruler_vt", "e0", "full", "x1 x2", x),
            ours("ruler_vt", "e1", "full", "x1", x),
            ours("ruler_cwe", "e0", "full", "w1 w2", w),
            ours("ruler_vt", "e0", "kvzip", "x1", x),
            ours("ruler_vt", "e1", "kvzip", "", x),
            ours("ruler_cwe", "e0", "kvzip", "w1 w2", w),
        ],
    )
    kvpress_file = write_jsonl(
        tmp_path / "kvpress.jsonl",
        [
            theirs("ruler_vt", "e0", "none", "x1 x2", x),
            theirs("ruler_vt", "e1", "none", " x1\n", x),  # equal to ours but for whitespace
            theirs("ruler_cwe", "e0", "none", "w1", w),  # not equal to ours
            theirs("ruler_vt", "e0", "kvzip", "X1\x02X2", x),  # RULER's cleaning: the \x02 a newline
            theirs("ruler_vt", "e1", "kvzip", "  ", x),
            theirs("ruler_cwe", "e0", "kvzip", "w2", w),
            theirs("ruler_vt", "e0", "knorm", "x1", x),  # not mapped
            theirs("ruler_vt", "e0", "snapkv", "x1", x),  # no snapkv records of ours
        ],
    )
    out = tmp_path / "pairs.md"
    assert bench.main([str(our_file), "--kvpress", str(kvpress_file), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "1 kvpress lines: press 'knorm' not mapped" in captured.err
    assert "1 kvpress lines: no record of ours for snapkv at 0.5" in captured.err
    lines = captured.out.strip().splitlines()
    assert out.read_text() == captured.out and len(lines) == 2 + 2 * 3
    # full: vt (1, 0.5) on both sides; cwe ours 1, kvpress 0.5; one of 3 predictions differs (cwe)
    assert lines[4] == "| full | 1 | 0 | average | 3 | 87.5 | 62.5 | +25.0 [+25.0, +25.0] | 66.7 |"
    # kvzip at 0.5: vt ours (0.5, 0), kvpress (1, 0); cwe ours 1, kvpress 0.5
    assert lines[5] == "| kvzip | 0.5 | 0.5 | cwe | 1 | 100.0 | 50.0 | +50.0 [+50.0, +50.0] | 0.0 |"
    assert lines[7] == "| kvzip | 0.5 | 0.5 | average | 3 | 62.5 | 50.0 | +12.5 [+0.0, +25.0] | 66.7 |"
    assert bench.press_map("knorm=kvzip, none=full")["knorm"] == "kvzip"
    with pytest.raises(ValueError, match="press=method"):
        bench.press_map("knorm")


def test_method_pairs_pairs_two_methods_across_files(tmp_path, capsys):
    """bench/method_pairs.py: B - A per ratio and task on the samples both answered, from two files (a full cache
    recorded in both is no duplicate: neither method's); a method's record twice is an error."""
    bench = bench_module("method_pairs")
    uniform = "kvzip:level=pair-uniform"
    first = write_jsonl(
        tmp_path / "all.jsonl",
        [
            rec("ruler_vt", "e0", 0, "full", 1.0, 1.0),
            rec("ruler_vt", "e0", 0, "kvzip", 0.3, 1.0),
            rec("ruler_vt", "e1", 0, "kvzip", 0.3, 1.0),
            rec("ruler_cwe", "e0", 0, "kvzip", 0.3, 0.5),
            rec("ruler_cwe", "e1", 0, "kvzip", 0.3, 1.0),  # no pair-uniform record: left out
            rec("ruler_vt", "e0", 0, "kvzip", 0.1, 0.0),
        ],
    )
    second = write_jsonl(
        tmp_path / "subset.jsonl",
        [
            rec("ruler_vt", "e0", 0, "full", 1.0, 1.0),
            rec("ruler_vt", "e0", 0, uniform, 0.3, 0.0),
            rec("ruler_vt", "e1", 0, uniform, 0.3, 1.0),
            rec("ruler_cwe", "e0", 0, uniform, 0.3, 0.0),
            rec("ruler_vt", "e0", 0, uniform, 0.1, 1.0),
        ],
    )
    out = tmp_path / "levels.md"
    assert bench.main([str(first), str(second), "--a", "kvzip", "--b", uniform, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert out.read_text().strip().splitlines() == lines and len(lines) == 2 + 3 + 2
    assert lines[2] == "| 0.3 | cwe | 1 | 50.0 | 0.0 | -50.0 [-50.0, -50.0] |"
    assert lines[3] == "| 0.3 | vt | 2 | 100.0 | 50.0 | -50.0 [-100.0, +0.0] |"
    assert lines[4] == "| 0.3 | average | 3 | 75.0 | 25.0 | -50.0 [-75.0, -25.0] |"
    assert lines[6] == "| 0.1 | average | 1 | 0.0 | 100.0 | +100.0 [+100.0, +100.0] |"
    assert bench.main([str(first), "--a", "kvzip", "--b", uniform]) == 1  # nothing paired
    assert "no sample answered by both" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twice"):
        bench.main([str(first), str(first), "--a", "kvzip", "--b", uniform])
