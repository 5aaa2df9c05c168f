"""Offline evaluation tasks: deterministic generators, the stdlib-docstring haystack, and the JSONL task loader."""

import json
import re

import numpy as np
import pytest

from kvzip_jax.errors import TaskFileError
from kvzip_jax.eval.tasks import TASKS, Example, generate, haystack, load_jsonl

HAYSTACK_TASKS = ("niah", "passkey", "multi_needle", "variable_tracking")


@pytest.fixture(scope="module")
def examples() -> dict[str, list[Example]]:
    """Three 1000-token examples of every task, seed 0."""
    return {task: generate(task, 3, seed=0, context_tokens=1000) for task in TASKS}


def all_examples(examples):
    return [example for task_examples in examples.values() for example in task_examples]


def needle_sentences(context: str) -> list[str]:
    """The sentences of a context that are not corpus sentences."""
    corpus = set(haystack.sentences())
    return [s for s in haystack.split_sentences(context) if s not in corpus]


def expected_needles(example: Example) -> int:
    """Needle sentences a generator inserts: one for niah, one per assignment for variable tracking, else one per
    question."""
    if example.task == "niah":
        return 1
    if example.task == "variable_tracking":
        return sum(map(len, example.answers))
    return len(example.questions)


def chain_value(question: str) -> str:
    return re.search(r"value (\d+)", question).group(1)


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_examples_other_seed_others(task):
    first = generate(task, 2, seed=1, context_tokens=600)
    assert first == generate(task, 2, seed=1, context_tokens=600)
    others = generate(task, 2, seed=2, context_tokens=600)
    assert all(a.context != b.context and a.answers != b.answers for a, b in zip(first, others))


@pytest.mark.parametrize("task", TASKS)
def test_example_independent_of_num_contexts(task):
    assert generate(task, 1, seed=3, context_tokens=500)[0] == generate(task, 4, seed=3, context_tokens=500)[0]
    assert generate(task, 3, seed=3, context_tokens=500)[2] == generate(task, 5, seed=3, context_tokens=500)[2]


def test_examples_of_one_task_differ(examples):
    for task_examples in examples.values():
        assert len({example.context for example in task_examples}) == len(task_examples)


def test_every_answer_occurs_in_its_context(examples):
    for example in all_examples(examples):
        for references in example.answers:
            assert all(reference in example.context for reference in references), (example.id, references)


def test_variable_tracking_chains_are_in_the_context(examples):
    for example in examples["variable_tracking"]:
        for question, names in zip(example.questions, example.answers):
            assert len(names) in (4, 5) and example.metric == "all"
            assert f"VAR {names[0]} = {chain_value(question)}." in example.context
            for old, new in zip(names, names[1:]):
                assert example.context.index(f"VAR {old} =") < example.context.index(f"VAR {new} = VAR {old}.")


def test_several_questions_per_context(examples):
    for example in all_examples(examples):
        assert len(example.questions) >= 3
        assert len(set(example.questions)) == len(example.questions)


@pytest.mark.parametrize("context_tokens", [1000, 4000])
def test_context_size_near_the_target(context_tokens):
    for task in TASKS:
        for example in generate(task, 2, seed=5, context_tokens=context_tokens):
            assert abs(haystack.approx_tokens(example.context) - context_tokens) <= 0.25 * context_tokens, example.id


def test_context_size_follows_the_given_token_counter():
    def count_words(text):
        return len(text.split())

    for task in HAYSTACK_TASKS:
        (example,) = generate(task, 1, context_tokens=800, count_tokens=count_words)
        assert abs(count_words(example.context) - 800) <= 200


def test_ids_unique_and_stable(examples):
    for task, task_examples in examples.items():
        assert [example.id for example in task_examples] == [f"{task}-0-{i}" for i in range(3)]
        assert all(example.task == task for example in task_examples)
    ids = [example.id for example in all_examples(examples)]
    assert len(set(ids)) == len(ids)


def test_haystack_is_real_english_text():
    corpus = haystack.sentences()
    text = " ".join(corpus)
    assert haystack.approx_tokens(text) > 20_000
    words = text.lower().split()
    for common in ("the", "and", "of", "is", "to", "a", "in", "that"):
        assert words.count(common) > 100, common
    assert "lorem" not in text.lower() and "ipsum" not in text.lower()
    assert all(haystack.is_prose(sentence) for sentence in corpus)
    assert len(set(corpus)) == len(corpus)


def test_haystack_contexts_are_corpus_text_plus_needles(examples):
    for task in HAYSTACK_TASKS:
        for example in examples[task]:
            needles = needle_sentences(example.context)
            assert len(needles) == expected_needles(example), example.id
            for references in example.answers:
                assert all(any(reference in needle for needle in needles) for reference in references)


def test_draw_is_a_contiguous_run_near_the_token_count():
    corpus = haystack.sentences()
    run = haystack.draw(np.random.default_rng(7), 2000)
    assert run == haystack.draw(np.random.default_rng(7), 2000)
    assert abs(sum(map(haystack.approx_tokens, run)) - 2000) <= 100
    start = corpus.index(run[0])
    assert run == [corpus[(start + i) % len(corpus)] for i in range(len(run))]


def test_draw_wraps_past_the_end_of_the_corpus():
    corpus_tokens = sum(map(haystack.approx_tokens, haystack.sentences()))
    run = haystack.draw(np.random.default_rng(0), corpus_tokens + 1000)
    assert len(run) > len(haystack.sentences())


def test_insert_needles_at_sentence_boundaries():
    sentences = ["One fish swims.", "Two fish swim.", "Three fish swim.", "Four fish swim."]
    text = haystack.insert_needles(sentences, ["Needle A.", "Needle B.", "Needle C."], [0.0, 0.5, 1.0])
    assert text == "Needle A. One fish swims. Two fish swim. Needle B. Three fish swim. Four fish swim. Needle C."
    assert haystack.insert_needles(sentences, ["X y.", "Z w."], [0.3, 0.3]).count("X y. Z w.") == 1
    with pytest.raises(ValueError, match="depths"):
        haystack.insert_needles(sentences, ["X y."], [1.5])
    with pytest.raises(ValueError, match="needles"):
        haystack.insert_needles(sentences, ["X y."], [0.1, 0.2])


def test_spread_depths_one_per_stratum():
    depths = haystack.spread_depths(np.random.default_rng(0), 5)
    assert [int(d * 5) for d in depths] == [0, 1, 2, 3, 4]


def test_kv_retrieval_answers_are_the_values_of_the_asked_keys(examples):
    for example in examples["kv_retrieval"]:
        pairs = json.loads(example.context)
        for question, (value,) in zip(example.questions, example.answers):
            key = re.search(r'"([0-9a-f-]{36})"', question).group(1)
            assert pairs[key] == value


def test_key_numbers_ask_for_the_number_after_each_asked_key(examples):
    corpus = set(haystack.sentences())
    for example in examples["key_numbers"]:
        lines = re.findall(r"\b([a-z]{6}): (\d{3})\b", example.context)
        assert len(lines) == 8 and len(dict(lines)) == 8 and len({n for _, n in lines}) == 8, example.id
        for question, (number,) in zip(example.questions, example.answers):
            assert dict(lines)[re.search(r"'([a-z]{6}):'", question).group(1)] == number
        prose = re.sub(r"\b[a-z]{6}: \d{3} ?", "", example.context)  # what is left is corpus text
        assert all(s in corpus for s in haystack.split_sentences(prose)), example.id


def test_prefix_suffix_identifies_exactly_one_string(examples):
    for example in examples["prefix_suffix"]:
        lines = example.context.split("\n")
        for question, (answer,) in zip(example.questions, example.answers):
            prefix, suffix = re.findall(r'"([a-z0-9]+)"', question)
            assert [s for s in lines if s.startswith(prefix) and s.endswith(suffix)] == [answer]
            assert sum(s.startswith(prefix) for s in lines) >= 2 and sum(s.endswith(suffix) for s in lines) >= 2
            assert all(16 <= len(s) <= 24 for s in lines)


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="niah.*passkey"):
        generate("nope", 1)
    with pytest.raises(ValueError, match="num_contexts"):
        generate("niah", 0)
    with pytest.raises(ValueError, match="context_tokens"):
        generate("niah", 1, context_tokens=0)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl(tmp_path):
    records = [
        {
            "context": "Paris is in France.",
            "queries": ["Where is Paris?", "Which country?"],
            "answers": ["France", ["France", "FR"]],
        },
        {
            "context": "VAR A = 1.",
            "questions": ["Who is 1?"],
            "answers": [["A"]],
            "id": "vt-7",
            "task": "vt",
            "metric": "all",
            "max_new_tokens": 8,
            "answer_prefix": " Answer:",
        },
    ]
    path = write_lines(tmp_path / "mixed.jsonl", [json.dumps(records[0]), "", "   ", json.dumps(records[1])])
    first, second = load_jsonl(path)
    assert first == Example(
        "mixed",
        "mixed-0",
        "Paris is in France.",
        ("Where is Paris?", "Which country?"),
        (("France",), ("France", "FR")),
    )
    assert first.answer_prefix == ""
    assert second == Example("vt", "vt-7", "VAR A = 1.", ("Who is 1?",), (("A",),), "all", 8, " Answer:")
    assert [e.id for e in load_jsonl(str(path), task="kv")] == ["kv-0", "vt-7"]
    assert load_jsonl(path, task="kv")[0].task == "kv"


GOOD = {"context": "c", "queries": ["q"], "answers": ["a"]}


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "Expecting"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"queries": ["q"], "answers": ["a"]}), "context"),
        (json.dumps({**GOOD, "context": ""}), "context"),
        (json.dumps({"context": "c", "answers": ["a"]}), "queries"),
        (json.dumps({**GOOD, "queries": []}), "queries"),
        (json.dumps({**GOOD, "questions": ["q"]}), "exactly one"),
        (json.dumps({**GOOD, "answers": ["a", "b"]}), "answers"),
        (json.dumps({**GOOD, "answers": [[]]}), "answers"),
        (json.dumps({**GOOD, "answers": [3]}), "answers"),
        (json.dumps({**GOOD, "metric": "bleu"}), "metric"),
        (json.dumps({**GOOD, "max_new_tokens": 0}), "max_new_tokens"),
        (json.dumps({**GOOD, "id": 5}), "id"),
        (json.dumps({**GOOD, "answer_prefix": 1}), "answer_prefix"),
        (json.dumps({**GOOD, "layout": "ruler"}), "layout"),
    ],
)
def test_load_jsonl_rejects_a_bad_record_naming_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), "", line])
    with pytest.raises(TaskFileError, match=rf"bad\.jsonl:3: .*{message}"):
        load_jsonl(path)


def test_load_jsonl_keeps_the_kvzip_layout_unless_a_record_names_one(tmp_path):
    path = write_lines(tmp_path / "layouts.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "layout": "kvpress"})])
    assert [example.layout for example in load_jsonl(path)] == ["kvzip", "kvpress"]


def test_load_jsonl_rejects_duplicate_ids(tmp_path):
    path = write_lines(tmp_path / "dup.jsonl", [json.dumps({**GOOD, "id": "x"}), json.dumps({**GOOD, "id": "x"})])
    with pytest.raises(TaskFileError, match=r"dup\.jsonl:2: duplicate id"):
        load_jsonl(path)


def test_load_jsonl_rejects_missing_and_empty_files(tmp_path):
    with pytest.raises(TaskFileError, match="absent.jsonl"):
        load_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(TaskFileError, match="no records"):
        load_jsonl(write_lines(tmp_path / "empty.jsonl", ["", " "]))
