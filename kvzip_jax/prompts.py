"""The token layout KVzip needs: [prefix | context | question | answer header].

  prefix         BOS, the system turn, the user-turn header and an optional task instruction (KVzip's
                 KVZIP_INSTRUCTION + "\\n\\n"): everything before the context; never evicted
  context        the document to compress (the only evictable segment)
  question       "\\n\\n" + question; empty when there is no question; appended after the (compressed) context cache
  answer header  end of the user turn + start of the assistant turn (KVzip's "postfix"), e.g. ChatML
                 "<|im_end|>\\n<|im_start|>assistant\\n"

The layout comes from the tokenizer's chat template, rendered once around a marker in place of the user message.
A tokenizer without a template (Gemma 3 base) gets a plain layout: [BOS | system "\\n\\n" | context | question |
"\\n\\nAnswer:"]. A base model (not instruction-tuned; weights.registry.BASE_MODELS) is asked with completion=True,
whatever template its tokenizer carries: [BOS | system "\\n\\n" | context | "\\n\\nQuestion: " + question |
"\\nAnswer:"], the answer ending at a newline (stop_token_ids(..., completion=True)): a text a pretrained model
continues with the answer, where it continues the plain layout with more questions of its own. KVzip's reread keeps
the default layout.

An answer prefix (kvpress's answer_prefix, e.g. RULER's "The special magic number for ... is") opens the answer:
under a chat template it follows the answer header (the assistant turn opened), as kvpress feeds it; in the plain
and completion layouts it takes the place of the header's "Answer:" cue, after its line break. With "" (none) every
layout is as above.

Each segment is tokenized on its own and the ids are concatenated, so boundaries are exact, and every build checks
that the ids decode to exactly the template's rendering. Merge caveat: tokenizing the whole rendering at once can
differ at a segment join. Qwen's pre-tokenizer glues punctuation to the newlines after it, so a context ending in "."
followed by the question's "\\n\\n" is [".", "\\n\\n"] here but [".\\n\\n"] in one pass. Both decode to the same text,
and the split form is what KVzip itself feeds (it encodes context and query separately); it is also the only form
that lets one context cache serve many questions. Context and question are stripped of surrounding whitespace
(templates such as Gemma's trim message content, and a file's final newline would otherwise join the separator).
Text inside the context and question is never parsed as special tokens.

kvpress_split lays a prompt out as kvpress's pipeline does instead (its ids are kvpress's): [template prefix |
context] tokenized in one pass, then per question [question | end of turn + answer header | answer prefix] in one
pass, texts kept as they are and special-token strings parsed; without a chat template, BOS text before the context
and "\\n" after each question. An instruction's ids go between the template prefix and the context's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvzip_jax.errors import EmptyInputError, KvzipError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

QUESTION_SEPARATOR = "\n\n"
INSTRUCTION_SEPARATOR = "\n\n"
KVZIP_INSTRUCTION = "Given the context, answer to the following question or request without explanation."
PLAIN_ANSWER_HEADER = "\n\nAnswer:"
COMPLETION_QUESTION_LEAD = "\n\nQuestion: "
COMPLETION_ANSWER_HEADER = "\nAnswer:"
ANSWER_CUE = "Answer:"  # ends the plain and completion answer headers; an answer prefix takes its place
COMPLETION_STOPS = ("\n", "\n\n")  # an answer to a completion prompt ends at the end of its line
REREAD_FIRST_CHUNK = "Repeat the previous context exactly."
REREAD_NEXT_CHUNK = "Repeat the part of the previous context exactly, starting with "
_USER_MESSAGE_MARKER = "\x00kvzip-user-message\x00"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Token ids with segment boundaries: prefix [0, context_start), context [context_start, context_end),
    question [context_end, question_end), answer header and answer prefix [question_end, len(tokens))."""

    tokens: tuple[int, ...]
    context_start: int
    context_end: int
    question_end: int

    def __post_init__(self):
        if not 0 <= self.context_start <= self.context_end <= self.question_end <= len(self.tokens):
            raise ValueError(
                f"segment boundaries {self.context_start}, {self.context_end}, {self.question_end} "
                f"do not fit {len(self.tokens)} tokens"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def ids(self) -> np.ndarray:
        """All token ids, int32 [T]."""
        return np.asarray(self.tokens, dtype=np.int32)

    @property
    def prefix_slice(self) -> slice:
        return slice(0, self.context_start)

    @property
    def context_slice(self) -> slice:
        return slice(self.context_start, self.context_end)

    @property
    def question_slice(self) -> slice:
        return slice(self.context_end, self.question_end)

    @property
    def answer_header_slice(self) -> slice:
        return slice(self.question_end, len(self.tokens))


@dataclasses.dataclass(frozen=True)
class ChatLayout:
    """The text a chat template puts around the user message, what leads a question in it, and the cue ending a
    text answer header that an answer prefix takes the place of ("" under a chat template: the prefix follows)."""

    prefix: str
    answer_header: str
    question_lead: str = QUESTION_SEPARATOR
    answer_cue: str = ""

    def header_before(self, answer_prefix: str) -> str:
        """The answer header as it stands before answer_prefix: the whole header when answer_prefix is "", else the
        header without its cue."""
        return self.answer_header.removesuffix(self.answer_cue) if answer_prefix else self.answer_header


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer puts BOS before a text of its own accord, asked by tokenizing (its `add_bos_token`
    attribute does not survive every save_pretrained round trip: Gemma's reads False after one)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos]


def chat_layout(tokenizer: PreTrainedTokenizerBase, system: str | None = None, completion: bool = False) -> ChatLayout:
    """Renders the tokenizer's chat template around a marker; the plain layout when it has no template; the
    completion layout (a base model's) with completion=True."""
    if completion or tokenizer.chat_template is None:
        prefix = (tokenizer.bos_token if _adds_bos(tokenizer) else "") + (system + "\n\n" if system else "")
        if completion:
            return ChatLayout(prefix, COMPLETION_ANSWER_HEADER, COMPLETION_QUESTION_LEAD, ANSWER_CUE)
        return ChatLayout(prefix, PLAIN_ANSWER_HEADER, answer_cue=ANSWER_CUE)
    rendered = _render(tokenizer, _USER_MESSAGE_MARKER, system)
    if rendered.count(_USER_MESSAGE_MARKER) != 1:
        raise KvzipError("the chat template does not place the user message exactly once; cannot find the layout")
    prefix, answer_header = rendered.split(_USER_MESSAGE_MARKER)
    return ChatLayout(prefix=prefix, answer_header=answer_header)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> np.ndarray:
    """Token ids of plain text, int32 [T]: no BOS/EOS added, special-token strings kept as literal text."""
    return _encode(tokenizer, text, parse_special_tokens=False)


def named_instruction(value: str | None) -> str | None:
    """A task instruction from its command-line form: "kvzip" -> KVZIP_INSTRUCTION, None or "none" -> None, any
    other text as it is."""
    return {"kvzip": KVZIP_INSTRUCTION, "none": None}.get(value, value) if value is not None else None


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str | None = None,
    system: str | None = None,
    instruction: str | None = None,
    completion: bool = False,
    answer_prefix: str = "",
) -> Prompt:
    """Lays out [prefix | context | question | answer header + answer prefix]; the user message is [instruction +
    "\\n\\n"] + context + "\\n\\n" + question.

    system replaces the template's default system prompt (None keeps the default). instruction (e.g.
    KVZIP_INSTRUCTION, which KVzip puts before every context) opens the user message and belongs to the prefix, so
    it is never evicted; None: no instruction. completion: a base model's completion layout, no chat template.
    answer_prefix: the text the answer starts with, kept as it is (not stripped); "" for none.
    Raises EmptyInputError on an empty context, question or instruction, KvzipError when the template alters the
    message or the ids do not decode to it.
    """
    context = _stripped(context, "context")
    layout = chat_layout(tokenizer, system, completion)
    question_text = "" if question is None else layout.question_lead + _stripped(question, "question")
    lead = "" if instruction is None else _stripped(instruction, "instruction") + INSTRUCTION_SEPARATOR
    header = layout.header_before(answer_prefix)
    segments = (
        _encode(tokenizer, layout.prefix, parse_special_tokens=True),
        encode_text(tokenizer, lead),
        encode_text(tokenizer, context),
        encode_text(tokenizer, question_text),
        _encode(tokenizer, header, parse_special_tokens=True),
        encode_text(tokenizer, answer_prefix),
    )
    user_message = lead + context + question_text
    templated = not completion and tokenizer.chat_template is not None
    if templated and _render(tokenizer, user_message, system) != layout.prefix + user_message + layout.answer_header:
        raise KvzipError("the chat template alters the user message, so segment boundaries would not be exact")
    tokens = _checked_concatenation(tokenizer, segments, layout.prefix + user_message + header + answer_prefix)
    ends = np.cumsum([len(segment) for segment in segments])
    context_start, context_end, question_end = (int(end) for end in ends[1:4])
    return Prompt(tuple(tokens.tolist()), context_start, context_end, question_end)


def question_suffix(
    tokenizer: PreTrainedTokenizerBase,
    question: str,
    system: str | None = None,
    completion: bool = False,
    answer_prefix: str = "",
) -> np.ndarray:
    """[question | end of user turn | answer header | answer prefix] ids, int32 [T], to append after a
    [prefix | context] cache.

    Equal to the tokens after the context in build_prompt(tokenizer, context, question, system, completion=...,
    answer_prefix=...).
    """
    layout = chat_layout(tokenizer, system, completion)
    question_text = layout.question_lead + _stripped(question, "question")
    header = layout.header_before(answer_prefix)
    segments = (
        encode_text(tokenizer, question_text),
        _encode(tokenizer, header, parse_special_tokens=True),
        encode_text(tokenizer, answer_prefix),
    )
    return _checked_concatenation(tokenizer, segments, question_text + header + answer_prefix)


def follow_up(
    tokenizer: PreTrainedTokenizerBase, question: str, system: str | None = None, completion: bool = False
) -> np.ndarray:
    """[end of the assistant turn | next user turn: question | answer header] ids, int32 [T], to append after an
    answer (its stop token emitted, not fed) so that a conversation goes on: the chat template rendered around
    markers for an earlier answer and the next message, as chat_layout does for one turn. With completion=True, one
    more question of the completion layout (question_suffix)."""
    if completion:
        return question_suffix(tokenizer, question, system, completion=True)
    question = _stripped(question, "question")
    if tokenizer.chat_template is None:
        between, header = QUESTION_SEPARATOR, PLAIN_ANSWER_HEADER
    else:
        answer_marker, next_marker = _USER_MESSAGE_MARKER + "answer", _USER_MESSAGE_MARKER + "next"
        system_turn = [] if system is None else [{"role": "system", "content": system}]
        messages = system_turn + [
            {"role": "user", "content": "context"},
            {"role": "assistant", "content": answer_marker},
            {"role": "user", "content": next_marker},
        ]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(answer_marker) != 1 or rendered.count(next_marker) != 1:
            raise KvzipError("the chat template does not place each turn exactly once; cannot find the layout")
        between, header = rendered.split(answer_marker)[1].split(next_marker)
    segments = (
        _encode(tokenizer, between, parse_special_tokens=True),
        encode_text(tokenizer, question),
        _encode(tokenizer, header, parse_special_tokens=True),
    )
    return _checked_concatenation(tokenizer, segments, between + question + header)


def split_for_reuse(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    questions: Sequence[str],
    system: str | None = None,
    instruction: str | None = None,
    completion: bool = False,
    answer_prefix: str = "",
) -> tuple[Prompt, list[np.ndarray]]:
    """The [prefix | context] part to prefill once (a Prompt whose question and answer header are empty) and,
    per question, the suffix ids to append to that cache. system, instruction, completion and answer_prefix (every
    question's) as in build_prompt."""
    full = build_prompt(tokenizer, context, system=system, instruction=instruction, completion=completion)
    context_part = Prompt(full.tokens[: full.context_end], full.context_start, full.context_end, full.context_end)
    suffixes = [question_suffix(tokenizer, question, system, completion, answer_prefix) for question in questions]
    return context_part, suffixes


def kvpress_split(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    questions: Sequence[str],
    answer_prefix: str = "",
    instruction: str | None = None,
) -> tuple[Prompt, list[np.ndarray]]:
    """kvpress's layout (KVPressTextGenerationPipeline.preprocess), in split_for_reuse's shape: the [prefix | context]
    Prompt and, per question, the ids of question + question suffix + answer_prefix, int32 [T].

    Under a chat template the context is rendered as the user message (enable_thinking=False) with a run of "#" after
    it and cut there: the rendering before the cut is tokenized in one pass, the rest (end of turn, answer header)
    is the question suffix; without one the tokenizer's BOS text opens the context and the suffix is "\\n". Nothing
    is stripped. The prefix is the template's text before the context, its ids checked to open the one-pass ids.
    instruction: its ids (instruction + "\\n\\n", tokenized after the template prefix) go between the prefix and
    the context's ids, in the prefix; the context keeps kvpress's ids. Raises EmptyInputError on an empty context,
    question or instruction; KvzipError where the template prefix's ids do not open the one-pass ids (its last
    token takes in the context's first characters) or ids do not decode to their text.
    """
    _stripped(context, "context")
    for question in questions:
        _stripped(question, "question")
    lead = "" if instruction is None else _stripped(instruction, "instruction") + INSTRUCTION_SEPARATOR
    if tokenizer.chat_template is None:
        prefix = getattr(tokenizer, "bos_token", None) or ""
        text, suffix = prefix + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        parts = _render(tokenizer, context + separator, None, enable_thinking=False).split(separator)
        prefix_parts = _render(tokenizer, _USER_MESSAGE_MARKER, None, enable_thinking=False).split(_USER_MESSAGE_MARKER)
        if len(parts) != 2 or len(prefix_parts) != 2:
            raise KvzipError("the chat template does not place the user message exactly once; cannot find the layout")
        (text, suffix), prefix = parts, prefix_parts[0]
    if not text.startswith(prefix):
        raise KvzipError("the chat template alters the text before the context, so its prefix cannot be cut off")
    texts = [text, prefix, prefix + lead] + [question + suffix + answer_prefix for question in questions]
    ids = [np.asarray(tokenizer.encode(t, add_special_tokens=False), dtype=np.int32) for t in texts]
    (tokens, prefix_ids, lead_ids), suffixes = ids[:3], ids[3:]
    for opened, what in ((tokens, f"context's start {context[:16]!r}"), (lead_ids, "instruction's start")):
        if opened[: len(prefix_ids)].tolist() != prefix_ids.tolist():
            raise KvzipError(
                f"the template's prefix ({len(prefix_ids)} tokens) does not open the one-pass ids: its end and the "
                f"{what} make one token, so the never-evicted prefix cannot be cut off"
            )
    if any(_decode(tokenizer, part) != expected for part, expected in zip(ids, texts)):
        raise KvzipError("the ids of kvpress's layout do not decode to its text")
    tokens = np.concatenate([lead_ids, tokens[len(prefix_ids) :]])
    return Prompt(tuple(tokens.tolist()), len(lead_ids), len(tokens), len(tokens)), suffixes


def reread_suffix(
    tokenizer: PreTrainedTokenizerBase, anchor: Sequence[int] = (), system: str | None = None
) -> np.ndarray:
    """KVzip's reconstruction prompt, int32 [T], placed after the context cache and before the chunk to reread.

    First chunk (no anchor): "\\n\\nRepeat the previous context exactly." + answer header. Later chunks:
    "\\n\\nRepeat the part of the previous context exactly, starting with " + anchor (the previous chunk's last
    token ids, kept as raw ids; KVzip uses 8) + answer header.
    """
    if not len(anchor):
        return question_suffix(tokenizer, REREAD_FIRST_CHUNK, system)
    lead = encode_text(tokenizer, QUESTION_SEPARATOR + REREAD_NEXT_CHUNK)
    answer_header = _encode(tokenizer, chat_layout(tokenizer, system).answer_header, parse_special_tokens=True)
    return np.concatenate([lead, np.asarray(anchor, dtype=np.int32), answer_header])


def _stripped(text: str, what: str) -> str:
    if not text or not text.strip():
        raise EmptyInputError(f"the {what} is empty")
    return text.strip()


def _render(tokenizer: PreTrainedTokenizerBase, user_message: str, system: str | None, **options) -> str:
    system_turn = [] if system is None else [{"role": "system", "content": system}]
    messages = system_turn + [{"role": "user", "content": user_message}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, parse_special_tokens: bool) -> np.ndarray:
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=not parse_special_tokens)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


def _decode(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _checked_concatenation(
    tokenizer: PreTrainedTokenizerBase, segments: Sequence[np.ndarray], expected_text: str
) -> np.ndarray:
    """Concatenated ids, int32 [T]; raises KvzipError unless they decode to expected_text."""
    tokens = np.concatenate(segments).astype(np.int32)
    if _decode(tokenizer, tokens) != expected_text:
        raise KvzipError("the concatenated segment ids do not decode to the template's text")
    return tokens


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, completion: bool = False) -> tuple[int, ...]:
    """Tokens that end an answer: the tokenizer's EOS and the chat templates' end-of-turn markers it knows; with
    completion=True also its one-token newlines (COMPLETION_STOPS), where an answer to a completion prompt ends."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids.update(vocab[marker] for marker in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>") if marker in vocab)
    if completion:
        newlines = [encode_text(tokenizer, text) for text in COMPLETION_STOPS]
        ids.update(int(newline[0]) for newline in newlines if len(newline) == 1)
    return tuple(sorted(ids))
