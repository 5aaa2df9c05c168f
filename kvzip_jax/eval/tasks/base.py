"""One evaluation example: a context and several questions about it, each with its reference answers."""

from __future__ import annotations

import dataclasses

METRICS = ("inclusion", "all", "exact", "f1", "rouge", "string_match_all", "string_match_part")
LAYOUTS = ("kvzip", "kvpress")


@dataclasses.dataclass(frozen=True)
class Example:
    """A context and its questions; every question is asked of the same (compressed) cache.

    answers[i] holds the reference strings of questions[i]. metric says how a prediction is scored against them
    (see kvzip_jax.eval.metrics): "inclusion" any reference occurs in the normalised prediction, "all" the fraction
    of references that occur (variable tracking), "exact", "f1" (token F1), "rouge" (ROUGE-L F), and RULER's
    "string_match_all" (the fraction of references in the lower-cased prediction) and "string_match_part" (any).
    max_new_tokens: the answer length the task needs. answer_prefix: the text a RULER prompt puts after the
    question, where the answer starts ("Answer:"), which every question's prompt ends with (prompts: after the
    answer header); "" for none. layout: how the prompt is laid out: "kvzip" by prompts.split_for_reuse (context
    and questions stripped, segments tokenized apart, "\\n\\n" before each question), "kvpress" by
    prompts.kvpress_split (kvpress's pipeline: the model gets kvpress's ids; RULER's tasks, kvpress-format datasets).
    """

    task: str
    id: str
    context: str
    questions: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]
    metric: str = "inclusion"
    max_new_tokens: int = 32
    answer_prefix: str = ""
    layout: str = "kvzip"

    def __post_init__(self):
        if len(self.questions) != len(self.answers):
            raise ValueError(f"{len(self.questions)} questions but {len(self.answers)} answer lists")
        if not self.questions:
            raise ValueError("an example needs at least one question")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
