"""kvzip-jax chat driven through stdin on a tiny random model with SmolLM2's tokenizer: two turns answered, the second
conditioned on the first (its tokens are those of the multi-turn layout computed through the API), the answers streamed
in pieces, /bytes and /reset, a clean exit on EOF (Ctrl-D)."""

import io
import sys

import jax

from kvzip_jax import cache as kv
from kvzip_jax import cli, kvzip, prompts
from kvzip_jax import generate as gen
from tests.test_cli import CONTEXT, QUESTION, restored, smollm2_checkpoint, tiny  # noqa: F401 (fixtures)

FOLLOW_UP = "Repeat that name."


class Writes(io.StringIO):
    """stdout that records each write (a streamed answer arrives in several)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def _expected_answers(model, max_new: int):
    """The two answers through the API: compress as the chat does, then [question | answer | follow-up]."""
    context, _ = prompts.split_for_reuse(model.tokenizer, CONTEXT, [])
    _, cache = gen.prefill(model.params, model.cfg, [context.ids()])
    reread = kvzip.reread_inputs(model.tokenizer, [context.context_start], [context.ids()[context.context_slice]])
    masked, _ = jax.jit(kvzip.score_and_evict)(model.params, model.cfg, cache, reread, 0.5)
    cache = kv.pack(masked, 1024)
    stops = prompts.stop_token_ids(model.tokenizer)
    answers = []
    for ids in (prompts.question_suffix(model.tokenizer, QUESTION), None):
        ids = prompts.follow_up(model.tokenizer, FOLLOW_UP) if ids is None else ids
        logits, cache = gen.prefill(model.params, model.cfg, [ids], cache)
        answer, cache = gen.decode(model.params, model.cfg, logits, cache, max_new, stop_tokens=stops)
        answers.append(model.tokenizer.decode([t for t in answer[0] if t not in stops]))
    return answers


def test_two_turns_streamed_then_a_clean_exit(monkeypatch, tiny, tmp_path):
    context_file = tmp_path / "context.txt"
    context_file.write_text(CONTEXT)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n{FOLLOW_UP}\n/bytes\n/reset\n/bytes\n"))
    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["chat", "--model", "tiny", "--context", str(context_file), "--ratio", "0.5", "--max-new-tokens", "16"]
    assert cli.main(argv) == 0
    text = out.getvalue()
    first, second = _expected_answers(tiny, 16)
    assert f"> {first}\n> {second}\n" in text, text  # each answer printed after its prompt, in order
    assert first != second and len(first) > 0
    assert text.rstrip().endswith("bye")  # EOF after the last command: a clean exit
    conversation = [
        int(line.split("; ")[1].split()[0]) for line in text.splitlines() if "tokens of conversation" in line
    ]
    assert conversation[0] > 0 and conversation[1] == 0  # /reset drops the turns, keeps the document
    pieces = [w for w in out.writes if w and w != "\n" and not w.startswith(("> ", "KV cache", "commands"))]
    assert len(pieces) >= 3  # streamed: the answers arrived in several writes
