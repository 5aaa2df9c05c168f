"""Needles that each give a label a distinct number, one per stratum of depth, and a question per label: the shape of
the passkey and multi_needle tasks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example


def example(
    rng: np.random.Generator,
    task: str,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int],
    labels: Sequence[str],
    digits: int,
    needle: str,
    question: str,
    max_new_tokens: int,
) -> Example:
    """A haystack of about context_tokens tokens holding needle.format(label=, number=) for every label, each with a
    distinct number of `digits` digits, one needle per stratum of depth in the order of labels; a question
    question.format(label=) per label, answered by its number."""
    numbers = [str(number) for number in words.distinct_numbers(rng, digits, len(labels))]
    needles = [needle.format(label=label, number=number) for label, number in zip(labels, numbers)]
    context = haystack.plant(rng, needles, context_tokens, count_tokens)
    questions = tuple(question.format(label=label) for label in labels)
    return Example(
        task, example_id, context, questions, tuple((number,) for number in numbers), "inclusion", max_new_tokens
    )
