"""Greedy decoding from a PagedExport, as a paged serving engine runs it: the cache stays in the engine's pages.

    logits, export = decode.append(params, cfg, question, export)   # question [B, T] through the pages
    tokens, export = decode.decode(params, cfg, logits, export, 32)  # one token per sequence per step

Each step runs the model's own layers (models.transformer: embed_tokens, apply_block, lm_head) with their attention
done over the pages (the blocks' `attend` hook), by the kernel the layout's engine runs:
  tpu  tpu-inference's ref_ragged_paged_attention (ref_ragged_paged_attention_hd64 at head dim 64), read out of its
       wheel (tpu_inference_kernel). The kernel writes the step's keys and values into the pages itself, at slots
       kv_lens + t, as the engine's does. The step runs op by op around it: the reference reads the batch's tables
       as Python values, so it is compiled per step with them as constants (tpu_inference_kernel.scheduled_ref), one
       program for every layer. On a TPU the engine calls ragged_paged_attention with the same arguments.
  gpu  the jnp paged reference (paged_attention.paged_decode_attention) over vLLM's FlashAttention blocks, the step's
       pairs written with write_pages; jitted.
(kernel="reference" runs the jnp reference over the tpu layout too.) The new tokens take their RoPE positions from
`positions`, the cache's logical next position, not from kv_lens; both grow by the tokens fed. The export must have
room for them (export_tpu / export_gpu's `room`). A sequence that emits a stop token leaves the batch, as an engine
drops a finished request: its pages, length and position stay as they were.

Einsum legend: B batch, T new tokens per sequence, N query heads, K KV heads, H head dim, D model width, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ContextTooLongError
from kvzip_jax.models.transformer import apply_block, embed_tokens, lm_head
from kvzip_jax.serving import tpu_inference_kernel
from kvzip_jax.serving.paged_attention import paged_decode_attention
from kvzip_jax.serving.pages import PagedExport, write_pages

KERNELS = ("engine", "reference")


def engine_attend(q, k, v, layer: PagedExport, window, scale):
    """Block.attend through tpu-inference's reference kernel: q [B, T, N, H], k, v [B, T, K, H] over a one-layer tpu
    export -> (out [B, T, N, H], the export with the kernel's pages, the new pairs written)."""
    out, pages = tpu_inference_kernel.attend_export(q, k, v, layer, 0, scale, window)
    return out, dataclasses.replace(layer, pages=(pages,))


def reference_attend(q, k, v, layer: PagedExport, window, scale):
    """Block.attend through the jnp paged reference (either layout): engine_attend's contract."""
    out = paged_decode_attention(q, layer, 0, scale, k, v, window)
    return out, dataclasses.replace(layer, pages=(write_pages(layer, 0, k, v),))


def step(params, cfg: ModelConfig, tokens: jax.Array, export: PagedExport, attend) -> tuple[jax.Array, PagedExport]:
    """tokens [B, T] (all real) fed to every sequence of export at its logical positions -> (the last token's
    logits [B, V] float32, the export with the tokens' pairs in its pages, kv_lens and positions + T)."""
    B, T = tokens.shape
    positions = export.positions[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    num_new = jnp.full((B,), T, jnp.int32)
    x = embed_tokens(params["embed"], tokens, cfg)  # [B, T, D]
    pages = []
    for i in range(cfg.num_layers):
        layer = dataclasses.replace(export, pages=(export.pages[i],))
        x, layer, _ = apply_block(params, cfg, i, x, positions, layer, num_new, attend=attend)
        pages.append(layer.pages[0])
    logits = lm_head(x[:, -1:], cfg, params["final_norm"], params["embed"], params.get("lm_head"))  # [B, 1, V]
    grown = dataclasses.replace(export, pages=tuple(pages), kv_lens=export.kv_lens + T, positions=positions[:, -1] + 1)
    return logits[:, 0], grown


_jitted_step = jax.jit(step, static_argnames=("attend",))


def append(params, cfg: ModelConfig, tokens, export: PagedExport, *, kernel: str | None = None):
    """tokens [B, T] (or [T] for one sequence; all real) appended to every sequence through the pages -> (logits
    [B, V] after the last, export). kernel: "engine" (tpu layout only) or "reference"; None: the layout's (above)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.shape[0] != export.kv_lens.shape[0] or tokens.shape[1] < 1:
        raise ValueError(f"tokens [B, T] with T >= 1 for {export.kv_lens.shape[0]} sequences, got {tokens.shape}")
    _check(cfg, export, tokens.shape[1])
    return _run(kernel, export)(params, cfg, tokens, export, _attend(kernel, export))


def decode(
    params,
    cfg: ModelConfig,
    logits,
    export: PagedExport,
    max_new_tokens: int,
    *,
    stop_tokens: Sequence[int] = (),
    kernel: str | None = None,
) -> tuple[list[list[int]], PagedExport]:
    """Greedy tokens from the logits [B, V] of each sequence's last fed token, one per step, each fed back through
    the pages -> (tokens per sequence, export). A sequence stops after emitting one of stop_tokens (kept in its
    tokens, not fed) and leaves the batch; the others go on. kernel: as in append."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check(cfg, export, max_new_tokens)
    attend, run = _attend(kernel, export), _run(kernel, export)
    stops = {int(t) for t in stop_tokens}
    B = export.kv_lens.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    active = np.arange(B)  # the sequences still in the batch
    logits = jnp.asarray(logits)  # [len(active), V]
    for _ in range(max_new_tokens):
        tokens = np.asarray(jnp.argmax(logits, axis=-1), np.int32)  # [len(active)]
        for b, token in zip(active, tokens):
            out[b].append(int(token))
        going = np.array([int(t) not in stops for t in tokens])
        if not going.any():
            break
        active, tokens = active[going], tokens[going]
        batch = export if active.size == B else rows(export, active)
        logits, batch = run(params, cfg, jnp.asarray(tokens)[:, None], batch, attend)
        export = batch if active.size == B else _put_rows(export, batch, active)
    return out, export


def rows(export: PagedExport, which) -> PagedExport:
    """The sequences `which` [b] of export (their page-table rows, lengths and positions; the page buffers shared)."""
    which = jnp.asarray(which, jnp.int32)
    return dataclasses.replace(
        export,
        page_indices=export.page_indices[which],
        kv_lens=export.kv_lens[which],
        positions=export.positions[which],
    )


def _put_rows(export: PagedExport, part: PagedExport, which) -> PagedExport:
    """export with part (rows(export, which), stepped) put back: its pages, and its rows' lengths and positions."""
    which = jnp.asarray(which, jnp.int32)
    return dataclasses.replace(
        export,
        pages=part.pages,
        kv_lens=export.kv_lens.at[which].set(part.kv_lens),
        positions=export.positions.at[which].set(part.positions),
    )


def _attend(kernel: str | None, export: PagedExport):
    kernel = kernel or ("engine" if export.layout == "tpu" else "reference")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "engine" and export.layout != "tpu":
        raise ValueError(f"the engine's kernel (tpu-inference) reads the tpu layout, not {export.layout!r}")
    return engine_attend if kernel == "engine" else reference_attend


def _run(kernel: str | None, export: PagedExport):
    """step: op by op for the engine's reference (whose tables must be concrete: scheduled_ref), else jitted."""
    return step if _attend(kernel, export) is engine_attend else _jitted_step


def _check(cfg: ModelConfig, export: PagedExport, tokens: int) -> None:
    """A named error unless export is this model's shape and every sequence has room for `tokens` more."""
    if cfg.mla is not None:
        raise ValueError("paged decoding runs grouped-query attention models; an MLA cache does not export")
    shape = (len(export.pages), export.num_kv_heads, export.head_dim)
    if shape != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(
            f"the export has (layers, KV heads, head dim) {shape}; the model has "
            f"{(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)}"
        )
    slots = export.pages_per_seq * export.page_size
    kv_lens, positions = np.asarray(export.kv_lens), np.asarray(export.positions)
    if (kv_lens + tokens > slots).any():
        raise ContextTooLongError(
            f"{tokens} more tokens do not fit the pages: {slots} slots per sequence, {int(kv_lens.max())} filled; "
            f"export with room={tokens} or more"
        )
    if (positions + tokens > cfg.max_position).any():
        raise ContextTooLongError(
            f"position {int(positions.max()) + tokens} exceeds the model's maximum context of {cfg.max_position}"
        )
