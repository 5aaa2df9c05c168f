"""Self-study probes: turns the model itself writes about a context, the third source of reference queries
(reference/attention_matching.md §4; queries.py teacher-forces them on top of the cache).

    probes = self_study.probes(params, cfg, tokenizer, cache, max_new_tokens=64)
    compacted, counts = matching.compact(params, cfg, cache, reread,
                                         MatchingConfig(sources=("repeat", "self-study")), probes=probes)

Each prompt is asked of the context cache as a user turn (every batch row gets the same prompt), and the answer is
sampled with our own decode loop (temperature > 0, so the turns vary, seeded, so they are reproducible). A probe is
the prompt's suffix tokens followed by the answer: the queries the model makes while reading a question about the
context and answering it, the queries later questions will make. The cache is left as it was (the turns run on a
copy).
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


def probes(params, cfg: ModelConfig, tokenizer, cache: kv.KVCache, prompts: Sequence[str] = PROMPTS, *,
           max_new_tokens: int = 64, temperature: float = 0.7, seed: int = 0) -> Probes:
    """Probes (tokens [P, B, W] right-padded, num_valid [P, B]) of the P prompts asked of every row of a context
    cache, each answered by sampling up to max_new_tokens. The cache is not modified."""
    if not prompts:
        raise ValueError("self-study needs at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B = cache.next_position.shape[0]
    stops = stop_token_ids(tokenizer)
    rows = []  # per prompt, per batch row: int32 token ids
    for p, text in enumerate(prompts):
        suffix = question_suffix(tokenizer, text)
        need = len(suffix) + max_new_tokens
        work = kv.grown(cache, max(need - int(cache.room().min()), 0))  # a copy: prefill and decode donate it
        logits, work = gen.prefill(params, cfg, [suffix] * B, work)
        answers, _ = gen.decode(params, cfg, logits, work, max_new_tokens, stop_tokens=stops,
                                sampling=gen.Sampling.make(temperature, seed=seed + p))
        rows.append([np.concatenate([suffix, np.asarray(a, np.int32)]) for a in answers])
    return probes_from_rows(rows)


def probes_from_rows(rows: Sequence[Sequence[np.ndarray]]) -> Probes:
    """Probes of turns already written: rows[p][b] the int32 tokens of probe p on batch row b (P lists of B rows, any
    lengths), right-padded to the longest: tokens [P, B, W], num_valid [P, B]."""
    width = max(len(r) for per_probe in rows for r in per_probe)
    tokens = np.zeros((len(rows), len(rows[0]), width), np.int32)  # [P, B, W]
    num_valid = np.zeros((len(rows), len(rows[0])), np.int32)  # [P, B]
    for p, per_probe in enumerate(rows):
        for b, r in enumerate(per_probe):
            tokens[p, b, :len(r)], num_valid[p, b] = r, len(r)
    return Probes(tokens=jnp.asarray(tokens), num_valid=jnp.asarray(num_valid))

