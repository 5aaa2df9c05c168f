"""Task files: SCBench-style JSONL, one record per line, each a context with several questions and their answers.

    {"context": "...", "queries": ["...", "..."], "answers": ["...", ["...", "..."]], "metric": "inclusion"}

"questions" may stand for "queries"; an answer is a string or a list of accepted strings. Optional fields: "id",
"task", "metric" (default "inclusion"), "max_new_tokens" (default 32), "answer_prefix" (default ""), "layout" (default
"kvzip"; "kvpress" lays the prompt out as kvpress's pipeline does: base.Example). Blank lines are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvzip_jax.errors import TaskFileError
from kvzip_jax.eval.tasks.base import LAYOUTS, METRICS, Example

DEFAULT_METRIC = "inclusion"
DEFAULT_MAX_NEW_TOKENS = 32


def _strings(value, field: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings as a tuple; ValueError otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f'"{field}" must be a non-empty list')
    if not all(isinstance(item, str) and item for item in value):
        raise ValueError(f'"{field}" must hold only non-empty strings')
    return tuple(value)


def _answers(value, num_questions: int) -> tuple[tuple[str, ...], ...]:
    """The answers field: one string or list of strings per question."""
    if not isinstance(value, list) or len(value) != num_questions:
        raise ValueError(f'"answers" must be a list of {num_questions} items, one per question')
    return tuple(_strings([item] if isinstance(item, str) else item, f"answers[{i}]") for i, item in enumerate(value))


def parse_record(record, task: str, default_id: str) -> Example:
    """One Example from a decoded JSON record; ValueError naming the bad field."""
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    context = record.get("context")
    if not isinstance(context, str) or not context.strip():
        raise ValueError('"context" must be a non-empty string')
    if ("queries" in record) == ("questions" in record):
        raise ValueError('give exactly one of "queries" and "questions"')
    questions = _strings(record.get("queries", record.get("questions")), "queries")
    answers = _answers(record.get("answers"), len(questions))
    metric = record.get("metric", DEFAULT_METRIC)
    if metric not in METRICS:
        raise ValueError(f'"metric" must be one of {METRICS}, got {metric!r}')
    max_new_tokens = record.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f'"max_new_tokens" must be a positive integer, got {max_new_tokens!r}')
    answer_prefix = record.get("answer_prefix", "")
    if not isinstance(answer_prefix, str):
        raise ValueError(f'"answer_prefix" must be a string, got {answer_prefix!r}')
    layout = record.get("layout", "kvzip")
    if layout not in LAYOUTS:
        raise ValueError(f'"layout" must be one of {LAYOUTS}, got {layout!r}')
    record_task, record_id = record.get("task", task), record.get("id", default_id)
    if not isinstance(record_task, str) or not isinstance(record_id, str) or not record_task or not record_id:
        raise ValueError('"task" and "id" must be non-empty strings')
    return Example(record_task, record_id, context, questions, answers, metric, max_new_tokens, answer_prefix, layout)


def load_jsonl(path: str | Path, task: str | None = None) -> list[Example]:
    """The examples of a JSONL task file, in file order. task defaults to the file's stem; an id defaults to
    f"{task}-{n}", n counting records from 0. TaskFileError (file and line number) on any bad record."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise TaskFileError(f"cannot read task file {path}: {error}") from error
    task = task or path.stem
    examples: list[Example] = []
    seen_ids: set[str] = set()
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            example = parse_record(json.loads(line), task, f"{task}-{len(examples)}")
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            raise TaskFileError(f"{path}:{line_number}: {error}") from error
        if example.id in seen_ids:
            raise TaskFileError(f"{path}:{line_number}: duplicate id {example.id!r}")
        seen_ids.add(example.id)
        examples.append(example)
    if not examples:
        raise TaskFileError(f"task file {path} holds no records")
    return examples
