"""The model's side of the scorers' training data: writing texts, and one text's features (its attention inputs at
sampled tokens, KVzip's and KVzip+'s scores of every context pair).

Einsum legend: L layers, M sampled tokens, n context columns, K KV heads, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK
from kvzip_jax.scorers.data import sampled_positions
from kvzip_jax.scorers.features import context_hidden


def write_texts(model, writing: list[str], max_new_tokens: int, seed: int, temperature: float = 0.8) -> list[str]:
    """The model's answers to the writing prompts (each a user message under its chat template), sampled
    (temperature, top_p 0.95) in one batch."""
    tok = model.tokenizer
    rows = [np.asarray(prompts.build_prompt(tok, p).tokens, np.int32) for p in writing]  # ends with the answer header
    logits, cache = gen.prefill(model.params, model.cfg, rows, reserve=max_new_tokens + 16)
    sampling = gen.Sampling.make(temperature=temperature, top_p=0.95, seed=seed)
    stops = prompts.stop_token_ids(tok)
    outputs, _ = gen.decode(
        model.params, model.cfg, logits, cache, max_new_tokens, stop_tokens=stops, sampling=sampling
    )
    return [tok.decode([t for t in out if t not in stops]).strip() for out in outputs]


def context_of(model, text: str) -> tuple[np.ndarray, int, np.ndarray]:
    """(ids [prefix | context], prefix_len, context ids) of a text laid out as a context: the chat template with
    its default system prompt, no instruction, no question."""
    prompt, _ = prompts.split_for_reuse(model.tokenizer, text, [])
    ids = np.asarray(prompt.ids(), np.int32)
    return ids, prompt.context_start, ids[prompt.context_slice]


def prefilled(model, ids: np.ndarray):
    """The cache of one row of ids, prefilled."""
    _, cache = gen.prefill(model.params, model.cfg, [ids], reserve=0)
    return cache


def text_features(model, text: str, tokens: int, seed: int, chunk_size: int = DEFAULT_CHUNK) -> dict:
    """One text, prefilled as a context (the default system prompt, no question): `positions` [M] sampled context
    columns, `hidden` [L, M, D] float16, `kvzip` and `kvzip_plus` [L, K, n] float32."""
    tok, params, cfg = model.tokenizer, model.params, model.cfg
    ids, prefix_len, context = context_of(model, text)
    n = len(context)
    cache = prefilled(model, ids)
    reread = kvzip.reread_inputs(tok, [prefix_len], [context], chunk_size)
    score = jax.jit(kvzip.score, static_argnums=(4, 5))
    plain = np.asarray(score(params, cfg, cache, reread, "softmax", False))[:, 0, :, :n]  # [L, K, n]
    plus = np.asarray(score(params, cfg, cache, reread, "softmax", True))[:, 0, :, :n]
    positions = sampled_positions(n, tokens, seed)
    hidden = jax.jit(context_hidden)(
        params, cfg, cache, jnp.array([prefix_len]), jnp.array([n]), jnp.asarray(context[None], jnp.int32)
    )  # [L, 1, n, D]
    hidden = np.asarray(hidden[:, 0])[:, positions].astype(np.float16)  # [L, M, D]
    return {"positions": positions, "hidden": hidden, "kvzip": plain, "kvzip_plus": plus}
