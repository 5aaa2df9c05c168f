"""A sweep's batches: examples tokenized, sorted by length, cut into batches of one task, padded to a size, and the
one cache capacity every batch runs at."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import numpy as np

from kvzip_jax import prompts
from kvzip_jax.eval.tasks.base import Example

CAPACITY_MULTIPLE = 64


def example_hash(ex: Example) -> str:
    """16 hex digits of what an example asks (context, questions, answers, metric, answer length, its answer prefix
    where it has one and its layout where it is not "kvzip": an example without keeps the hash it had before
    prefixes and layouts)."""
    fields = [ex.context, list(ex.questions), [list(a) for a in ex.answers], ex.metric, ex.max_new_tokens]
    extra = ([ex.answer_prefix] if ex.answer_prefix else []) + ([ex.layout] if ex.layout != "kvzip" else [])
    text = json.dumps(fields + extra)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def laid_out(tokenizer, ex: Example, instruction: str | None = None) -> tuple[prompts.Prompt, list[np.ndarray]]:
    """An example's [prefix | context] Prompt and per-question suffix ids (int32 [T] each), laid out as its layout
    says: prompts.kvpress_split for "kvpress", prompts.split_for_reuse for "kvzip"; instruction opens the user
    message in both, every suffix ends with the example's answer_prefix."""
    if ex.layout == "kvpress":
        return prompts.kvpress_split(tokenizer, ex.context, list(ex.questions), ex.answer_prefix, instruction)
    return prompts.split_for_reuse(
        tokenizer, ex.context, list(ex.questions), instruction=instruction, answer_prefix=ex.answer_prefix
    )


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of one batch: the real examples first, then copies of the last one up to the batch size."""

    examples: tuple[Example, ...]  # the real rows
    contexts: tuple[prompts.Prompt, ...]  # every row's [prefix | context] tokens
    suffixes: tuple[tuple[np.ndarray, ...], ...]  # per row, per question: [question | answer header | prefix] ids

    @property
    def size(self) -> int:
        return len(self.contexts)

    @property
    def max_new_tokens(self) -> int:
        return max(ex.max_new_tokens for ex in self.examples)

    @property
    def num_questions(self) -> int:
        return max(len(ex.questions) for ex in self.examples)

    def question_rows(self, i: int) -> list[np.ndarray]:
        """Suffix i of every row; rows without a question i repeat their first (answered, then ignored)."""
        return [s[i] if i < len(s) else s[0] for s in self.suffixes]


Item = tuple[Example, prompts.Prompt, tuple[np.ndarray, ...]]  # an example, its [prefix | context], its suffixes


def prepare(tokenizer, examples: Sequence[Example], instruction: str | None = None) -> list[Item]:
    """Every example tokenized as its layout says (laid_out), sorted by (task, context tokens, id): the order batches
    are cut in (groups_of). instruction: opens every user message before the context; each question's suffix ends
    with the example's answer_prefix."""
    items = []
    for ex in examples:
        context, suffixes = laid_out(tokenizer, ex, instruction)
        items.append((ex, context, tuple(suffixes)))
    return sorted(items, key=lambda item: (item[0].task, len(item[1]), item[0].id))


def groups_of(items: Sequence[Item], batch_size: int) -> list[tuple[Item, ...]]:
    """The sweep's batches before padding: batch_size items each (fewer for a task's last), one task each, cut in
    the items' order (prepare: similar lengths together). The cut does not depend on the devices, so every process
    plans the same batches."""
    by_task: dict[str, list] = {}
    for item in items:
        by_task.setdefault(item[0].task, []).append(item)
    return [
        tuple(rows[start : start + batch_size])
        for task, rows in sorted(by_task.items())
        for start in range(0, len(rows), batch_size)
    ]


def padded(group: Sequence[Item], size: int) -> Batch:
    """The batch of a group's rows, padded with copies of its last row to size rows."""
    rows = list(group) + [group[-1]] * (size - len(group))
    return Batch(tuple(ex for ex, _, _ in group), tuple(c for _, c, _ in rows), tuple(s for _, _, s in rows))


def capacity_for(items: Sequence[Item]) -> int:
    """One cache capacity for the whole sweep (one compilation, the same in every process's share): the longest
    [prefix | context] plus the longest question and the longest answer, rounded up."""
    need = max(len(c) + max(map(len, s)) for _, c, s in items) + max(ex.max_new_tokens for ex, _, _ in items)
    return -(-need // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
