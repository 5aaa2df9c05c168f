"""RULER's prompt format per generator family (its base model template, "{task_template}", no chat template): the
task template, the answer prefix that follows it in the prompt, the max new tokens, and kvpress's patterns that cut
a prompt into context, question and answer prefix.

NOISE is the line the noise haystacks repeat, NEEDLE a NIAH needle (its {kind} always plural).
Placeholders: {kind} the needle value type (NIAH), {context} the haystack (QA: the documents), {query} the key(s)
or value asked about (QA: the question), {count} the number of variables (variable tracking).
"""

from __future__ import annotations

import dataclasses
import re

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."


@dataclasses.dataclass(frozen=True)
class Family:
    """One RULER generator's prompt. template + answer_prefix is the whole prompt; question and answer locate the
    split: the question starts at question's last match, the answer prefix at answer's first match after it; metric:
    RULER's score of the family's answers."""

    template: str
    answer_prefix: str
    max_new_tokens: int
    question: re.Pattern
    answer: re.Pattern
    metric: str = "string_match_all"

    @property
    def prompt(self) -> str:
        return self.template + self.answer_prefix


NIAH = Family(
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
    "provided text?",
    " The special magic {kind} for {query} mentioned in the provided text are",
    128,
    re.compile(r"What (?:is|are all) the special magic"),
    re.compile(r"The special magic"),
)
VARIABLE_TRACKING = Family(
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
    "Find all variables that are assigned the value {query} in the text above.",
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables are assigned "
    "the value {query}, they are: ",
    30,
    re.compile(r"Question: Find all variables that are assigned the value"),
    re.compile(r"Answer:"),
)
COMMON_WORDS = Family(
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
    " Answer: The top 10 words that appear most often in the list are:",
    120,
    re.compile(r"Question: What are the 10 most common words in the above list\?"),
    re.compile(r"Answer:"),
)
FREQ_WORDS = Family(
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?",
    " Answer: According to the coded text above, the three most frequently appeared words are:",
    50,
    re.compile(r"Question: Do not provide any explanation\."),
    re.compile(r"Answer:"),
)
QA = Family(  # the question's last match: the instruction repeated after the documents
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {query}",
    " Answer:",
    32,
    re.compile(r"Answer the question based on the given documents\."),
    re.compile(r"Answer:"),
    "string_match_part",
)


def singular(prompt: str) -> str:
    """RULER's NIAH prompt template for one answer (one query, one value): "Some" -> "A", "are all" -> "is", "are"
    -> "is", "answers" -> "answer", replaced in that order in the template before it is filled (the needles keep
    their plural)."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        prompt = prompt.replace(old, new)
    return prompt


def split(text: str, family: Family) -> tuple[str, str, str]:
    """(context, question, answer_prefix) of a whole prompt, as kvpress cut RULER's prompts; their concatenation
    is the prompt. ValueError where the patterns do not match."""
    starts = [match.start() for match in family.question.finditer(text)]
    if not starts:
        raise ValueError(f"no question matching {family.question.pattern!r} in the prompt")
    tail = text[starts[-1] :]
    answer = family.answer.search(tail)
    if answer is None:
        raise ValueError(f"no answer prefix matching {family.answer.pattern!r} after the question")
    return text[: starts[-1]], tail[: answer.start()], tail[answer.start() :]
