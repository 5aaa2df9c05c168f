"""Small word lists the generators draw facts from, and random tokens (numbers, letter strings) from an rng."""

from __future__ import annotations

import string

import numpy as np

FIRST_NAMES = (
    "Amara",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Elif",
    "Farid",
    "Greta",
    "Hiroshi",
    "Ines",
    "Jonas",
    "Kavya",
    "Lucia",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Rafael",
    "Selma",
    "Tomas",
    "Yara",
)
LAST_NAMES = (
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Tanaka",
    "Castillo",
    "Novak",
    "Haddad",
    "Kowalski",
    "Brennan",
    "Ferreira",
    "Ivanova",
    "Mensah",
    "Rossi",
    "Sato",
    "Valdez",
    "Weber",
)
CITIES = (
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Lima",
    "Oslo",
    "Hanoi",
    "Dakar",
    "Quito",
    "Perth",
    "Tbilisi",
    "Montreal",
    "Helsinki",
    "Cairo",
    "Krakow",
    "Accra",
    "Bogota",
    "Reykjavik",
    "Manila",
    "Tunis",
    "Zagreb",
    "Seville",
    "Porto",
    "Vilnius",
    "Riga",
    "Tallinn",
    "Kyoto",
    "Busan",
    "Auckland",
    "Havana",
    "Marrakesh",
)
COLOURS = (
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "silver",
    "golden",
    "white",
    "black",
    "crimson",
    "turquoise",
    "violet",
    "amber",
    "scarlet",
    "indigo",
)


def pick(rng: np.random.Generator, words: tuple[str, ...], count: int) -> list[str]:
    """count distinct words drawn from words, in random order."""
    return [words[i] for i in rng.choice(len(words), count, replace=False)]


def distinct_numbers(rng: np.random.Generator, digits: int, count: int) -> list[int]:
    """count distinct numbers of exactly `digits` digits."""
    low = 10 ** (digits - 1)
    return [low + int(i) for i in rng.choice(9 * low, count, replace=False)]


def random_string(rng: np.random.Generator, length: int, alphabet: str = string.ascii_lowercase + string.digits) -> str:
    """A random string of `length` characters from alphabet."""
    return "".join(alphabet[i] for i in rng.integers(len(alphabet), size=length))
