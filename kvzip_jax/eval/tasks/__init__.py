"""Evaluation tasks: offline, deterministic generators (every example one context with several questions) and a
loader for SCBench-style JSONL task files.

    examples = generate("multi_needle", num_contexts=8, seed=0, context_tokens=4000)
    examples = load_jsonl("scbench_kv.jsonl")

Example i of a task and seed is the same whatever num_contexts is: it draws from its own rng, seeded by
(seed, i, a number fixed per task name).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from kvzip_jax.eval.tasks import (
    haystack,
    key_numbers,
    kv_retrieval,
    multi_needle,
    niah,
    passkey,
    prefix_suffix,
    variable_tracking,
)
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.eval.tasks.jsonl import load_jsonl

__all__ = ["TASKS", "Example", "generate", "load_jsonl"]

TASKS = {
    module.TASK: module.generate
    for module in (niah, passkey, kv_retrieval, multi_needle, variable_tracking, prefix_suffix, key_numbers)
}


def task_number(task: str) -> int:
    """A number fixed per task name (CRC-32), so each task draws its own examples."""
    return zlib.crc32(task.encode())


def generate(
    task: str,
    num_contexts: int,
    seed: int = 0,
    context_tokens: int = 1000,
    count_tokens: Callable[[str], int] | None = None,
) -> list[Example]:
    """num_contexts examples of a generated task, ids f"{task}-{seed}-{i}", contexts of about context_tokens tokens
    as counted by count_tokens (default: haystack.approx_tokens, four characters a token)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    if num_contexts < 1:
        raise ValueError(f"num_contexts must be at least 1, got {num_contexts}")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    count = count_tokens or haystack.approx_tokens
    return [
        TASKS[task](
            np.random.default_rng([seed, index, task_number(task)]), f"{task}-{seed}-{index}", context_tokens, count
        )
        for index in range(num_contexts)
    ]
