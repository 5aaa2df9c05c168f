"""Haystack filler: real English prose, the docstrings of Python standard-library modules.

The text exists wherever Python does, so the tasks need no download, and it is fixed for a given Python version.
Docstrings (module, class and function, read from the source files) are cut into sentences; code, doctests, tables
and shouting are left out. Python's own LICENSE text is appended when found under sys.base_prefix.

    sentences = draw(rng, 900)                             # a contiguous run of about 900 tokens
    context = insert_needles(sentences, [needle], [0.3])   # the needle between two sentences, 30% deep
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# Prose-rich modules first; modules missing from an installation are skipped.
MODULES = (
    "copy",
    "sched",
    "cmd",
    "socketserver",
    "heapq",
    "doctest",
    "unittest",
    "pdb",
    "timeit",
    "argparse",
    "subprocess",
    "configparser",
    "statistics",
    "tempfile",
    "difflib",
    "typing",
    "inspect",
    "random",
    "json",
    "collections",
    "pathlib",
    "pydoc",
    "textwrap",
    "shlex",
    "csv",
    "pickle",
    "threading",
    "fractions",
    "contextlib",
    "functools",
    "zipfile",
    "tarfile",
    "smtplib",
    "mailbox",
    "calendar",
    "locale",
    "gettext",
    "shelve",
    "fileinput",
    "shutil",
    "queue",
    "socket",
    "turtle",
    "pyclbr",
    "tokenize",
)
MIN_WORDS = 5
MIN_LETTER_SHARE = 0.85  # letters and spaces among a sentence's characters; lower is code or a table
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def approx_tokens(text: str) -> int:
    """Token count without a tokenizer: one token per four characters, rounded up."""
    return -(-len(text) // 4)


def split_sentences(text: str) -> list[str]:
    """The sentences of a text, whitespace collapsed: a break after . ! or ? followed by a capital letter."""
    flat = " ".join(text.split())
    return _SENTENCE_BREAK.split(flat) if flat else []


def is_prose(sentence: str) -> bool:
    """Whether a sentence reads as English prose: a capital start, a full stop, enough words, mostly lower-case
    letters."""
    letters = sum(c.isalpha() or c.isspace() for c in sentence)
    lower = sum(c.islower() for c in sentence)
    return (
        len(sentence.split()) >= MIN_WORDS
        and sentence[0].isupper()
        and sentence[-1] in ".!?"
        and letters >= MIN_LETTER_SHARE * len(sentence)
        and 2 * lower > sum(c.isalpha() for c in sentence)
    )


def prose_sentences(text: str) -> list[str]:
    """The prose sentences of a text, in order; indented paragraphs and doctests (code, tables) are skipped."""
    found = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        lines = paragraph.strip("\n").split("\n")
        if lines[0][:1].isspace() or any(line.lstrip().startswith(">>>") for line in lines):
            continue
        found.extend(s for s in split_sentences(paragraph) if is_prose(s))
    return found


def module_source(name: str) -> Path | None:
    """The source file of a standard-library module (a .py file or a package's __init__.py), found in the stdlib
    folder itself so that a same-named file on sys.path cannot stand in; None where this installation lacks it."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    for path in (stdlib / f"{name}.py", stdlib / name / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_docstrings(name: str) -> list[str]:
    """Every docstring of a standard-library module's source (module, classes, functions), in a fixed order;
    [] where the source is missing."""
    source = module_source(name)
    if source is None:
        return []
    nodes = (
        n
        for n in ast.walk(ast.parse(source.read_text(encoding="utf-8")))
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    )
    return [doc for doc in map(ast.get_docstring, nodes) if doc]


def license_text() -> str:
    """Python's LICENSE text under sys.base_prefix, or "" where this installation has none."""
    for path in (Path(sysconfig.get_path("stdlib"), "LICENSE.txt"), Path(sys.base_prefix, "LICENSE.txt")):
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    return ""


@functools.cache
def sentences() -> tuple[str, ...]:
    """The corpus: distinct prose sentences of MODULES' docstrings, then of Python's LICENSE, first occurrence kept."""
    texts = [doc for name in MODULES for doc in module_docstrings(name)] + [license_text()]
    return tuple(dict.fromkeys(s for text in texts for s in prose_sentences(text)))


def draw(rng: np.random.Generator, num_tokens: int, count_tokens: Callable[[str], int] = approx_tokens) -> list[str]:
    """A contiguous run of corpus sentences from a random start, wrapping at the end, of about num_tokens tokens:
    the last sentence is kept only if it brings the total closer to num_tokens."""
    corpus = sentences()
    start = int(rng.integers(len(corpus)))
    run, total = [], 0
    while total < num_tokens:
        sentence = corpus[(start + len(run)) % len(corpus)]
        tokens = count_tokens(sentence)
        if total + tokens - num_tokens > num_tokens - total:
            break
        run.append(sentence)
        total += tokens
    return run


def spread_depths(rng: np.random.Generator, count: int) -> list[float]:
    """count depths in [0, 1), ascending: one drawn uniformly in each of count equal strata."""
    return [(i + float(rng.random())) / count for i in range(count)]


def insert_needles(haystack: Sequence[str], needles: Sequence[str], depths: Sequence[float]) -> str:
    """The haystack sentences joined by spaces, each needle sentence put at its depth (0 before the first sentence,
    1 after the last) at the nearest sentence boundary; needles at the same boundary keep their given order."""
    if len(needles) != len(depths):
        raise ValueError(f"{len(needles)} needles but {len(depths)} depths")
    if any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    boundaries: list[list[str]] = [[] for _ in range(len(haystack) + 1)]
    for needle, depth in zip(needles, depths):
        boundaries[round(depth * len(haystack))].append(needle)
    parts = []
    for boundary, sentence in zip(boundaries, haystack):
        parts.extend(boundary)
        parts.append(sentence)
    parts.extend(boundaries[-1])
    return " ".join(parts)


def plant(
    rng: np.random.Generator,
    needles: Sequence[str],
    context_tokens: int,
    count_tokens: Callable[[str], int] = approx_tokens,
) -> str:
    """A context of about context_tokens tokens: a drawn haystack with the needle sentences at spread depths (one
    per stratum, in the given order)."""
    sentences = draw(rng, context_tokens - sum(map(count_tokens, needles)), count_tokens)
    return insert_needles(sentences, needles, spread_depths(rng, len(needles)))
