"""Sweep report and statistics: summary values by hand on synthetic records, JSONL reading, markdown, CSV and PNG
outputs."""

import csv
import json

import pytest

from kvzip_jax import kv_bits
from kvzip_jax.eval import report, statistics
from tests.conftest import sweep_record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def rec(task, example, question, method, mode, ratio, score, agree=True, kl=0.0, flip=0.0):
    return sweep_record(task, example, question, method, mode, ratio, score, agree=agree, kl=kl, flip=flip)


def full(task, example, question, score):
    return rec(task, example, question, "full", "full", 1.0, score)


QUESTIONS = [("e0", 0), ("e0", 1), ("e1", 0), ("e1", 1)]


@pytest.fixture
def records():
    rs = [full("squad", e, q, s) for (e, q), s in zip(QUESTIONS, [1.0, 1.0, 0.0, 1.0])]
    rs += [
        rec("squad", e, q, "kvzip", "reuse", 0.5, s, agree=a, kl=k, flip=f)
        for (e, q), s, a, k, f in zip(
            QUESTIONS, [1.0, 0.0, 0.0, 1.0], [True, False, True, True], [0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.25, 0.25]
        )
    ]
    # an interrupted sweep: only the first example at ratio 0.3 (ratio written as 0.1 * 3)
    rs += [rec("squad", "e0", q, "kvzip", "reuse", 0.1 * 3, s, agree=False) for q, s in [(0, 1.0), (1, 0.0)]]
    rs += [rec("squad", e, q, "snapkv", "first", 0.5, 0.5) for e, q in QUESTIONS]
    rs += [full("niah", "n0", 0, 0.0), rec("niah", "n0", 0, "kvzip", "oracle", 0.5, 0.0)]
    return rs


def by_key(rows):
    return {(r["task"], r["method"], r["mode"], r["ratio"]): r for r in rows}


def test_summarize_by_hand(records):
    rows = statistics.summarize(records)
    assert [tuple(r) for r in rows] == [statistics.COLUMNS] * len(rows)
    assert [(r["task"], r["method"], r["mode"], r["ratio"]) for r in rows] == [
        ("niah", "full", "full", 1.0),
        ("niah", "kvzip", "oracle", 0.5),
        ("squad", "full", "full", 1.0),
        ("squad", "kvzip", "reuse", 0.5),
        ("squad", "kvzip", "reuse", 0.3),
        ("squad", "snapkv", "first", 0.5),
    ]
    rows = by_key(rows)
    f = rows["squad", "full", "full", 1.0]
    assert (f["n"], f["score"], f["normalised"], f["agree"], f["kl"], f["flip"]) == (4, 0.75, 100.0, 100.0, 0.0, 0.0)
    k = rows["squad", "kvzip", "reuse", 0.5]
    assert k["n"] == 4 and k["score"] == 0.5
    assert k["normalised"] == pytest.approx(100 * 0.5 / 0.75)
    assert (k["normalised_lo"], k["normalised_hi"]) == (50.0, 100.0)
    assert k["agree"] == 75.0 and (k["agree_lo"], k["agree_hi"]) == pytest.approx(statistics.wilson(3, 4))
    assert k["kl"] == pytest.approx(0.25) and k["flip"] == pytest.approx(0.25)
    s = rows["squad", "snapkv", "first", 0.5]
    assert s["normalised"] == pytest.approx(100 * 0.5 / 0.75) and s["agree"] == 100.0


def test_intervals():
    """Wilson's interval against published values (3/4: 0.3006-0.9544, 0/10: 0-0.2775, as statsmodels'
    proportion_confint(method="wilson") gives them); the bootstrap resamples whole examples."""
    assert statistics.wilson(3, 4) == pytest.approx((30.06, 95.44), abs=0.01)
    assert statistics.wilson(0, 10) == pytest.approx((0.0, 27.75), abs=0.01)
    assert statistics.wilson(10, 10)[1] == pytest.approx(100.0)
    assert statistics.bootstrap_normalised([(1.0, 2.0), (1.0, 1.0)]) == (50.0, 100.0)  # resamples: 50, 66.7 or 100
    assert statistics.bootstrap_normalised([(1.0, 2.0)] * 5) == (50.0, 50.0)  # every example the same: no spread
    low, high = statistics.bootstrap_normalised([(s, 1.0) for s in [0.0, 1.0] * 20])
    assert 30 < low < 50 < high < 70  # 40 examples, half of them right: about 50 +- 16
    assert statistics.bootstrap_normalised([]) is None and statistics.bootstrap_normalised([(0.0, 0.0)]) is None


def test_normalised_over_the_same_questions(records):
    k = by_key(statistics.summarize(records))["squad", "kvzip", "reuse", 0.3]
    # e0's full scores are 1 and 1 (mean 1), not the task's 0.75
    assert (k["n"], k["score"], k["normalised"], k["agree"]) == (2, 0.5, 50.0, 0.0)


def test_normalised_none_when_full_is_zero(records):
    rows = by_key(statistics.summarize(records))
    assert rows["niah", "full", "full", 1.0]["normalised"] is None
    assert rows["niah", "kvzip", "oracle", 0.5]["normalised"] is None


def test_summarize_errors(records):
    with pytest.raises(ValueError, match="lacks"):
        statistics.summarize([{k: v for k, v in records[0].items() if k != "agree"}])
    with pytest.raises(ValueError, match="mode"):
        statistics.summarize([rec("squad", "e0", 0, "kvzip", "sometimes", 0.5, 1.0)])
    with pytest.raises(ValueError, match="full cache"):
        statistics.summarize([rec("squad", "e0", 0, "kvzip", "full", 0.5, 1.0)])
    with pytest.raises(ValueError, match="several models"):
        statistics.summarize(records + [{**records[0], "model": "other"}])


def write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_read_records(tmp_path, records):
    path = write_jsonl(tmp_path / "a.jsonl", records, "\n")
    assert report.read_records(path) == records
    truncated = json.dumps(records[0])[:40]
    assert report.read_records(write_jsonl(tmp_path / "b.jsonl", records, truncated)) == records
    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps(records[0]) + "\n" + truncated + "\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        report.read_records(bad)
    bad.write_text(json.dumps(records[0]) + "\n[1, 2]\n" + json.dumps(records[1]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        report.read_records(bad)


def test_markdown_table(records):
    rows = statistics.summarize(records)
    lines = report.markdown_table(rows).strip().splitlines()
    assert lines[0] == "| task | method | mode | 1.0 | 0.5 | 0.3 |"
    assert lines[1] == "|---|---|---|---:|---:|---:|"
    assert lines[2:] == [
        "| niah | full | full | 0.0 | - | - |",
        "| niah | kvzip | oracle | - | - | - |",
        "| squad | full | full | 75.0 | - | - |",
        "| squad | kvzip | reuse | - | 66.7 [50, 100] | 50.0 [50, 50] |",  # e0: 1 of 2, e1: 1 of 1
        "| squad | snapkv | first | - | 66.7 [50, 100] | - |",
    ]
    agree = report.markdown_table(rows, "agree").strip().splitlines()
    assert agree[5] == "| squad | kvzip | reuse | - | 75.0 [30, 95] | 0.0 [0, 66] |"
    kl = report.markdown_table(rows, "kl").strip().splitlines()
    assert kl[5] == "| squad | kvzip | reuse | - | 0.2500 | 0.0000 |"
    assert kl[4] == "| squad | full | full | 75.0 | - | - |"
    with pytest.raises(ValueError, match="value"):
        report.markdown_table(rows, "bleu")


def test_write_csv(tmp_path, records):
    rows = statistics.summarize(records)
    path = report.write_csv(rows, tmp_path / "s.csv")
    with path.open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(rows) and tuple(got[0]) == statistics.COLUMNS
    assert got[0]["normalised"] == "" and float(got[3]["normalised"]) == pytest.approx(200 / 3)


def test_plot_writes_png(tmp_path, records):
    path = report.plot(statistics.summarize(records), tmp_path / "p.png")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]  # no temporary file left behind
    from PIL import Image

    with Image.open(path) as image:  # a palette PNG (report.save_png), at 120 dpi: 5 x 3.8 inches per panel
        assert image.mode == "P" and image.size[0] >= 600 and len(image.getcolors()) <= 64


def test_write_report(tmp_path, records):
    paths = report.write_report(write_jsonl(tmp_path / "sweep.jsonl", records), tmp_path / "out")
    assert {k: p.name for k, p in paths.items()} == {
        "markdown": "summary.md",
        "csv": "summary.csv",
        "plot": "scores.png",
        "leaderboard": "leaderboard.csv",  # two tasks (tests/test_leaderboard.py)
    }
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "leaderboard.csv",
        "scores.png",
        "summary.csv",
        "summary.md",
    ]
    md = paths["markdown"].read_text()
    assert md.count("| task | method | mode |") == 3
    assert "| squad | kvzip | reuse | - | 66.7 [50, 100] | 50.0 [50, 50] |" in md
    assert "| squad | kvzip | reuse | - | 75.0 [30, 95] | 0.0 [0, 66] |" in md
    assert paths["plot"].read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="no records"):
        report.write_report(write_jsonl(tmp_path / "empty.jsonl", []), tmp_path / "out")


def test_kv_bits_labels_name_each_storage_and_refuse_others():
    assert [kv_bits.label(b) for b in kv_bits.KV_BITS] == ["16-bit", "int8", "int4", "k8v4"]
    assert statistics.labelled(rec("t", "e0", 0, "full", "full", 1.0, 1.0) | {"kv_bits": "8/4"})["method"] == "k8v4"
    with pytest.raises(ValueError, match="kv bits must be one of"):
        kv_bits.label(2)
