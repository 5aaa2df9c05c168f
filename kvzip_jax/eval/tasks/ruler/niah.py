"""RULER's needle-in-a-haystack generator: K keys with V values each, one needle
"One of the special magic {kind} for {key} is: {value}." per value, in a haystack of noise lines, of Paul Graham
essay sentences, or of distractor needles; Q of the keys asked for, every value of theirs expected."""

from __future__ import annotations

import dataclasses
import functools
import random
import uuid
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks.ruler import corpus
from kvzip_jax.eval.tasks.ruler.length import draw_fitting, largest_fitting
from kvzip_jax.eval.tasks.ruler.sample import Sample
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import NEEDLE, NIAH, NOISE, singular

DEPTHS = tuple(int(depth) for depth in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
ESSAY_STEP = 500  # words
LINE_STEP, SHORT_LINE_STEP = 25, 5  # lines; the short step below 4096 tokens


@dataclasses.dataclass(frozen=True)
class Config:
    """haystack: "noise", "essay" or "needle"; key_type, value_type: "words", "numbers" or "uuids" (plural, as the
    needles say them); num_keys (raised to num_queries), num_values per key, num_queries."""

    haystack: str
    key_type: str
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


def random_item(rng: random.Random, kind: str) -> str:
    """A 7-digit number, an adjective-noun word or a version-4 UUID, as a string."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return rng.choice(corpus.pair_words())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def essay_context(rng: random.Random, size: int, needles: list[str]) -> str:
    """The first `size` essay words, Punkt-split; the needles, in order, at sorted sentence boundaries
    int(#sentences x depth / 100) for depths drawn without replacement from DEPTHS; all joined by spaces."""
    sentences = corpus.essay_sentences(size)
    cuts = sorted(int(len(sentences) * (depth / 100)) for depth in rng.sample(DEPTHS, len(needles)))
    bounds = [0, *cuts, len(sentences)]
    pieces = [" ".join(sentences[start:stop]) for start, stop in zip(bounds, bounds[1:])]
    parts = pieces[:1] + [part for needle, piece in zip(needles, pieces[1:]) for part in (needle, piece)]
    return " ".join(parts)


def line_context(rng: random.Random, lines: list[str], needles: list[str]) -> str:
    """The lines with the needles inserted at distinct drawn line indexes (the first needle at the largest index,
    each inserted before the line there), joined by newlines."""
    lines = list(lines)
    for index, needle in zip(sorted(rng.sample(range(len(lines)), len(needles)), reverse=True), needles):
        lines.insert(index, needle)
    return "\n".join(lines)


def draw(config: Config, streams: Streams, size: int) -> Sample:
    """One prompt with a haystack of `size` units (essay words or lines). Draw order: each key, then its values;
    the needles shuffled by a fresh Random(seed); the haystack; the queried keys."""
    rng, num_keys = streams.py, max(config.num_keys, config.num_queries)
    keys, values, needles = [], [], []
    for _ in range(num_keys):
        keys.append(random_item(rng, config.key_type))
        values.append([random_item(rng, config.value_type) for _ in range(config.num_values)])
        needles += [NEEDLE.format(kind=config.value_type, key=keys[-1], value=value) for value in values[-1]]
    streams.fresh().shuffle(needles)
    if config.haystack == "essay":
        context = essay_context(rng, size, needles)
    elif config.haystack == "noise":
        context = line_context(rng, [NOISE] * size, needles)
    elif config.haystack == "needle":
        lines = []
        for _ in range(size):
            key = random_item(rng, config.key_type)
            lines.append(NEEDLE.format(kind=config.value_type, key=key, value=random_item(rng, config.value_type)))
        context = line_context(rng, lines, needles)
    else:
        raise ValueError(f"unknown haystack {config.haystack!r}")
    queried = rng.sample(range(num_keys), config.num_queries)
    queries = [keys[i] for i in queried]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    prompt, kind = NIAH.prompt, config.value_type
    if config.num_queries * config.num_values == 1:
        prompt, kind = singular(prompt), kind[:-1]
    answers = tuple(value for i in queried for value in values[i])
    return Sample(prompt.format(kind=kind, context=context, query=query), answers, size)


def step(config: Config, max_seq_length: int) -> int:
    """The haystack step: 500 essay words, else 25 lines (5 below 4096 tokens)."""
    if config.haystack == "essay":
        return ESSAY_STEP
    return SHORT_LINE_STEP if max_seq_length < 4096 else LINE_STEP


def samples(
    config: Config, streams: Streams, num_samples: int, max_seq_length: int, count: Callable[[str], int]
) -> list[Sample]:
    """num_samples samples whose prompt + 128 new tokens fit max_seq_length tokens. A probe draw of one step
    estimates the tokens per unit; the size is then searched in [step, max(3 x max_seq_length / that, 2 x step)]."""
    unit, draw_at = step(config, max_seq_length), functools.partial(draw, config, streams)
    length = lambda sample: count(sample.text) + NIAH.max_new_tokens
    per_unit = count(draw_at(unit).text) / unit
    upper = max(int((max_seq_length / per_unit) * 3), 2 * unit)
    size = largest_fitting(lambda n: length(draw_at(n)) <= max_seq_length, unit, upper)
    size = unit if size is None else size
    return [draw_fitting(draw_at, length, size, unit, max_seq_length) for _ in range(num_samples)]
