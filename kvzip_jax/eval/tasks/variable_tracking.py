"""Variable tracking (RULER): chains "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." ... spread in a haystack;
each question asks for every variable of a chain, by its value."""

from __future__ import annotations

import string
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import haystack, words
from kvzip_jax.eval.tasks.base import Example

TASK = "variable_tracking"
NUM_CHAINS = 4
MIN_HOPS, MAX_HOPS = 3, 4  # copies after the first assignment
NAME_LENGTH = 5


def variable_names(rng: np.random.Generator, count: int) -> list[str]:
    """count distinct upper-case names of NAME_LENGTH letters."""
    names: dict[str, None] = {}
    while len(names) < count:
        names[words.random_string(rng, NAME_LENGTH, string.ascii_uppercase)] = None
    return list(names)


def chain_statements(names: list[str], value: str) -> list[str]:
    """The assignments of one chain, in order: the value to the first name, then each name to the one before."""
    return [f"VAR {names[0]} = {value}."] + [f"VAR {new} = VAR {old}." for old, new in zip(names, names[1:])]


def generate(
    rng: np.random.Generator,
    example_id: str,
    context_tokens: int,
    count_tokens: Callable[[str], int] = haystack.approx_tokens,
) -> Example:
    """A haystack of about context_tokens tokens with NUM_CHAINS chains of MIN_HOPS..MAX_HOPS hops; their
    statements are interleaved at random, each chain in order, at spread depths. Metric "all": the fraction of a
    chain's names the answer contains."""
    lengths = [1 + int(hops) for hops in rng.integers(MIN_HOPS, MAX_HOPS + 1, size=NUM_CHAINS)]
    names = variable_names(rng, sum(lengths))
    chains = [names[sum(lengths[:i]) : sum(lengths[: i + 1])] for i in range(NUM_CHAINS)]
    values = [str(value) for value in words.distinct_numbers(rng, 5, NUM_CHAINS)]
    pending = [chain_statements(chain, value) for chain, value in zip(chains, values)]
    order = rng.permutation(np.repeat(np.arange(NUM_CHAINS), lengths))
    statements = [pending[chain].pop(0) for chain in order]
    context = haystack.plant(rng, statements, context_tokens, count_tokens)
    questions = tuple(
        f"Find all variables that are assigned the value {value} in the text above. Answer with the "
        "variable names only, separated by commas."
        for value in values
    )
    return Example(TASK, example_id, context, questions, tuple(tuple(chain) for chain in chains), "all", 32)
