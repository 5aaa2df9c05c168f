"""Evaluation tasks: offline, deterministic generators (every example one context with several questions), a
loader for SCBench-style JSONL task files, and a reader of kvpress-format datasets (dataset.py).

    examples = generate("multi_needle", num_contexts=8, seed=0, context_tokens=4000)
    examples = generate("ruler_niah_single_1", 8, seed=42, context_tokens=4096, count_tokens=tokenizer)
    examples = load_jsonl("scbench_kv.jsonl")
    examples = dataset.read("ruler_4096.parquet").examples

Example i of a task and seed is the same whatever num_contexts is: it draws from its own rng, seeded by
(seed, i, a number fixed per task name). The RULER tasks (ruler.TASKS, names "ruler_*") are generated as RULER
generates them, from one run seeded with seed (RULER's is 42): see kvzip_jax.eval.tasks.ruler. TASKS lists the
package's own generated tasks only.
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
    ruler,
    variable_tracking,
)
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.eval.tasks.jsonl import load_jsonl

__all__ = ["TASKS", "Example", "generate", "load_jsonl", "ruler"]

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
    as counted by count_tokens (default: haystack.approx_tokens, four characters a token). A RULER task's prompt
    plus its max_new_tokens fits context_tokens (RULER's max_seq_length); count_tokens may be a HF tokenizer there."""
    if task not in TASKS and task not in ruler.TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join([*TASKS, *ruler.TASKS])}")
    if num_contexts < 1:
        raise ValueError(f"num_contexts must be at least 1, got {num_contexts}")
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    count = haystack.approx_tokens if count_tokens is None else count_tokens
    if task in ruler.TASKS:
        return ruler.generate(task, num_contexts, context_tokens, count, seed)
    return [
        TASKS[task](
            np.random.default_rng([seed, index, task_number(task)]), f"{task}-{seed}-{index}", context_tokens, count
        )
        for index in range(num_contexts)
    ]
