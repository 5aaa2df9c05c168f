"""Datasets in kvpress's format: rows with the columns kvpress's evaluation reads, from a parquet or JSONL file, or
from the hub through `datasets`; and Examples written as such rows.

    data = read("ruler_4096.parquet")        # or "ruler.jsonl"; or the hub's "simonjegou/ruler:4096" when online
    check_fits(data, tokenizer, model.cfg.max_position, instruction)
    write(examples, "ruler_4096.jsonl")      # or .parquet; read(...) gives the examples back

Columns: context, question, answer_prefix (strings; answer_prefix may be ""), answer (a string or a list of strings,
every one accepted), max_new_tokens (an integer >= 1); task where present (default: the file's stem, a hub
dataset's name); metric where present (one of base.METRICS; default string_match_part for RULER's qa tasks and
string_match_all otherwise, as kvpress scores RULER); id where present (a non-empty string). Rows are numbered from
0 in file order; blank JSONL lines are not rows. Texts are kept as they are (not stripped); an empty or blank context
or question is refused.

Rows of one task, one context and one id (or none) become one Example asking their questions in row order, so they
share one compressed cache (the reuse protocol), as kvpress groups them: its id the rows' id, else
f"{task}-{first row}", its max_new_tokens the first row's (as kvpress takes it), its layout "kvpress" (laid out by
prompts.kvpress_split: the model gets kvpress's token ids); rows of one context must agree on answer_prefix and
metric.

write(examples, path) writes one row per question (kvpress's columns, task, metric and the example's id), to a
".jsonl" or ".parquet" file, atomically (a temporary file in the same folder, renamed into place).

A path that does not exist, unless it ends in a file suffix, is a hub name "owner/name[:data_dir]" (split "test", as
kvpress loads it), fetched through `datasets` where installed and online. Parquet is read with pyarrow, else with
`datasets`. Every failure is a DatasetFileError naming the file and the row; check_fits raises ContextTooLongError.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvzip_jax.errors import ContextTooLongError, DatasetFileError
from kvzip_jax.eval.batches import laid_out
from kvzip_jax.eval.tasks.base import METRICS, Example

COLUMNS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")  # kvpress's; task optional
FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
WRITE_SUFFIXES = (".jsonl", ".parquet")
HUB_SPLIT = "test"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A kvpress-format dataset as Examples: examples[i] asks the questions of rows[i] (row numbers, in order)."""

    source: str
    examples: tuple[Example, ...]
    rows: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row's fields, checked."""

    task: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str
    id: str | None = None


def default_metric(task: str) -> str:
    """kvpress's RULER scoring: string_match_part for the qa tasks (qa_1, qa_2), string_match_all for the others."""
    return "string_match_part" if task.removeprefix("ruler_").startswith("qa_") else "string_match_all"


def read(source: str | Path, task: str | None = None) -> Dataset:
    """The dataset of a parquet or JSONL file, or of a hub name (module docstring). task: the default task name
    (default the file's stem, the hub dataset's name). DatasetFileError on anything missing or malformed."""
    path = Path(source)
    if path.is_dir():
        raise DatasetFileError(f"{path} is a folder; give one parquet or JSONL file")
    if path.exists():
        records = parquet_records(path) if path.suffix == ".parquet" else jsonl_records(path)
        return grouped(records, task or path.stem, str(path))
    if path.suffix in FILE_SUFFIXES:
        raise DatasetFileError(f"no dataset file {path}")
    name = str(source)
    return grouped(hub_records(name), task or name.partition(":")[0].rpartition("/")[2], name)


def jsonl_records(path: Path) -> list:
    """The decoded lines of a JSONL file, blank lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetFileError(f"cannot read {path}: {error}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as error:
                raise DatasetFileError(f"{path} line {number} (row {len(records)}): not JSON ({error})") from None
    return records


def parquet_records(path: Path) -> list:
    """The rows of a parquet file as dicts, read with pyarrow, else with `datasets`."""
    try:
        from pyarrow import parquet
    except ImportError:
        parquet = None
    try:
        if parquet is not None:
            return parquet.read_table(path).to_pylist()
        try:
            import datasets
        except ImportError:
            raise DatasetFileError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow) or datasets (pip install datasets); "
                "or give the rows as JSONL"
            ) from None
        return [dict(row) for row in datasets.Dataset.from_parquet(str(path))]
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetFileError(f"cannot read {path} as parquet: {_one_line(error)}") from None


def hub_records(name: str) -> list:
    """The "test" split of the hub dataset "owner/name[:data_dir]" as dicts, through `datasets`."""
    try:
        import datasets
    except ImportError:
        raise DatasetFileError(
            f"no dataset file {name}; reading it from the hub needs `datasets` (pip install datasets) and a network"
        ) from None
    repo, _, data_dir = name.partition(":")
    try:
        rows = datasets.load_dataset(repo, data_dir=data_dir or None, split=HUB_SPLIT)
    except Exception as error:  # datasets raises many kinds (connection, offline mode, not found)
        raise DatasetFileError(
            f"no dataset file {name}, and `datasets` could not fetch it from the hub (offline?): "
            f"{type(error).__name__}: {_one_line(error)}"
        ) from None
    return [dict(row) for row in rows]


def checked_row(record, task: str, where: str) -> Row:
    """One record's fields; DatasetFileError prefixed by where (file and row) on the first bad one."""

    def bad(what: str):
        return DatasetFileError(f"{where}: {what}")

    if not isinstance(record, dict):
        raise bad("a row must be an object of columns")
    missing = [column for column in COLUMNS if column not in record]
    if missing:
        raise bad(f"missing column(s) {', '.join(missing)} (kvpress's format has {', '.join(COLUMNS)})")
    text = {column: record[column] for column in ("context", "question", "answer_prefix")}
    for column, value in text.items():
        if not isinstance(value, str):
            raise bad(f"{column} must be a string, got {value!r:.40}")
        if column != "answer_prefix" and not value.strip():
            raise bad(f"empty {column}")
    answer = record["answer"]
    answers = (answer,) if isinstance(answer, str) else tuple(answer) if isinstance(answer, (list, tuple)) else ()
    if not answers or not all(isinstance(a, str) and a for a in answers):
        raise bad(f"answer must be a non-empty string or list of them, got {answer!r:.60}")
    max_new_tokens = record["max_new_tokens"]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise bad(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    row_task = record.get("task", task)
    if not isinstance(row_task, str) or not row_task:
        raise bad(f"task must be a non-empty string, got {row_task!r}")
    metric = record.get("metric", default_metric(row_task))
    if metric not in METRICS:
        raise bad(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    row_id = record.get("id")
    if row_id is not None and (not isinstance(row_id, str) or not row_id):
        raise bad(f"id must be a non-empty string, got {row_id!r}")
    fields = (text["context"], text["question"], text["answer_prefix"], answers, int(max_new_tokens), metric, row_id)
    return Row(row_task, *fields)


def grouped(records: list, task: str, source: str) -> Dataset:
    """The checked rows, those of one task, context and id joined into one Example (module docstring)."""
    if not records:
        raise DatasetFileError(f"{source} holds no rows")
    groups: dict[tuple[str, str, str | None], list[tuple[int, Row]]] = {}
    for index, record in enumerate(records):
        row = checked_row(record, task, f"{source} row {index}")
        groups.setdefault((row.task, row.context, row.id), []).append((index, row))
    examples, rows = [], []
    for members in groups.values():
        first_index, first = members[0]
        for index, row in members[1:]:
            for field in ("answer_prefix", "metric"):
                if getattr(row, field) != getattr(first, field):
                    raise DatasetFileError(
                        f"{source} row {index}: its {field} differs from row {first_index}'s, which has the same "
                        f"task and context (one context is asked with one {field})"
                    )
        examples.append(
            Example(
                first.task,
                first.id or f"{first.task}-{first_index}",
                first.context,
                tuple(row.question for _, row in members),
                tuple(row.answers for _, row in members),
                first.metric,
                first.max_new_tokens,
                first.answer_prefix,
                layout="kvpress",
            )
        )
        rows.append(tuple(index for index, _ in members))
    return Dataset(source, tuple(examples), tuple(rows))


def check_fits(data: Dataset, tokenizer, max_position: int, instruction: str | None = None) -> None:
    """ContextTooLongError naming the first row whose prompt, laid out as the sweep lays it out (batches.laid_out
    with instruction), plus its max_new_tokens passes max_position."""
    for example, rows in zip(data.examples, data.rows):
        context, suffixes = laid_out(tokenizer, example, instruction)
        for row, suffix in zip(rows, suffixes):
            length = len(context) + len(suffix)
            if length + example.max_new_tokens > max_position:
                raise ContextTooLongError(
                    f"{data.source} row {row}: its prompt ({length} tokens) and up to {example.max_new_tokens} new "
                    f"tokens pass the model's {max_position} positions"
                )


def rows_of(examples: Sequence[Example]) -> list[dict]:
    """kvpress-format rows of examples, one per question in order: context, question, answer_prefix, answer (a list),
    max_new_tokens, task, metric, id (the example's)."""
    return [
        dict(
            context=ex.context,
            question=question,
            answer_prefix=ex.answer_prefix,
            answer=list(answers),
            max_new_tokens=ex.max_new_tokens,
            task=ex.task,
            metric=ex.metric,
            id=ex.id,
        )
        for ex in examples
        for question, answers in zip(ex.questions, ex.answers)
    ]


def write(examples: Sequence[Example], path: str | Path) -> Path:
    """Writes examples' rows (rows_of) to a ".jsonl" or ".parquet" (pyarrow) file, atomically: a temporary file in
    the same folder, renamed into place; nothing is left at path or beside it on an error. Every row is checked as
    read checks it first. Returns the path; DatasetFileError on an unknown suffix, no examples, a row read would
    refuse, or a failed write."""
    path = Path(path)
    if path.suffix not in WRITE_SUFFIXES:
        raise DatasetFileError(f"{path}: a dataset is written as {' or '.join(WRITE_SUFFIXES)}")
    rows = rows_of(examples)
    if not rows:
        raise DatasetFileError(f"{path}: no examples to write")
    for index, row in enumerate(rows):
        checked_row(row, row["task"], f"{path} row {index}")
    if path.suffix == ".parquet":
        try:
            import pyarrow
            from pyarrow import parquet
        except ImportError:
            raise DatasetFileError(
                f"{path}: writing parquet needs pyarrow (pip install pyarrow); or write JSONL"
            ) from None
    temporary = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".parquet":
            parquet.write_table(pyarrow.Table.from_pylist(rows), temporary)
        else:
            temporary.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        os.replace(temporary, path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetFileError(f"cannot write {path}: {_one_line(error)}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:300]
