"""RULER's length rule: a prompt (answer prefix included) plus the task's max new tokens must fit max_seq_length
tokens. The haystack size is the largest that fits a probe draw (a binary search over sizes); a sample that then
does not fit is drawn again one haystack step smaller."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Redraw(Exception):
    """A draw that RULER's generator fails on (a duplicated variable name) and draws again."""


def token_counter(tokenizer) -> Callable[[str], int]:
    """A function text -> token count. A HF tokenizer (anything with .tokenize) counts len(tokenizer.tokenize(text)),
    RULER's count for HF tokenizers (no special tokens); any other callable is taken as the count itself."""
    if hasattr(tokenizer, "tokenize"):
        return lambda text: len(tokenizer.tokenize(text))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"need a HF tokenizer or a callable counting tokens, got {type(tokenizer).__name__}")


def largest_fitting(fits: Callable[[int], bool], lower: int, upper: int) -> int | None:
    """The binary search over sizes lower..upper: a size that fits moves the search up, one that does not moves it
    down; the largest size that fitted when tried, or None. fits may draw at random (each try is a fresh draw)."""
    best = None
    while lower <= upper:
        middle = (lower + upper) // 2
        if fits(middle):
            best, lower = middle, middle + 1
        else:
            upper = middle - 1
    return best


def draw_fitting(draw: Callable[[int], T], length: Callable[[T], int], size: int, step: int, max_length: int) -> T:
    """One sample: draw(size), drawn again `step` smaller while it raises Redraw or length(sample) > max_length and
    size > step (at size <= step a Redraw is drawn again at that size). ValueError where a sample at size <= step
    does not fit, where RULER would draw for ever."""
    while True:
        try:
            sample = draw(size)
        except Redraw:
            sample = None
        if sample is not None and length(sample) <= max_length:
            return sample
        if size > step:
            size -= step
        elif sample is not None:
            raise ValueError(f"no sample fits {max_length} tokens, even with the smallest haystack ({size})")
