"""RULER's QA tasks (kvzip_jax.eval.tasks.ruler.qa): ruler_qa_1 (SQuAD v2.0 dev) and ruler_qa_2 (HotpotQA dev
distractor) generated from small files in the original formats, written here: each sample's template, documents,
gold paragraphs, distractors, answers and length, its kvpress split, determinism, and the named error where the data
set is not given (also through the CLI, before any model loads).

RULER_SHA256 holds the sha256 (first 16 hex digits) of json.dumps([input + answer_prefix, outputs]) of the samples
that NVIDIA RULER's own scripts/data/synthetic/qa.py (commit c3f5e3b, random_seed 42, the base model template, the
template and answer prefix of its constants.py) wrote from these files, with the bundled Qwen2.5-Coder tokenizer as
its HF tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import random
import re

import pytest

from kvzip_jax import cli
from kvzip_jax.errors import KvzipError, RulerDataMissingError, TaskFileError
from kvzip_jax.eval.tasks import generate, ruler
from kvzip_jax.eval.tasks.ruler import qa, templates
from kvzip_jax.weights import registry

SEED = 42
LENGTH = 1024
NUM_SAMPLES = 6
INTRO = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n"
)
ASK = "Answer the question based on the given documents. Only give me the answer and do not output any other words."
RULER_SHA256 = {
    ("squad", LENGTH): (
        "a3442753b134abbc",
        "c7783447976a1b53",
        "ea52ba3f46594540",
        "d93b023d99b3919e",
        "66e1859389de4d84",
        "2b6c43d66bdb06b9",
    ),
    ("hotpotqa", LENGTH): (
        "bd5f101a7f17569b",
        "b4c09b8d80cf80a5",
        "4f7137f8d3a15af8",
        "1cdf1e95697530d4",
        "dc21c53cb301541c",
        "7f124e32ce20d887",
    ),
    ("squad", 4096): ("e734fc3f8f05331f", "32e326fcaef22b1b"),
}
ADJECTIVES = ("northern", "ancient", "quiet", "golden", "narrow", "crowded", "hidden", "eastern", "painted", "silent")
NOUNS = ("river", "tower", "garden", "harbor", "library", "market", "bridge", "forest", "castle", "valley", "temple")
VERBS = ("guarded", "rebuilt", "mapped", "painted", "visited", "measured", "described", "sold", "crossed", "named")
ARTICLE_PARAGRAPHS = (6, 20, 6, 6)  # the second article has more paragraphs than a 1K prompt holds documents


def prose(seed: int, sentences: int) -> list[str]:
    """Deterministic sentences of made-up facts."""
    rng = random.Random(seed)
    return [
        f"The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} of {rng.choice(NOUNS).title()}ville was "
        f"{rng.choice(VERBS)} by {rng.choice(ADJECTIVES)} travellers in {1500 + rng.randrange(500)}."
        for _ in range(sentences)
    ]


def squad_json() -> dict:
    """SQuAD v2.0's format: articles of paragraphs, each with questions, some unanswerable (answers [], plausible
    answers, is_impossible); answerable ones with several answer texts, repeated as annotators repeat them. The
    last article's last but one paragraph repeats the first one's text (its questions its own)."""
    articles = []
    for a, count in enumerate(ARTICLE_PARAGRAPHS):
        paragraphs = []
        for p in range(count):
            stones = 10 + 7 * a + 3 * p
            text = " ".join(prose(100 * a + p, 2)) + f" Keeper {a}-{p} counted {stones} stones."
            if a == len(ARTICLE_PARAGRAPHS) - 1 and p == count - 2:
                text = articles[0]["paragraphs"][0]["context"]
            answerable = {
                "question": f"How many stones did keeper {a}-{p} count?",
                "id": f"{a}-{p}-a",
                "answers": [
                    {"text": f"{stones} stones", "answer_start": text.find(str(stones))},
                    {"text": str(stones), "answer_start": text.find(str(stones))},
                    {"text": f"{stones} stones", "answer_start": text.find(str(stones))},
                ],
                "is_impossible": False,
            }
            impossible = {
                "plausible_answers": [{"text": f"{stones} stones", "answer_start": text.find(str(stones))}],
                "question": f"How many stones did keeper {a}-{p} lose?",
                "id": f"{a}-{p}-i",
                "answers": [],
                "is_impossible": True,
            }
            qas = [impossible] if p % 3 == 2 else [impossible, answerable] if p % 2 else [answerable, impossible]
            paragraphs.append({"qas": qas, "context": text})
        articles.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": articles}


def hotpotqa_json() -> list[dict]:
    """HotpotQA's dev distractor format: records of a question, its answer and 10 context paragraphs
    [title, [sentences]] (sentences after the first opening with a space), drawn from a shared pool."""
    pool = [
        (f"Place {k}", [s if i == 0 else " " + s for i, s in enumerate(prose(1000 + k, 1 + k % 3))]) for k in range(36)
    ]
    records = []
    for r in range(8):
        rng = random.Random(2000 + r)
        context = [list(pool[k]) for k in rng.sample(range(len(pool)), 10)]
        answer = "yes" if r % 4 == 3 else context[0][1][0].split(" was ")[0].removeprefix("The ")
        records.append(
            {
                "_id": f"h{r}",
                "answer": answer,
                "question": f"Which place do {context[0][0]} and {context[1][0]} have in common, record {r}?",
                "supporting_facts": [[context[0][0], 0], [context[1][0], 0]],
                "context": context,
                "type": "comparison" if r % 4 == 3 else "bridge",
                "level": "medium",
            }
        )
    return records


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ruler_qa")
    squad, hotpot = folder / "dev-v2.0.json", folder / "hotpot_dev_distractor_v1.json"
    squad.write_text(json.dumps(squad_json()))
    hotpot.write_text(json.dumps(hotpotqa_json()))
    return {"squad": squad, "hotpotqa": hotpot}


@pytest.fixture
def data_env(monkeypatch, files):
    monkeypatch.setenv(qa.SQUAD.variable, str(files["squad"]))
    monkeypatch.setenv(qa.HOTPOTQA.variable, str(files["hotpotqa"]))
    return files


@pytest.fixture
def no_data_env(monkeypatch):
    monkeypatch.delenv(qa.SQUAD.variable, raising=False)
    monkeypatch.delenv(qa.HOTPOTQA.variable, raising=False)


TASK = {"squad": "ruler_qa_1", "hotpotqa": "ruler_qa_2"}


def documents(text: str) -> list[str]:
    """The documents of a QA prompt, checked to be "Document 1:" ... "Document n:" joined by blank lines between
    the template's instructions."""
    assert text.startswith(INTRO)
    body, tail = text[len(INTRO) :].split(f"\n\n{ASK}\n\nQuestion: ")
    assert tail.endswith(" Answer:") and body.startswith("Document 1:\n")
    blocks = body.split("\n\nDocument ")
    docs = [blocks[0][len("Document 1:\n") :]]
    for number, block in enumerate(blocks[1:], start=2):
        head, _, doc = block.partition(":\n")
        assert head == str(number), block[:40]
        docs.append(doc)
    return docs


def shuffled_positions(n: int) -> list[int]:
    """Where RULER's fresh Random(seed).shuffle puts item k of n: position[k]."""
    order = list(range(n))
    random.Random(SEED).shuffle(order)
    return [order.index(k) for k in range(n)]


def digest(text: str, answers) -> str:
    return hashlib.sha256(json.dumps([text, list(answers)]).encode()).hexdigest()[:16]


# --- registry, errors -----------------------------------------------------------------------------------------------


def test_the_qa_tasks_are_registered_beside_the_eleven_offline_ones():
    assert ruler.QA_TASKS == ("ruler_qa_1", "ruler_qa_2") and len(ruler.OFFLINE) == 11
    assert set(ruler.TASKS) == set(ruler.OFFLINE) | set(ruler.QA_TASKS)
    assert all(ruler.TASKS[name].family is templates.QA for name in ruler.QA_TASKS)
    assert templates.QA.max_new_tokens == 32 and templates.QA.metric == "string_match_part"


@pytest.mark.parametrize("name, source", [("ruler_qa_1", qa.SQUAD), ("ruler_qa_2", qa.HOTPOTQA)])
def test_no_data_set_is_a_named_error_saying_what_to_download_and_set(no_data_env, monkeypatch, tmp_path, name, source):
    with pytest.raises(RulerDataMissingError) as error:
        ruler.samples(name, 1, LENGTH, len)
    message = str(error.value)
    assert "\n" not in message and isinstance(error.value, KvzipError)
    assert name in message and source.file in message and source.url in message and source.variable in message
    monkeypatch.setenv(source.variable, str(tmp_path / "nowhere.json"))
    with pytest.raises(RulerDataMissingError, match="nowhere.json is no file"):
        generate(name, 1, seed=SEED, context_tokens=LENGTH, count_tokens=len)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "c"}]}]}))
    monkeypatch.setenv(source.variable, str(bad))
    with pytest.raises(TaskFileError, match="not .* in its original format"):
        ruler.check_data([name])
    ruler.check_data(["ruler_vt", "passkey"])  # nothing to check


def test_eval_refuses_a_qa_task_without_its_data_before_loading_the_model(no_data_env, monkeypatch, capsys):
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    assert cli.main(["eval", "--model", registry.SMOLLM2, "--tasks", "ruler_vt,ruler_qa_2"]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvzip-jax eval: error: ruler_qa_2 needs "), err
    assert qa.HOTPOTQA.variable in err and qa.HOTPOTQA.url in err


def test_the_files_are_read_as_ruler_reads_them(data_env):
    squad, records = qa.load(qa.SQUAD), squad_json()["data"]
    paragraphs = [paragraph for article in records for paragraph in article["paragraphs"]]
    assert squad.docs == tuple(sorted({paragraph["context"] for paragraph in paragraphs}))
    assert len(squad.docs) == len(paragraphs) - 1  # the repeated paragraph once
    assert [q.query for q in squad.questions] == [
        record["question"] for paragraph in paragraphs for record in paragraph["qas"] if not record["is_impossible"]
    ]
    last = squad.questions[-1]  # asked on the repeated paragraph: its article's others, not the gold, follow it
    assert last.query == "How many stones did keeper 3-4 count?"
    assert squad.docs[last.context[0]] == records[0]["paragraphs"][0]["context"]
    assert len(last.more_context) == ARTICLE_PARAGRAPHS[-1] - 1 and last.context[0] not in last.more_context
    hotpot = qa.load(qa.HOTPOTQA)
    assert len(hotpot.questions) == 8 and all(len(q.context) == 10 and not q.more_context for q in hotpot.questions)
    with pytest.raises(ValueError, match="has 8 questions"):
        ruler.samples("ruler_qa_2", 9, LENGTH, len)


# --- the samples ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated(qwen_tokenizer, files):
    """NUM_SAMPLES samples of each QA task at LENGTH tokens, seed 42 (the data files named by environment)."""
    cache = {}

    def get(name: str, length: int = LENGTH, num_samples: int = NUM_SAMPLES, seed: int = SEED):
        key = (name, length, num_samples, seed)
        if key not in cache:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv(qa.SQUAD.variable, str(files["squad"]))
                patch.setenv(qa.HOTPOTQA.variable, str(files["hotpotqa"]))
                cache[key] = ruler.samples(TASK[name], num_samples, length, qwen_tokenizer, seed)
        return cache[key]

    return get


def test_squad_samples_ask_the_answerable_questions_over_gold_then_article_then_random_paragraphs(generated):
    records = squad_json()["data"]
    answerable = [
        (article_index, paragraph["context"], qa_record)
        for article_index, article in enumerate(records)
        for paragraph in article["paragraphs"]
        for qa_record in paragraph["qas"]
        if not qa_record["is_impossible"]
    ]
    all_docs = {paragraph["context"] for article in records for paragraph in article["paragraphs"]}
    branches = set()
    for i, s in enumerate(generated("squad")):
        article_index, gold, record = answerable[i]
        assert s.answers == tuple(answer["text"] for answer in record["answers"]) and len(s.answers) == 3
        assert s.text.endswith(f"\n\nQuestion: {record['question']} Answer:")
        docs = documents(s.text)
        assert len(docs) == s.size and len(set(docs)) == s.size and set(docs) <= all_docs
        assert docs[shuffled_positions(s.size)[0]] == gold  # the gold paragraph comes first before the shuffle
        article = {paragraph["context"] for paragraph in records[article_index]["paragraphs"]} - {gold}
        if s.size - 1 <= len(article):
            assert set(docs) - {gold} <= article
            branches.add("article")
        else:
            assert article <= set(docs)
            branches.add("others")
    assert branches == {"article", "others"}


def test_hotpotqa_samples_hold_all_ten_context_paragraphs_and_random_distractors(generated):
    records = hotpotqa_json()
    pool = {f"{title}\n{''.join(sentences)}" for record in records for title, sentences in record["context"]}
    for i, s in enumerate(generated("hotpotqa")):
        record = records[i]
        gold = [f"{title}\n{''.join(sentences)}" for title, sentences in record["context"]]
        assert s.answers == (record["answer"],)
        assert s.text.endswith(f"\n\nQuestion: {record['question']} Answer:")
        docs = documents(s.text)
        assert len(docs) == s.size >= 10 and len(set(docs)) == s.size and set(docs) <= pool
        positions = shuffled_positions(s.size)
        assert [docs[positions[k]] for k in range(10)] == gold


def test_a_prompt_longer_than_every_document_repeats_them_all(generated):
    docs = sorted({paragraph["context"] for article in squad_json()["data"] for paragraph in article["paragraphs"]})
    for s in generated("squad", 4096, 2):
        found = documents(s.text)
        assert s.size > len(docs) and len(found) == s.size
        assert sorted(found) == sorted((docs * 3)[: s.size])


@pytest.mark.parametrize("name", ["squad", "hotpotqa"])
def test_prompt_and_32_new_tokens_fit_within_one_step_of_documents(name, generated, qwen_count):
    for s in generated(name):
        used = qwen_count(s.text) + 32
        largest = max(qwen_count(f"Document {s.size}:\n{doc}\n\n") for doc in documents(s.text))
        assert 0 <= LENGTH - used <= (qa.STEP + 1) * largest, (name, used, s.size)


@pytest.mark.parametrize("name", ["squad", "hotpotqa"])
def test_examples_are_cut_as_kvpress_cuts_qa_prompts(name, generated):
    task = TASK[name]
    for i, s in enumerate(generated(name)):
        example = ruler.sample.to_example(s, templates.QA, task, f"{task}-{SEED}-{i}")
        assert ruler.base_prompt(example) == s.text
        assert example.context.startswith(INTRO) and example.context.endswith("\n\n")
        assert example.context.count(ASK) == 1  # the question starts at the instruction's last match
        query = re.fullmatch(rf"{re.escape(ASK)}\n\nQuestion: (.+\?) ", example.questions[0])
        assert query and s.text.endswith(f"Question: {query[1]} Answer:")
        assert example.answer_prefix == "Answer:" and example.answers == (s.answers,)
        assert (example.metric, example.max_new_tokens, example.layout) == ("string_match_part", 32, "kvpress")


def test_generate_dispatches_qa_names_with_ids(data_env, qwen_tokenizer, generated):
    examples = generate("ruler_qa_2", 2, seed=SEED, context_tokens=LENGTH, count_tokens=qwen_tokenizer)
    assert [ex.id for ex in examples] == [f"ruler_qa_2-{SEED}-0", f"ruler_qa_2-{SEED}-1"]
    assert [ruler.base_prompt(ex) for ex in examples] == [s.text for s in generated("hotpotqa")[:2]]


@pytest.mark.parametrize("name", ["squad", "hotpotqa"])
def test_same_seed_and_file_same_samples_sample_i_whatever_the_count(name, generated):
    assert generated(name, num_samples=2) == generated(name)[:2]
    other = generated(name, num_samples=2, seed=7)
    assert [s.answers for s in other] == [s.answers for s in generated(name)[:2]]  # question i: sample i
    assert other[0].text != generated(name)[0].text


@pytest.mark.parametrize("name, length", sorted(RULER_SHA256))
def test_samples_are_byte_identical_to_rulers_own(name, length, generated):
    expected = RULER_SHA256[(name, length)]
    found = generated(name, length, max(len(expected), 1))
    assert tuple(digest(s.text, s.answers) for s in found[: len(expected)]) == expected
