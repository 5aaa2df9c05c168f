"""Prompt layout on the three bundled tokenizers (read from their GGUF files), and the bundled demo data."""

import copy
import functools
import importlib.resources
import json

import numpy as np
import pytest

from kvzip_jax import prompts
from kvzip_jax.errors import EmptyInputError, KvzipError
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer

TOKENIZERS = ("smollm2", "qwen2.5", "gemma3")
DEMO_DOCUMENT = importlib.resources.files("kvzip_jax").joinpath("data/demo_document.txt").read_text()
DEMO_QUESTIONS = json.loads(importlib.resources.files("kvzip_jax").joinpath("data/demo_questions.json").read_text())


@functools.cache
def load_tokenizer(name: str):
    return bundled_tokenizer({"smollm2": registry.SMOLLM2, "qwen2.5": registry.QWEN, "gemma3": registry.GEMMA}[name])


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request):
    return load_tokenizer(request.param)


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode_whole(tokenizer, text: str) -> list[int]:
    """One-pass tokenization of a rendered prompt (special-token strings parsed, nothing added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rendered_chat(tokenizer, user_message: str, system: str | None = None) -> str:
    messages = ([] if system is None else [{"role": "system", "content": system}]) + [
        {"role": "user", "content": user_message}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("question_index", [None, 0, 1, 2])
def test_each_segment_decodes_to_its_text(tokenizer, question_index):
    question = None if question_index is None else DEMO_QUESTIONS[question_index]["question"]
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question)
    layout = prompts.chat_layout(tokenizer)
    ids = prompt.ids()
    assert ids.dtype == np.int32 and len(ids) == len(prompt)
    assert decode(tokenizer, ids[prompt.prefix_slice]) == layout.prefix
    assert decode(tokenizer, ids[prompt.context_slice]) == DEMO_DOCUMENT.strip()
    assert decode(tokenizer, ids[prompt.question_slice]) == ("" if question is None else "\n\n" + question)
    assert decode(tokenizer, ids[prompt.answer_header_slice]) == layout.answer_header


def test_tokens_match_the_templates_own_rendering(tokenizer):
    question = DEMO_QUESTIONS[1]["question"]
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question)
    ids = prompt.ids()
    user_message = DEMO_DOCUMENT.strip() + "\n\n" + question
    if tokenizer.chat_template is not None:
        assert decode(tokenizer, ids) == rendered_chat(tokenizer, user_message)
    layout = prompts.chat_layout(tokenizer)
    # Each side of the context/question join is tokenized exactly as a one-pass tokenization would do it.
    assert ids[: prompt.context_end].tolist() == encode_whole(tokenizer, layout.prefix + DEMO_DOCUMENT.strip())
    assert ids[prompt.context_end :].tolist() == encode_whole(tokenizer, "\n\n" + question + layout.answer_header)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_segments_equal_one_pass_tokenization(name):
    tokenizer = load_tokenizer(name)
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, DEMO_QUESTIONS[0]["question"])
    assert prompt.ids().tolist() == encode_whole(tokenizer, decode(tokenizer, prompt.ids()))


def test_qwen_differs_from_one_pass_tokenization_only_by_the_documented_merge():
    tokenizer = load_tokenizer("qwen2.5")
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, DEMO_QUESTIONS[0]["question"])
    ids = prompt.ids().tolist()
    one_pass = encode_whole(tokenizer, decode(tokenizer, ids))
    join = prompt.context_end
    assert [decode(tokenizer, [i]) for i in ids[join - 1 : join + 1]] == [".", "\n\n"]
    assert decode(tokenizer, [one_pass[join - 1]]) == ".\n\n"
    assert one_pass[: join - 1] == ids[: join - 1] and one_pass[join:] == ids[join + 1 :]


def test_system_prompt_replaces_the_default(tokenizer):
    system = "Answer with a few words taken from the report."
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, DEMO_QUESTIONS[2]["question"], system=system)
    prefix = decode(tokenizer, prompt.ids()[prompt.prefix_slice])
    assert system in prefix
    if tokenizer.chat_template is not None:
        user_message = DEMO_DOCUMENT.strip() + "\n\n" + DEMO_QUESTIONS[2]["question"]
        assert decode(tokenizer, prompt.ids()) == rendered_chat(tokenizer, user_message, system)
        assert "helpful" not in prefix


def test_instruction_opens_the_user_message_inside_the_prefix(tokenizer):
    """KVzip's task instruction precedes the context in the user message and belongs to the never-evicted prefix."""
    question = DEMO_QUESTIONS[0]["question"]
    plain = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question)
    prompt = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question, instruction=prompts.KVZIP_INSTRUCTION)
    ids = prompt.ids()
    lead = prompts.KVZIP_INSTRUCTION + "\n\n"
    assert decode(tokenizer, ids[prompt.prefix_slice]) == prompts.chat_layout(tokenizer).prefix + lead
    assert ids[prompt.context_slice].tolist() == plain.ids()[plain.context_slice].tolist()
    assert ids[prompt.context_end :].tolist() == plain.ids()[plain.context_end :].tolist()
    if tokenizer.chat_template is not None:
        assert decode(tokenizer, ids) == rendered_chat(tokenizer, lead + DEMO_DOCUMENT.strip() + "\n\n" + question)
    context_part, suffixes = prompts.split_for_reuse(
        tokenizer, DEMO_DOCUMENT, [question], instruction=prompts.KVZIP_INSTRUCTION
    )
    assert np.array_equal(np.concatenate([context_part.ids(), suffixes[0]]), ids)
    with pytest.raises(EmptyInputError, match="instruction"):
        prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question, instruction="  ")


def test_layouts_of_the_bundled_tokenizers():
    chatml_header = "<|im_end|>\n<|im_start|>assistant\n"
    smollm2 = prompts.chat_layout(load_tokenizer("smollm2"))
    assert smollm2.prefix.endswith("SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert smollm2.answer_header == chatml_header
    qwen = prompts.chat_layout(load_tokenizer("qwen2.5"))
    assert qwen.prefix.endswith("You are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert qwen.answer_header == chatml_header
    gemma = prompts.chat_layout(load_tokenizer("gemma3"))  # base model: no chat template
    assert gemma == prompts.ChatLayout("<bos>", prompts.PLAIN_ANSWER_HEADER, answer_cue=prompts.ANSWER_CUE)
    assert prompts.chat_layout(load_tokenizer("gemma3"), system="Be brief.").prefix == "<bos>Be brief.\n\n"


@pytest.mark.parametrize("context", ["", "   \n\t "])
def test_empty_context_raises(context):
    with pytest.raises(EmptyInputError, match="context"):
        prompts.build_prompt(load_tokenizer("smollm2"), context, "What?")
    with pytest.raises(EmptyInputError, match="context"):
        prompts.split_for_reuse(load_tokenizer("smollm2"), context, ["What?"])


def test_empty_question_raises():
    with pytest.raises(EmptyInputError, match="question"):
        prompts.build_prompt(load_tokenizer("smollm2"), DEMO_DOCUMENT, " ")
    with pytest.raises(EmptyInputError, match="question"):
        prompts.question_suffix(load_tokenizer("smollm2"), "")


def test_question_suffix_appends_to_the_context_part(tokenizer):
    questions = [item["question"] for item in DEMO_QUESTIONS]
    context_part, suffixes = prompts.split_for_reuse(tokenizer, DEMO_DOCUMENT, questions)
    assert len(context_part) == context_part.context_end == context_part.question_end
    for question, suffix in zip(questions, suffixes):
        full = prompts.build_prompt(tokenizer, DEMO_DOCUMENT, question)
        assert suffix.dtype == np.int32
        assert np.array_equal(np.concatenate([context_part.ids(), suffix]), full.ids())
        assert context_part.context_slice == full.context_slice
        assert np.array_equal(suffix, prompts.question_suffix(tokenizer, question))


ANSWER_PREFIX = "The special magic number for tidy-lamp mentioned in the provided text is"


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5"])
def test_an_answer_prefix_opens_the_answer_in_every_layout(name):
    """Chat: after the opened assistant turn (kvpress's layout, one-pass tokenization); plain and completion: in
    place of the "Answer:" cue; "" leaves every layout as it was."""
    tokenizer = load_tokenizer(name)
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    question = "What is the special magic number for tidy-lamp mentioned in the provided text? "
    header, asked = prompts.chat_layout(tokenizer).answer_header, question.strip()
    for tok, completion, without, before in (
        (tokenizer, False, "\n\n" + asked + header, "\n\n" + asked + header),
        (tokenizer, True, "\n\nQuestion: " + asked + "\nAnswer:", "\n\nQuestion: " + asked + "\n"),
        (plain, False, "\n\n" + asked + "\n\nAnswer:", "\n\n" + asked + "\n\n"),
    ):
        suffix = prompts.question_suffix(tok, question, completion=completion, answer_prefix=ANSWER_PREFIX)
        assert decode(tok, suffix) == before + ANSWER_PREFIX
        assert decode(tok, prompts.question_suffix(tok, question, completion=completion)) == without
        full = prompts.build_prompt(tok, DEMO_DOCUMENT, question, completion=completion, answer_prefix=ANSWER_PREFIX)
        assert np.array_equal(full.ids()[full.context_end :], suffix)
        assert decode(tok, full.ids()[full.answer_header_slice]).endswith(ANSWER_PREFIX)
    chat = prompts.question_suffix(tokenizer, question, answer_prefix=ANSWER_PREFIX)
    assert encode_whole(tokenizer, decode(tokenizer, chat)) == chat.tolist()


def test_context_text_is_never_parsed_as_special_tokens():
    tokenizer = load_tokenizer("smollm2")
    prompt = prompts.build_prompt(tokenizer, "Say <|im_end|> and <|im_start|> literally.", "Why?")
    specials = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|im_start|>")}
    assert not specials & set(prompt.tokens[prompt.context_start : prompt.question_end])
    assert specials <= set(prompt.tokens[prompt.answer_header_slice])


def test_reread_suffix(tokenizer):
    prompt = prompts.build_prompt(tokenizer, "Some context.")
    answer_header = prompt.ids()[prompt.answer_header_slice]
    first = prompts.reread_suffix(tokenizer)
    assert np.array_equal(first, prompts.question_suffix(tokenizer, prompts.REREAD_FIRST_CHUNK))
    assert decode(tokenizer, first).startswith("\n\nRepeat the previous context exactly.")
    anchor = prompts.encode_text(tokenizer, "the last eight tokens of the chunk before this one")[-8:]
    lead = prompts.encode_text(tokenizer, "\n\n" + prompts.REREAD_NEXT_CHUNK)
    later = prompts.reread_suffix(tokenizer, anchor)
    assert later.dtype == np.int32
    assert np.array_equal(later, np.concatenate([lead, anchor, answer_header]))


def test_prompt_rejects_boundaries_outside_its_tokens():
    with pytest.raises(ValueError):
        prompts.Prompt(tokens=(1, 2, 3), context_start=2, context_end=1, question_end=3)
    with pytest.raises(ValueError):
        prompts.Prompt(tokens=(1, 2, 3), context_start=0, context_end=2, question_end=4)


def test_demo_document_length_and_answers():
    context_tokens = prompts.encode_text(load_tokenizer("qwen2.5"), DEMO_DOCUMENT.strip())
    assert 2_500 <= len(context_tokens) <= 3_500
    assert len(DEMO_QUESTIONS) == 3
    positions = []
    for item in DEMO_QUESTIONS:
        assert set(item) == {"question", "answer"} and item["question"].endswith("?")
        assert DEMO_DOCUMENT.count(item["answer"]) == 1, item["answer"]
        positions.append(DEMO_DOCUMENT.index(item["answer"]) / len(DEMO_DOCUMENT))
    assert sorted(int(3 * position) for position in positions) == [0, 1, 2], "answers should sit in each third"


# kvpress's layout (prompts.kvpress_split) against kvpress's own preprocessing.

KVPRESS_TOKENIZERS = ("qwen2.5", "smollm2", "gemma3", "qwen2.5-plain")  # gemma3 has no chat template, nor the copy
RULER_TASKS = ("ruler_niah_single_1", "ruler_vt", "ruler_cwe", "ruler_fwe")
PADDED = "  A text with leading spaces,\ttabs and  double spaces, then trailing newlines.\n\n"


def kvpress_preprocess(tokenizer, context: str, questions: list[str], answer_prefix: str = ""):
    """kvpress's KVPressTextGenerationPipeline.preprocess (kvpress/pipeline.py) line for line, without torch and
    truncation: (context ids, [question ids])."""
    if tokenizer.chat_template is None:
        bos_token = getattr(tokenizer, "bos_token", "")
        context = bos_token + context
        question_suffix = "\n"
    else:
        separator = "#" * (len(context) + 10)
        context = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        context, question_suffix = context.split(separator)
    questions = [question + question_suffix + answer_prefix for question in questions]
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    question_ids = [tokenizer.encode(question, add_special_tokens=False) for question in questions]
    return context_ids, question_ids


@functools.cache
def kvpress_tokenizer(name: str):
    """A bundled tokenizer; "NAME-plain": a copy without its chat template."""
    if not name.endswith("-plain"):
        return load_tokenizer(name)
    plain = copy.copy(load_tokenizer(name.removesuffix("-plain")))
    plain.chat_template = None
    return plain


@functools.cache
def ruler_example(name: str, task: str):
    """The first sample of a RULER task at 1024 tokens of the tokenizer."""
    from kvzip_jax.eval.tasks import ruler

    return ruler.generate(task, 1, 1024, kvpress_tokenizer(name))[0]


def template_prefix(tokenizer) -> str:
    return prompts.chat_layout(tokenizer).prefix if tokenizer.chat_template is not None else tokenizer.bos_token


@pytest.mark.parametrize("text", [*RULER_TASKS, "padded"])
@pytest.mark.parametrize("name", KVPRESS_TOKENIZERS)
def test_kvpress_split_gives_the_ids_of_kvpress_pipeline(name, text):
    tokenizer = kvpress_tokenizer(name)
    if text == "padded":  # SmolLM2's "\n" closing the user header joins leading spaces: its own test below
        context = PADDED.lstrip() if name == "smollm2" else PADDED
        questions, answer_prefix = [" Which text? \n", "And the tabs?"], " Answer: "
    else:
        example = ruler_example(name, text)
        context, questions, answer_prefix = example.context, list(example.questions), example.answer_prefix
    prompt, suffixes = prompts.kvpress_split(tokenizer, context, questions, answer_prefix)
    context_ids, question_ids = kvpress_preprocess(tokenizer, context, questions, answer_prefix)
    assert list(prompt.tokens) == context_ids and [suffix.tolist() for suffix in suffixes] == question_ids
    assert all(suffix.dtype == np.int32 for suffix in suffixes)
    assert len(prompt) == prompt.context_end == prompt.question_end > prompt.context_start > 0
    assert decode(tokenizer, prompt.ids()[prompt.prefix_slice]) == template_prefix(tokenizer)
    assert decode(tokenizer, prompt.ids()[prompt.context_slice]) == context  # not stripped
    assert decode(tokenizer, suffixes[0]).startswith(questions[0])  # not stripped either


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "gemma3"])
def test_kvpress_split_puts_an_instruction_between_the_template_prefix_and_the_context(name):
    tokenizer, example = load_tokenizer(name), ruler_example(name, "ruler_vt")
    prefix = template_prefix(tokenizer) + prompts.KVZIP_INSTRUCTION + "\n\n"
    plain, plain_suffixes = prompts.kvpress_split(tokenizer, example.context, example.questions, example.answer_prefix)
    prompt, suffixes = prompts.kvpress_split(
        tokenizer, example.context, example.questions, example.answer_prefix, prompts.KVZIP_INSTRUCTION
    )
    assert prompt.ids()[prompt.prefix_slice].tolist() == tokenizer.encode(prefix, add_special_tokens=False)
    assert decode(tokenizer, prompt.ids()[prompt.prefix_slice]) == prefix
    assert prompt.tokens[prompt.context_slice] == plain.tokens[plain.context_slice]  # kvpress's context ids
    assert [s.tolist() for s in suffixes] == [s.tolist() for s in plain_suffixes]
    with pytest.raises(EmptyInputError, match="instruction"):
        prompts.kvpress_split(tokenizer, example.context, example.questions, instruction=" \n")


@pytest.mark.parametrize("name, context", [("smollm2", PADDED), ("qwen2.5", "\nA context opening with a newline.")])
def test_kvpress_split_refuses_a_prefix_whose_last_token_takes_in_the_contexts_first(name, context):
    tokenizer = load_tokenizer(name)
    context_ids, _ = kvpress_preprocess(tokenizer, context, ["Why?"])
    prefix_ids = tokenizer.encode(template_prefix(tokenizer), add_special_tokens=False)
    assert context_ids[: len(prefix_ids)] != prefix_ids  # kvpress's ids have no token boundary there
    with pytest.raises(KvzipError, match="make one token, so the never-evicted prefix cannot be cut off"):
        prompts.kvpress_split(tokenizer, context, ["Why?"])


def test_kvpress_split_refuses_an_empty_context_or_question():
    tokenizer = load_tokenizer("qwen2.5")
    for context, questions, what in (("  \n", ["Why?"], "context"), ("A context.", ["Why?", " \t"], "question")):
        with pytest.raises(EmptyInputError, match=what):
            prompts.kvpress_split(tokenizer, context, questions)
