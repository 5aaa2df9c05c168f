"""RULER's variable tracking (one chain of four hops in noise lines, one few-shot example before it): "VAR ABCDE =
12345", then "VAR FGHIJ = VAR ABCDE " and so on, each line between noise lines; every name of the chain expected."""

from __future__ import annotations

import string
from collections.abc import Callable

from kvzip_jax.eval.tasks.ruler.length import Redraw, draw_fitting, largest_fitting
from kvzip_jax.eval.tasks.ruler.sample import Sample
from kvzip_jax.eval.tasks.ruler.streams import Streams
from kvzip_jax.eval.tasks.ruler.templates import NOISE, VARIABLE_TRACKING

NUM_CHAINS, NUM_HOPS = 1, 4
NAME_LENGTH, EXAMPLE_NAME_LENGTH = 5, 3
EXAMPLE_VALUE = "12345"
EXAMPLE_MAX_TOKENS, EXAMPLE_STEP = 500, 5  # the few-shot example: its length limit (no new tokens) and step
STEP, SHORT_STEP = 10, 5  # noise lines; the short step below 4096 tokens


def chains(streams: Streams, example: bool) -> tuple[list[list[str]], list[list[str]]]:
    """(names, lines) per chain. Names: random upper-case strings, NAME_LENGTH letters (EXAMPLE_NAME_LENGTH for the
    few-shot example), more drawn while any repeats; the first line of a chain gives a random 5-digit value
    (EXAMPLE_VALUE for the example), the next ones copy the name before, with a trailing space. Redraw where a
    repeat left a partial chain (RULER fails there)."""
    rng, length, size = streams.py, EXAMPLE_NAME_LENGTH if example else NAME_LENGTH, NUM_HOPS + 1
    new_name = lambda: "".join(rng.choices(string.ascii_uppercase, k=length)).upper()
    names = [new_name() for _ in range(size * NUM_CHAINS)]
    while len(set(names)) < size * NUM_CHAINS:
        names.append(new_name())
    groups, lines = [names[i : i + size] for i in range(0, len(names), size)], []
    for group in groups:
        value = EXAMPLE_VALUE if example else str(streams.legacy.randint(10000, 99999))
        if len(group) < size:
            raise Redraw(f"a repeated name left a partial chain {group}")
        lines.append([f"VAR {group[0]} = {value}"] + [f"VAR {new} = VAR {old} " for old, new in zip(group, group[1:])])
    return groups, lines


def draw(streams: Streams, size: int, example: bool) -> Sample:
    """One prompt over `size` noise lines: each chain's lines inserted in order at sorted drawn positions (the j-th
    line of a chain lands j lines further on), all joined by newlines; answers: the first chain's names."""
    names, chain_lines = chains(streams, example)
    lines = [NOISE] * size
    for chain in chain_lines:
        positions = sorted(streams.py.sample(range(len(lines)), len(chain)))
        for offset, (position, line) in enumerate(zip(positions, chain)):
            lines.insert(position + offset, line)
    context = "\n".join(lines).replace(". \n", ".\n")
    value = chain_lines[0][0].split("=")[-1].strip()
    text = VARIABLE_TRACKING.prompt.format(context=context, query=value, count=NUM_HOPS + 1)
    return Sample(text, tuple(names[0]), size)


def rename_example(streams: Streams, example: str) -> str:
    """The few-shot example with fresh names and value: each of its last NUM_HOPS + 1 words (the answer names)
    replaced everywhere by a random upper-case string of its length, in order; then EXAMPLE_VALUE by a random
    5-digit value."""
    for name in example.strip().split()[-(NUM_HOPS + 1) :]:
        example = example.replace(name, "".join(streams.py.choices(string.ascii_uppercase, k=len(name))).upper())
    return example.replace(EXAMPLE_VALUE, str(streams.legacy.randint(10000, 99999)))


def sized(draw_at: Callable[[int], Sample], count: Callable[[str], int], extra: int, max_length: int, unit: int) -> int:
    """The searched haystack size: a probe draw of `unit` lines gives the prompt tokens per line; the largest size in
    [unit, max(3 x max_length / that, 2 x unit)] whose draw has count(prompt) + extra <= max_length (a Redraw does
    not fit), else unit."""
    per_unit = count(_retrying(draw_at, unit).text) / unit
    upper = max(int((max_length / per_unit) * 3), 2 * unit)

    def fits(n: int) -> bool:
        try:
            return count(draw_at(n).text) + extra <= max_length
        except Redraw:
            return False

    size = largest_fitting(fits, unit, upper)
    return unit if size is None else size


def _retrying(draw_at: Callable[[int], Sample], n: int) -> Sample:
    """draw_at(n), drawn again on Redraw."""
    while True:
        try:
            return draw_at(n)
        except Redraw:
            pass


def samples(streams: Streams, num_samples: int, max_seq_length: int, count: Callable[[str], int]) -> list[Sample]:
    """num_samples samples whose prompt + 30 new tokens fit max_seq_length tokens, each after a renamed copy of one
    few-shot example. The example (3-letter names, value 12345) is the prompt of up to 500 tokens, then " ", its
    names joined by spaces, "\\n"; it is searched and drawn first, from the same streams."""
    small = lambda n: draw(streams, n, True)
    tokens = lambda sample: count(sample.text)
    size = sized(small, count, 0, EXAMPLE_MAX_TOKENS, EXAMPLE_STEP)
    shot = draw_fitting(small, tokens, size, EXAMPLE_STEP, EXAMPLE_MAX_TOKENS)
    example = shot.text + " " + " ".join(shot.answers) + "\n"
    unit = SHORT_STEP if max_seq_length < 4096 else STEP
    new_tokens = VARIABLE_TRACKING.max_new_tokens
    size = sized(lambda n: draw(streams, n, False), count, count(example) + new_tokens, max_seq_length, unit)

    def with_example(n: int) -> Sample:
        sample = draw(streams, n, False)
        return Sample(rename_example(streams, example) + "\n" + sample.text, sample.answers, n)

    length = lambda sample: count(sample.text) + new_tokens
    return [draw_fitting(with_example, length, size, unit, max_seq_length) for _ in range(num_samples)]
