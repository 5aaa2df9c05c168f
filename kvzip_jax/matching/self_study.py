"""Self-study probes: turns the model itself writes about a context, the third source of reference queries
(reference/attention_matching.md §4; queries.py teacher-forces them on top of the cache).

    probes = self_study.probes(params, cfg, tokenizer, cache, max_new_tokens=64)
    compacted, counts = matching.compact(params, cfg, cache, reread,
                                         MatchingConfig(sources=("repeat", "self-study")), probes=probes)

Each prompt is asked of the context cache as a user turn `samples` times, and every answer is sampled with our own
decode loop (temperature > 0, so the turns vary, seeded, so they are reproducible). The turns are written together:
the context rows are tiled once per turn (kv.tiled_rows), one prefill of every prompt row, one jitted decode loop
(generate.decode's while_loop) for all of them; max_rows bounds the rows of one such batch (turns of several batches
share one compiled program). A probe is the prompt's suffix tokens followed by the answer: the queries the model
makes while reading a question about the context and answering it, the queries later questions will make. The cache
is left as it was (the turns run on a copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import ModelConfig
from kvzip_jax.matching.queries import Probes
from kvzip_jax.prompts import question_suffix, stop_token_ids

PROMPTS = (
    "Summarize the context above in a few sentences.",
    "List every name, number, date, place and code that appears in the context above.",
    "Write three questions about specific details of the context above, each followed by its answer.",
)


def probes(
    params,
    cfg: ModelConfig,
    tokenizer,
    cache: kv.KVCache,
    prompts: Sequence[str] = PROMPTS,
    *,
    samples: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 0.7,
    seed: int = 0,
    max_rows: int | None = None,
) -> Probes:
    """Probes (tokens [P S, B, W] right-padded, num_valid [P S, B]; turn p S + s is prompt p's sample s) of the P
    prompts asked `samples` times of every row of a context cache, each answered by sampling up to max_new_tokens.
    max_rows: most cache rows written at once (None: all P S B in one batch; at least B). The cache is not modified."""
    if not prompts:
        raise ValueError("self-study needs at least one prompt")
    if samples < 1 or max_new_tokens < 1:
        raise ValueError(f"samples and max_new_tokens must be >= 1, got {samples}, {max_new_tokens}")
    B = cache.next_position.shape[0]
    turns = len(prompts) * samples
    per_batch = turns if max_rows is None else min(max(max_rows // B, 1), turns)  # turns written together
    suffixes = [question_suffix(tokenizer, text) for text in prompts]
    room = max(map(len, suffixes)) + max_new_tokens
    base = kv.grown(cache, max(room - int(cache.room().min()), 0))  # prefill and decode donate their cache
    stops = stop_token_ids(tokenizer)
    written: list[list[np.ndarray]] = []  # per turn, per batch row: the suffix and its answer
    for first in range(0, turns, per_batch):
        batch = [min(first + j, turns - 1) for j in range(per_batch)]  # the last batch repeats its last turn
        rows = [suffixes[j // samples] for j in batch for _ in range(B)]  # row i B + b: turn batch[i], context b
        logits, work = gen.prefill(params, cfg, rows, kv.tiled_rows(base, per_batch))
        answers, _ = gen.decode(
            params,
            cfg,
            logits,
            work,
            max_new_tokens,
            stop_tokens=stops,
            sampling=gen.Sampling.make(temperature, seed=seed + first),
        )
        for i, j in enumerate(batch):
            if j == len(written):
                written.append(
                    [np.concatenate([rows[i * B + b], np.asarray(answers[i * B + b], np.int32)]) for b in range(B)]
                )
    return probes_from_rows(written)


def probes_from_rows(rows: Sequence[Sequence[np.ndarray]]) -> Probes:
    """Probes of turns already written: rows[p][b] the int32 tokens of probe p on batch row b (P lists of B rows, any
    lengths), right-padded to the longest: tokens [P, B, W], num_valid [P, B]."""
    width = max(len(r) for per_probe in rows for r in per_probe)
    tokens = np.zeros((len(rows), len(rows[0]), width), np.int32)  # [P, B, W]
    num_valid = np.zeros((len(rows), len(rows[0])), np.int32)  # [P, B]
    for p, per_probe in enumerate(rows):
        for b, r in enumerate(per_probe):
            tokens[p, b, : len(r)], num_valid[p, b] = r, len(r)
    return Probes(tokens=jnp.asarray(tokens), num_valid=jnp.asarray(num_valid))
