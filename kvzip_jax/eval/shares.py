"""A sweep shared out over processes: which share of the batches a process runs, and the check that the processes
of one replica spanning several hold the same answers."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvzip_jax.errors import KvzipError
from kvzip_jax.eval.results import ResultsFile, SweepMismatchError, key_order


class ProcessShareError(KvzipError, ValueError):
    """A process index or count that does not name a share of a sweep (0 <= index < count)."""


def process_share(index: int | None = None, count: int | None = None, environ=os.environ) -> tuple[int, int]:
    """(index, count): which share of a sweep's batches this process runs. The given ones, else the environment's
    KVZIP_PROCESS_INDEX and KVZIP_PROCESS_COUNT, else jax.process_index() of jax.process_count() (0 of 1 unless
    jax.distributed is initialised). Raises ProcessShareError unless 0 <= index < count."""
    if (index is None) != (count is None):
        raise ProcessShareError("give the process index and the process count together")
    if index is None:
        names = ("KVZIP_PROCESS_INDEX", "KVZIP_PROCESS_COUNT")
        if (names[0] in environ) != (names[1] in environ):
            raise ProcessShareError(f"set {names[0]} and {names[1]} together")
        if names[0] in environ:
            try:
                index, count = (int(environ[name]) for name in names)
            except ValueError:
                raise ProcessShareError(
                    f"{names[0]}={environ[names[0]]!r}, {names[1]}={environ[names[1]]!r}: not integers"
                ) from None
        else:
            index, count = jax.process_index(), jax.process_count()
    if not 0 <= index < count:
        raise ProcessShareError(f"process index {index} is not in [0, {count}) (the process count)")
    return index, count


def share_of(groups: Sequence, index: int = 0, count: int = 1) -> list:
    """Process index of count's batches: groups[index::count], contexts of every task and length. Batches, not
    single contexts, are shared out: a row's numbers depend, in the last float bits, on the rows batched with it,
    so each share computes its contexts exactly as one process does, and the merged summary is byte for byte the
    one-process sweep's (with as many devices per process and the same batch size)."""
    return list(groups[index::count])


def check_lockstep(results: ResultsFile) -> None:
    """Raises SweepMismatchError unless every process of a replica spanning processes holds the same answers done
    (else they would run different batches, and wait on each other for ever)."""
    digest = np.frombuffer(hashlib.sha256(repr(sorted(results.done, key=key_order)).encode()).digest(), np.uint32)
    try:
        multihost_utils.assert_equal(digest)
    except AssertionError:
        raise SweepMismatchError(
            f"the processes hold different answers in {results.path}: put the sweep's folder "
            f"on a filesystem every process shares"
        ) from None
