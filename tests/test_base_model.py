"""A base model (gemma3-270m) is asked with a completion prompt, not a chat template, and the CLI says so: the
registry knows which bundled models are base models; the completion layout holds no chat-template token and its
answers end at a newline; compress and chat print one line (a tiny random model counted as base, to be fast)."""

import io
import re
import sys

import numpy as np

from kvzip_jax import cli, prompts
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer
from tests.test_cli import CONTEXT, QUESTION, restored, smollm2_checkpoint, tiny  # noqa: F401 (fixtures)

NOTE = "is a base model (not instruction-tuned): questions are asked as a plain completion prompt; expect weak answers"


def test_gemma3_270m_is_the_one_bundled_base_model():
    assert registry.BASE_MODELS == {registry.GEMMA}


def test_the_completion_layout_holds_no_chat_template_token():
    tokenizer = bundled_tokenizer(registry.SMOLLM2)  # a tokenizer with a chat template (ChatML)
    prompt = prompts.build_prompt(tokenizer, CONTEXT, QUESTION, completion=True)
    text = tokenizer.decode(list(prompt.tokens), skip_special_tokens=False)
    assert text.endswith(f"{CONTEXT}\n\nQuestion: {QUESTION}\nAnswer:") and "<|im_" not in text
    assert prompt.context_start <= 1  # BOS at most: no system turn, no user-turn header
    context, suffixes = prompts.split_for_reuse(tokenizer, CONTEXT, [QUESTION], completion=True)
    assert np.array_equal(np.concatenate([context.ids(), suffixes[0]]), prompt.ids())
    assert np.array_equal(prompts.follow_up(tokenizer, QUESTION, completion=True), suffixes[0])
    newline = prompts.encode_text(tokenizer, "\n").tolist()
    assert newline[0] in prompts.stop_token_ids(tokenizer, completion=True)
    assert newline[0] not in prompts.stop_token_ids(tokenizer)


def test_gemma_questions_are_labelled_and_end_at_a_newline():
    tokenizer = bundled_tokenizer(registry.GEMMA)
    suffix = prompts.question_suffix(tokenizer, QUESTION, completion=True)
    assert tokenizer.decode(suffix.tolist()) == f"\n\nQuestion: {QUESTION}\nAnswer:"
    stops = prompts.stop_token_ids(tokenizer, completion=True)
    assert {int(prompts.encode_text(tokenizer, text)[0]) for text in ("\n", "\n\n")} <= set(stops)


def _prefix_tokens(out: str) -> int:
    return int(re.search(r"\((\d+) prefix \+ ", out).group(1))


def test_compress_on_a_base_model_says_so_and_prefills_no_chat_turn(capsys, monkeypatch, tiny, tmp_path):
    context_file = tmp_path / "context.txt"
    context_file.write_text(CONTEXT)
    argv = [
        "compress",
        "--model",
        "tiny",
        "--context",
        str(context_file),
        "--ratio",
        "0.5",
        "--question",
        QUESTION,
        "--max-new-tokens",
        "2",
    ]
    assert cli.main(argv) == 0
    chat_turn = capsys.readouterr().out
    assert NOTE not in chat_turn
    monkeypatch.setattr(registry, "BASE_MODELS", frozenset({tiny.name}))
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(NOTE) == 1 and f"{tiny.name} {NOTE}" in out
    completion, _ = prompts.split_for_reuse(tiny.tokenizer, CONTEXT, [], completion=True)
    assert _prefix_tokens(out) == completion.context_start < _prefix_tokens(chat_turn)
    assert f"Q: {QUESTION}\nA: " in out


def test_chat_on_a_base_model_says_so(monkeypatch, capsys, tiny, tmp_path):
    context_file = tmp_path / "context.txt"
    context_file.write_text(CONTEXT)
    monkeypatch.setattr(registry, "BASE_MODELS", frozenset({tiny.name}))
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n"))
    argv = ["chat", "--model", "tiny", "--context", str(context_file), "--ratio", "0.5", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(NOTE) == 1 and out.rstrip().endswith("bye")
