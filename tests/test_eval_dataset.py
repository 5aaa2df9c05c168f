"""Datasets in kvpress's format (kvzip_jax.eval.tasks.dataset): JSONL and parquet read back, rows of one task and
context joined into one Example laid out as kvpress lays it out, every bad file refused with a named error naming its
row, a hub name refused offline, examples written and read back; `kvzip-jax eval --dataset`, `--tasks ruler_vt` and
`--write-dataset` end to end on a tiny random model (SmolLM2's tokenizer)."""

import dataclasses
import hashlib
import itertools
import json
import os
import sys
import types
from pathlib import Path

import pytest

from kvzip_jax import cli, prompts
from kvzip_jax.cli import eval as cli_eval
from kvzip_jax.errors import ContextTooLongError, DatasetFileError, TaskFileError
from kvzip_jax.eval import batches, sweep, tasks
from kvzip_jax.eval.tasks import Example, dataset
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer

CODE = "Alpha bravo charlie. The code is 4417. Delta echo foxtrot."
KEY = "Golf hotel india. The key is 2290. Juliet kilo lima."
ROWS = [
    dict(task="niah", context=CODE, question="What is the code?", answer_prefix="The code is", answer=["4417"],
         max_new_tokens=8),
    dict(task="qa_1", context=KEY, question="What is the key?", answer_prefix="", answer=["2290", "twenty-two ninety"],
         max_new_tokens=4),
    dict(task="niah", context=CODE, question="Which word opens the text?", answer_prefix="The code is",
         answer="Alpha", max_new_tokens=8),
    dict(task="vt", context=CODE, question="Which code?", answer_prefix="Answer:", answer=["4417"], max_new_tokens=6),
]  # fmt: skip


def write_jsonl(path, rows, blank_lines=False):
    lines = [json.dumps(row) for row in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def check_read(data):
    """ROWS as read: rows 0 and 2 (one task, one context) one Example; the same context in another task its own."""
    assert [ex.id for ex in data.examples] == ["niah-0", "qa_1-1", "vt-3"]
    assert data.rows == ((0, 2), (1,), (3,))
    niah, qa, vt = data.examples
    assert niah.questions == ("What is the code?", "Which word opens the text?")
    assert niah.answers == (("4417",), ("Alpha",)) and niah.answer_prefix == "The code is"
    assert niah.max_new_tokens == 8 and niah.metric == "string_match_all" and niah.context == CODE
    assert qa.answers == (("2290", "twenty-two ninety"),) and qa.answer_prefix == "" and qa.max_new_tokens == 4
    assert qa.metric == "string_match_part"  # kvpress scores RULER's qa tasks by string_match_part
    assert vt.context == CODE and vt.answer_prefix == "Answer:"
    assert {ex.layout for ex in data.examples} == {"kvpress"}


def test_a_jsonl_file_reads_back_with_the_rows_of_one_context_as_one_example(tmp_path):
    path = write_jsonl(tmp_path / "ruler.jsonl", ROWS, blank_lines=True)
    data = dataset.read(path)
    assert data.source == str(path)
    check_read(data)


def test_the_task_defaults_to_the_files_stem_and_a_metric_column_is_kept(tmp_path):
    rows = [{k: v for k, v in row.items() if k != "task"} | {"metric": "inclusion"} for row in ROWS[:2]]
    data = dataset.read(write_jsonl(tmp_path / "mine.jsonl", rows))
    assert [(ex.task, ex.id, ex.metric) for ex in data.examples] == [
        ("mine", "mine-0", "inclusion"),
        ("mine", "mine-1", "inclusion"),
    ]


def test_a_parquet_file_reads_back(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    from pyarrow import parquet

    rows = [row | {"answer": [row["answer"]] if isinstance(row["answer"], str) else row["answer"]} for row in ROWS]
    path = tmp_path / "ruler.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    check_read(dataset.read(path))


def test_parquet_is_read_by_pyarrow_or_needs_it(tmp_path, monkeypatch):
    path = tmp_path / "ruler.parquet"
    path.write_bytes(b"PAR1")
    table = types.SimpleNamespace(to_pylist=lambda: ROWS)
    fake = types.ModuleType("pyarrow")
    fake.parquet = types.SimpleNamespace(read_table=lambda p: table if p == path else pytest.fail(str(p)))
    monkeypatch.setitem(sys.modules, "pyarrow", fake)
    check_read(dataset.read(path))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # neither pyarrow nor datasets installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetFileError, match=r"reading parquet needs pyarrow \(pip install pyarrow\)"):
        dataset.read(path)


def _with(row: dict, **changes) -> dict:
    return {k: v for k, v in (row | changes).items() if v is not _with}


@pytest.mark.parametrize(
    "row, fragment",
    [
        (_with(ROWS[2], answer_prefix=_with, answer=_with), "row 2: missing column(s) answer_prefix, answer"),
        (_with(ROWS[2], context="  \n"), "row 2: empty context"),
        (_with(ROWS[2], question=""), "row 2: empty question"),
        (_with(ROWS[2], answer_prefix=None), "row 2: answer_prefix must be a string"),
        (_with(ROWS[2], answer=[]), "row 2: answer must be a non-empty string or list"),
        (_with(ROWS[2], answer=["4417", ""]), "row 2: answer must be"),
        (_with(ROWS[2], answer=4417), "row 2: answer must be"),
        (_with(ROWS[2], max_new_tokens=0), "row 2: max_new_tokens must be an integer >= 1, got 0"),
        (_with(ROWS[2], max_new_tokens="8"), "row 2: max_new_tokens must be an integer >= 1, got '8'"),
        (_with(ROWS[2], max_new_tokens=True), "row 2: max_new_tokens must be"),
        (_with(ROWS[2], max_new_tokens=2.5), "row 2: max_new_tokens must be"),
        (_with(ROWS[2], task=""), "row 2: task must be a non-empty string"),
        (_with(ROWS[2], metric="bleu"), "row 2: metric must be one of"),
        (_with(ROWS[2], answer_prefix="Answer:"), "row 2: its answer_prefix differs from row 0's"),
        (_with(ROWS[2], metric="inclusion"), "row 2: its metric differs from row 0's"),
        (["a", "list"], "row 2: a row must be an object"),
    ],
)
def test_a_bad_row_is_refused_naming_it(tmp_path, row, fragment):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], row])
    with pytest.raises(DatasetFileError) as error:
        dataset.read(path)
    assert f"{path} {fragment}" in str(error.value)
    assert isinstance(error.value, TaskFileError)


def test_a_file_that_is_not_jsonl_or_holds_no_rows_is_refused(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{not json\n")
    with pytest.raises(DatasetFileError, match=r"bad.jsonl line 3 \(row 1\): not JSON"):
        dataset.read(path)
    path.write_text("\n")
    with pytest.raises(DatasetFileError, match="holds no rows"):
        dataset.read(path)
    with pytest.raises(DatasetFileError, match="is a folder"):
        dataset.read(tmp_path)
    with pytest.raises(DatasetFileError, match="no dataset file"):
        dataset.read(tmp_path / "absent.parquet")


def test_a_hub_name_needs_datasets_and_a_network(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetFileError, match=r"needs `datasets` \(pip install datasets\) and a network"):
        dataset.read("simonjegou/ruler:4096")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'simonjegou/ruler' on the Hub\n(LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DatasetFileError, match=r"could not fetch it from the hub \(offline\?\): ConnectionError"):
        dataset.read("simonjegou/ruler:4096")


def test_a_hub_dataset_is_read_as_kvpress_loads_it(monkeypatch):
    calls = []

    def load_dataset(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return [{k: v for k, v in row.items() if k != "task"} for row in ROWS[:3]]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    data = dataset.read("simonjegou/ruler:4096")
    assert calls == [("simonjegou/ruler", "4096", "test")]
    assert data.source == "simonjegou/ruler:4096" and data.rows == ((0, 2), (1,))
    assert [ex.id for ex in data.examples] == ["ruler-0", "ruler-1"]


@pytest.fixture(scope="module")
def tokenizer():
    return bundled_tokenizer(registry.SMOLLM2)


def test_a_prompt_past_the_models_length_is_refused_naming_its_row(tmp_path, tokenizer):
    rows = [ROWS[1], _with(ROWS[0], context=CODE + " Mike." * 50), ROWS[2]]
    data = dataset.read(write_jsonl(tmp_path / "long.jsonl", rows))
    context, (suffix,) = prompts.kvpress_split(tokenizer, rows[1]["context"], [rows[1]["question"]],
                                               rows[1]["answer_prefix"])  # fmt: skip
    need = len(context) + len(suffix) + rows[1]["max_new_tokens"]  # row 1's prompt as the sweep lays it out
    dataset.check_fits(data, tokenizer, need)
    with pytest.raises(ContextTooLongError, match=rf"long.jsonl row 1: its prompt \({need - 8} tokens\) and up to 8"):
        dataset.check_fits(data, tokenizer, need - 1)


def test_texts_are_kept_unstripped_and_a_blank_one_refused(tmp_path):
    row = _with(ROWS[0], context="  " + CODE + "\n", question=" What is the code?\n", answer_prefix=" The code is ")
    (example,) = dataset.read(write_jsonl(tmp_path / "padded.jsonl", [row])).examples
    assert (example.context, example.questions, example.answer_prefix) == (
        row["context"],
        (row["question"],),
        row["answer_prefix"],
    )
    for column in ("context", "question"):
        with pytest.raises(DatasetFileError, match=f"row 0: empty {column}"):
            dataset.read(write_jsonl(tmp_path / "blank.jsonl", [_with(row, **{column: " \n\t"})]))


def test_an_example_layout_is_kvzip_or_kvpress():
    assert Example("t", "t-0", "c", ("q",), (("a",),)).layout == "kvzip"
    with pytest.raises(ValueError, match=r"layout must be one of \('kvzip', 'kvpress'\), got 'ruler'"):
        Example("t", "t-0", "c", ("q",), (("a",),), layout="ruler")


def test_prepare_lays_each_example_out_as_its_layout_says(tmp_path, tokenizer):
    kvpress = list(dataset.read(write_jsonl(tmp_path / "ruler.jsonl", ROWS)).examples)
    kvzip = [dataclasses.replace(ex, id=ex.id + "-kvzip", layout="kvzip") for ex in kvpress]
    instruction, firsts = prompts.KVZIP_INSTRUCTION, {}
    for ex, context, suffixes in batches.prepare(tokenizer, kvpress + kvzip, instruction):
        questions = list(ex.questions)
        if ex.layout == "kvpress":
            expected = prompts.kvpress_split(tokenizer, ex.context, questions, ex.answer_prefix, instruction)
        else:
            expected = prompts.split_for_reuse(
                tokenizer, ex.context, questions, instruction=instruction, answer_prefix=ex.answer_prefix
            )
        assert context == expected[0] and [s.tolist() for s in suffixes] == [s.tolist() for s in expected[1]]
        firsts[ex.id] = suffixes[0].tolist()
    assert firsts["niah-0"] != firsts["niah-0-kvzip"]  # kvpress's has no "\n\n" before the question


def test_example_hash_names_the_layout_only_when_it_is_not_kvzip(tmp_path):
    kvpress = dataset.read(write_jsonl(tmp_path / "ruler.jsonl", ROWS)).examples[0]
    kvzip = dataclasses.replace(kvpress, layout="kvzip")
    fields = [kvzip.context, list(kvzip.questions), [list(a) for a in kvzip.answers], kvzip.metric, 8]
    old = hashlib.sha256(json.dumps(fields + [kvzip.answer_prefix]).encode()).hexdigest()[:16]  # before layouts
    assert batches.example_hash(kvzip) == old != batches.example_hash(kvpress)


def examples_to_write(tokenizer) -> list[Example]:
    """ROWS' examples, a RULER sample and one of the package's own tasks (layout kvzip, metric inclusion)."""
    own = tasks.generate("passkey", 1, 0, 300)
    return [*dataset.grouped(ROWS, "ruler", "ROWS").examples, *tasks.generate("ruler_vt", 1, 42, 1024, tokenizer), *own]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_written_examples_read_back_as_they_were(tmp_path, tokenizer, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    examples = examples_to_write(tokenizer)
    assert examples[-1].layout == "kvzip" and examples[-1].metric == "inclusion"
    path = dataset.write(examples, tmp_path / f"out{suffix}")
    assert path == tmp_path / f"out{suffix}" and [p.name for p in tmp_path.iterdir()] == [path.name]
    data = dataset.read(path)
    assert list(data.examples) == [dataclasses.replace(ex, layout="kvpress") for ex in examples]  # ids kept
    ends = list(itertools.accumulate(len(ex.questions) for ex in examples))
    assert data.rows == tuple(tuple(range(end - len(ex.questions), end)) for ex, end in zip(examples, ends))
    assert dataset.rows_of(examples[:1]) == [
        dict(context=CODE, question=row["question"], answer_prefix=row["answer_prefix"],
             answer=[row["answer"]] if isinstance(row["answer"], str) else row["answer"],
             max_new_tokens=8, task="niah", metric="string_match_all", id="niah-0")
        for row in (ROWS[0], ROWS[2])
    ]  # fmt: skip


def test_a_write_is_atomic(tmp_path, tokenizer, monkeypatch):
    examples = examples_to_write(tokenizer)
    path = dataset.write(examples[:1], tmp_path / "out.jsonl")
    before = path.read_bytes()
    bad = dataclasses.replace(examples[1], answers=(("2290", ""),))
    with pytest.raises(DatasetFileError, match=r"out.jsonl row 2: answer must be"):
        dataset.write([examples[0], bad], path)

    def failing(source, target):
        assert Path(source).read_text().count("\n") == sum(len(ex.questions) for ex in examples)  # written whole
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(DatasetFileError, match="cannot write .*out.jsonl: .*No space left on device"):
        dataset.write(examples, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    with pytest.raises(DatasetFileError, match=r"written as .jsonl or .parquet"):
        dataset.write(examples, tmp_path / "out.csv")
    with pytest.raises(DatasetFileError, match="no examples to write"):
        dataset.write([], tmp_path / "none.jsonl")
    pyarrow = pytest.importorskip("pyarrow")
    from pyarrow import parquet

    def half_written(table, where):
        Path(where).write_bytes(b"PAR1 half")
        raise pyarrow.ArrowInvalid("cannot write the table")

    monkeypatch.setattr(parquet, "write_table", half_written)
    with pytest.raises(DatasetFileError, match="cannot write .*out.parquet: cannot write the table"):
        dataset.write(examples, tmp_path / "out.parquet")
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


# The CLI on a tiny random model.


@pytest.fixture
def tiny(monkeypatch, tokenizer):
    from tests.test_eval_sweep import tiny_model

    model = tiny_model(tokenizer)
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": model)
    return model


SWEEP = ["--methods", "streamingllm", "--ratios", "0.5", "--batch-size", "2", "--no-progress", "--instruction", "none"]


def test_eval_sweeps_a_dataset_sharing_one_cache_per_context(tiny, tmp_path, capsys):
    path = write_jsonl(tmp_path / "ruler.jsonl", [ROWS[0], _with(ROWS[1], task="niah"), ROWS[2]])  # one task: quick
    out = tmp_path / "run"
    assert cli.main(["eval", "--model", "tiny", "--dataset", str(path), *SWEEP, "--out", str(out)]) == 0
    assert "sweep: 2 contexts, 3 questions" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2  # 3 questions x (full, streamingllm at 0.5)
    asked = {(r["example"], r["question"], r["method"]) for r in records}
    assert asked == {
        (ex, q, m) for ex, q in (("niah-0", 0), ("niah-0", 1), ("niah-1", 0)) for m in SWEEP[1:2] + ["full"]
    }


def test_eval_refuses_a_bad_dataset_before_loading_the_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], _with(ROWS[1], max_new_tokens=-1)])
    assert cli.main(["eval", "--model", "tiny", "--dataset", str(path)]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} row 1: max_new_tokens must be" in err
    assert cli.main(["eval", "--model", "tiny", "--dataset", "owner/absent"]) == cli.EXIT_USER_ERROR
    assert "no dataset file owner/absent" in capsys.readouterr().err


def test_eval_refuses_a_context_past_the_models_length_naming_its_row(tiny, monkeypatch, tmp_path, capsys):
    short = dataclasses.replace(tiny, cfg=dataclasses.replace(tiny.cfg, max_position=80))
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": short)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    path = write_jsonl(tmp_path / "long.jsonl", [ROWS[1], _with(ROWS[0], context=CODE + " Mike." * 30)])
    assert cli.main(["eval", "--model", "tiny", "--dataset", str(path), *SWEEP]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} row 1: its prompt (" in err and "model's 80 positions" in err


def test_tasks_ruler_stands_for_every_offline_ruler_task_and_the_default_stays_the_packages_own():
    assert cli_eval.task_names("ruler", False) == list(tasks.ruler.OFFLINE)  # not the QA tasks, which need data
    assert cli_eval.task_names("ruler,ruler_qa_1", False) == [*tasks.ruler.OFFLINE, "ruler_qa_1"]
    assert cli_eval.task_names("passkey,ruler_vt", False) == ["passkey", "ruler_vt"]
    assert cli_eval.task_names(None, False) == list(tasks.TASKS) and cli_eval.task_names(None, True) == []


class _Swept(Exception):
    pass


@pytest.mark.parametrize("seed, ruler_seed, own_seed", [(None, 42, 0), (7, 7, 7)])
def test_ruler_examples_use_the_models_tokenizer_and_ruler_seed_unless_told(
    tiny, monkeypatch, seed, ruler_seed, own_seed
):
    seen = {}

    def run_sweep(model, examples, config, path, **kwargs):
        seen.update(examples=examples, config=config)
        raise _Swept

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    argv = ["eval", "--model", "tiny", "--tasks", "ruler_vt,passkey", "--contexts", "1", "--context-tokens", "1024"]
    with pytest.raises(_Swept):
        cli.main(argv + ([] if seed is None else ["--seed", str(seed)]))
    (passkey,), (vt,) = [[ex for ex in seen["examples"] if ex.task == task] for task in ("passkey", "ruler_vt")]
    assert vt.id == f"ruler_vt-{ruler_seed}-0" and passkey.id == f"passkey-{own_seed}-0"
    assert seen["config"].seed == own_seed  # the random baseline's, as before
    assert vt == tasks.generate("ruler_vt", 1, ruler_seed, 1024, tiny.tokenizer)[0]


def test_eval_answers_a_ruler_task_on_the_tiny_model(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", "--model", "tiny", "--tasks", "ruler_vt", "--contexts", "1", "--context-tokens", "1024"]
    assert cli.main([*argv, *SWEEP, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["example"]) for r in records} == {("ruler_vt", "ruler_vt-42-0")} and len(records) == 2
    assert "| ruler_vt | streamingllm | reuse |" in capsys.readouterr().out


def test_a_ruler_length_too_short_or_past_the_model_is_a_usage_error(tiny, capsys):
    for tokens, fragment in (("200", "--tasks ruler_vt at --context-tokens 200: no sample fits"), ("4096", "passes")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["eval", "--model", "tiny", "--tasks", "ruler_vt", "--context-tokens", tokens])
        assert exit_info.value.code == cli.EXIT_USER_ERROR
        assert fragment in capsys.readouterr().err


def test_write_dataset_writes_the_examples_and_runs_no_sweep(tiny, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    source = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    path = tmp_path / "out" / "written.parquet"
    argv = ["eval", "--model", "tiny", "--tasks", "ruler_vt,passkey", "--contexts", "1", "--context-tokens", "1024"]
    assert cli.main([*argv, "--dataset", str(source), "--write-dataset", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}: 9 rows, 5 contexts, 5 tasks (niah, passkey, qa_1, ruler_vt, vt); no sweep" in out
    expected = [
        *dataset.read(source).examples,
        *tasks.generate("passkey", 1, 0, 1024),
        *tasks.generate("ruler_vt", 1, 42, 1024, tiny.tokenizer),
    ]
    assert list(dataset.read(path).examples) == [dataclasses.replace(ex, layout="kvpress") for ex in expected]


def test_write_dataset_needs_a_model_only_for_rulers_tasks(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    path = tmp_path / "passkey.jsonl"
    argv = ["eval", "--tasks", "passkey", "--contexts", "2", "--questions-per-context", "1", "--write-dataset"]
    assert cli.main([*argv, str(path)]) == 0
    assert [ex.questions for ex in dataset.read(path).examples] == [
        ex.questions[:1] for ex in tasks.generate("passkey", 2, 0, 1000)
    ]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--tasks", "ruler_vt", "--write-dataset", str(path)])
    assert exit_info.value.code == cli.EXIT_USER_ERROR
    assert "--write-dataset with RULER's tasks needs --model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--tasks", "passkey"])
    assert "--model is required (unless --merge or --write-dataset)" in capsys.readouterr().err
