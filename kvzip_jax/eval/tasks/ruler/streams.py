"""The random streams of one RULER generation run: RULER seeds Python's `random` and numpy's legacy global
generator once with the run's seed and draws every sample of a task from them in turn (its few fixed shuffles use a
fresh random.Random(seed) each)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np


@dataclasses.dataclass(frozen=True)
class Streams:
    """py: random.Random(seed) (RULER's `random.*` calls); legacy: np.random.RandomState(seed) (its
    `np.random.randint`); seed: the run's seed. The generators advance as they are drawn from."""

    py: random.Random
    legacy: np.random.RandomState
    seed: int

    @classmethod
    def seeded(cls, seed: int) -> Streams:
        return cls(random.Random(seed), np.random.RandomState(seed), seed)

    def fresh(self) -> random.Random:
        """A new random.Random(seed), as RULER builds for each fixed shuffle."""
        return random.Random(self.seed)
