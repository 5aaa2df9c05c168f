"""Keeping a long sweep's host memory flat: what a batch freed goes back to the system, and the programs compiled
for one task's shapes are dropped when the sweep moves to the next task.

On the CPU backend, XLA's buffers come from the C allocator; glibc keeps freed blocks in its arenas (the dynamic mmap
threshold moves medium-sized buffers onto the heap after the first large free), so without a trim the resident set
climbs with every batch and task even though no array outlives its batch (measured: bench/sweep_memory.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import jax


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed(collect: bool = True) -> None:
    """Collects garbage (unless collect is False), then hands the allocator's free blocks back to the system
    (glibc's malloc_trim; a no-op elsewhere)."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def drop_compiled() -> None:
    """Drops every compiled program (jax.clear_caches) and what it held."""
    jax.clear_caches()
    release_freed()
