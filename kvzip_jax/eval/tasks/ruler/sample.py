"""A generated RULER sample (its whole prompt, answers, haystack size) and its Example: the prompt cut into context
(instructions, haystack, few-shot example: what is compressed), question and answer prefix."""

from __future__ import annotations

import dataclasses

from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.eval.tasks.ruler.templates import Family, split


@dataclasses.dataclass(frozen=True)
class Sample:
    """text: the whole prompt, answer prefix included (RULER's input under the base template); answers: the
    references (RULER's outputs); size: the haystack size drawn (lines, words or sentences' words, per task)."""

    text: str
    answers: tuple[str, ...]
    size: int


def to_example(sample: Sample, family: Family, task: str, example_id: str) -> Example:
    """One question: context + question + answer_prefix == sample.text, none stripped; the family's metric
    (string_match_all; QA's string_match_part); layout "kvpress" (laid out as kvpress's pipeline lays it out:
    prompts.kvpress_split)."""
    context, question, answer_prefix = split(sample.text, family)
    return Example(
        task,
        example_id,
        context,
        (question,),
        (sample.answers,),
        family.metric,
        family.max_new_tokens,
        answer_prefix,
        layout="kvpress",
    )


def base_prompt(example: Example, question: int = 0) -> str:
    """The prompt without a chat template: context, question and answer prefix concatenated (RULER's input)."""
    return example.context + example.questions[question] + example.answer_prefix
