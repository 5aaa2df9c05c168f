"""RULER's QA tasks (its qa.py): a question of SQuAD v2.0 dev (qa_1) or HotpotQA dev distractor (qa_2) asked over
"Document {i}:" blocks, its gold paragraph(s) among distractors, as many documents as fit the length.

The data sets are not shipped (nor installable offline): the user downloads them and names them by environment
variable, KVZIP_RULER_SQUAD (dev-v2.0.json) and KVZIP_RULER_HOTPOTQA (hotpot_dev_distractor_v1.json), read in their
original JSON formats. Without one, asking for its task raises RulerDataMissingError saying what to download and
which variable to set.

    data = load(SQUAD)                                          # read once per file (cached by path, size, mtime)
    found = samples(SQUAD, Streams.seeded(42), 10, 4096, count)  # RULER's samples 0..9
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

from kvzip_jax.errors import RulerDataMissingError, TaskFileError
from kvzip_jax.eval.tasks.ruler.length import draw_fitting, largest_fitting
from kvzip_jax.eval.tasks.ruler.sample import Sample
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import QA

DOCUMENT = "Document {i}:\n{document}"
STEP = 10  # documents: RULER's "incremental"


@dataclasses.dataclass(frozen=True)
class Question:
    """One of RULER's QAS entries: query, outputs (the accepted answers), context (its gold documents' indexes),
    more_context (SQuAD: the other paragraphs of its article, the first distractors)."""

    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]
    more_context: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Data:
    """RULER's QAS (the questions, in file order) and DOCS (every distinct document, sorted)."""

    questions: tuple[Question, ...]
    docs: tuple[str, ...]


def read_squad(data) -> Data:
    """RULER's read_squad: the paragraphs sorted and distinct; each answerable question (is_impossible false) with
    all its answer texts, its paragraph, and its article's other paragraphs."""
    docs = tuple(sorted({paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]}))
    index = {doc: i for i, doc in enumerate(docs)}
    questions = []
    for article in data["data"]:
        article_docs = [index[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            gold = index[paragraph["context"]]
            more = tuple(i for i in article_docs if i != gold)
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:
                    answers = tuple(answer["text"] for answer in qa["answers"])
                    questions.append(Question(qa["question"], answers, (gold,), more))
    return Data(tuple(questions), docs)


def _hotpot_document(title: str, sentences: list[str]) -> str:
    return f"{title}\n{''.join(sentences)}"


def read_hotpotqa(data) -> Data:
    """RULER's read_hotpotqa: documents f"{title}\\n{''.join(sentences)}", sorted and distinct; every question with
    [its answer] and all its context paragraphs as gold."""
    docs = tuple(
        sorted({_hotpot_document(title, sentences) for record in data for title, sentences in record["context"]})
    )
    index = {doc: i for i, doc in enumerate(docs)}
    questions = tuple(
        Question(
            record["question"],
            (record["answer"],),
            tuple(index[_hotpot_document(title, sentences)] for title, sentences in record["context"]),
        )
        for record in data
    )
    return Data(questions, docs)


@dataclasses.dataclass(frozen=True)
class Source:
    """A QA task's data set: the task, what the set is, its original file and where to download it, the
    environment variable naming the local file, and RULER's reader of its parsed JSON."""

    task: str
    name: str
    file: str
    url: str
    variable: str
    read: Callable[[object], Data]

    def missing(self, why: str) -> RulerDataMissingError:
        return RulerDataMissingError(
            f"{self.task} needs {self.name}, which kvzip-jax does not ship ({why}): download {self.url} and set "
            f"{self.variable}=/path/to/{self.file}"
        )


SQUAD = Source(
    "ruler_qa_1",
    "SQuAD v2.0's dev set",
    "dev-v2.0.json",
    "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",
    "KVZIP_RULER_SQUAD",
    read_squad,
)
HOTPOTQA = Source(
    "ruler_qa_2",
    "HotpotQA's dev set in the distractor setting",
    "hotpot_dev_distractor_v1.json",
    "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json",
    "KVZIP_RULER_HOTPOTQA",
    read_hotpotqa,
)


def load(source: Source) -> Data:
    """The data set of source's environment variable, read in its original format. RulerDataMissingError where the
    variable is unset or empty or names no file; TaskFileError where the file is not the data set's JSON."""
    given = os.environ.get(source.variable, "").strip()
    if not given:
        raise source.missing(f"{source.variable} is not set")
    path = Path(given).expanduser()
    if not path.is_file():
        raise source.missing(f"{source.variable}={given} is no file")
    stat = path.stat()
    return _read(source, str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(source: Source, path: str, size: int, mtime_ns: int) -> Data:
    """The parsed data set of a file (cached while the file keeps its size and modification time)."""
    try:
        with open(path, encoding="utf-8") as file:
            records = json.load(file)
    except (OSError, ValueError) as error:
        raise TaskFileError(f"cannot read {path} ({source.variable}) as JSON: {error}") from None
    try:
        data = source.read(records)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise TaskFileError(
            f"{path} ({source.variable}) is not {source.name} in its original format ({source.file}): "
            f"{type(error).__name__} {error}"
        ) from None
    if not data.questions:
        raise TaskFileError(f"{path} ({source.variable}) has no answerable question")
    return data


def draw(data: Data, streams: Streams, index: int, num_docs: int) -> Sample:
    """RULER's generate_input_output: question `index` over num_docs documents. Below the number of documents: its
    gold ones, then its article's other paragraphs (a random sample of them where they are enough, else all), then a
    random sample of the rest; at or above it: every document, repeated as needed. Shuffled by a fresh Random(seed),
    numbered "Document 1:" ..., joined by blank lines."""
    question, rng = data.questions[index], streams.py
    gold, more = list(question.context), list(question.more_context)
    if num_docs < len(data.docs):
        if num_docs - len(gold) > len(more):
            taken = set(gold + more)
            others = [i for i in range(len(data.docs)) if i not in taken]
            chosen = gold + more + rng.sample(others, max(0, num_docs - len(gold) - len(more)))
        else:
            chosen = gold + rng.sample(more, num_docs - len(gold))
        docs = [data.docs[i] for i in chosen]
    else:
        docs = list(data.docs * -(-num_docs // len(data.docs)))[:num_docs]
    streams.fresh().shuffle(docs)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=doc) for i, doc in enumerate(docs))
    return Sample(QA.prompt.format(context=context, query=question.query), question.outputs, num_docs)


def samples(
    source: Source,
    streams: Streams,
    num_samples: int,
    max_seq_length: int,
    count: Callable[[str], int],
    pre_samples: int = 0,
) -> list[Sample]:
    """Samples of questions pre_samples .. pre_samples + num_samples - 1 (RULER's pre_samples: 0 but in a chunked
    run), each prompt + 32 new tokens within max_seq_length tokens. The number of documents: a probe draw of 10 for
    question 0 gives the tokens per document, then the largest in [10, max(3 x max_seq_length / that, 20)] that fits
    a draw for question 0 (a binary search); a sample that does not fit is drawn again with 10 fewer."""
    data = load(source)
    if pre_samples < 0 or pre_samples + num_samples > len(data.questions):
        raise ValueError(
            f"{source.task} has {len(data.questions)} questions; asked for questions {pre_samples} to "
            f"{pre_samples + num_samples - 1}"
        )
    length = lambda sample: count(sample.text) + QA.max_new_tokens
    per_doc = count(draw(data, streams, 0, STEP).text) / STEP
    upper = max(int((max_seq_length / per_doc) * 3), 2 * STEP)
    size = largest_fitting(lambda n: length(draw(data, streams, 0, n)) <= max_seq_length, STEP, upper)
    size = STEP if size is None else size
    return [
        draw_fitting(functools.partial(draw, data, streams, pre_samples + i), length, size, STEP, max_seq_length)
        for i in range(num_samples)
    ]
