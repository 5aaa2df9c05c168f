"""Head-level (context-independent) KVzip: one score per (layer, KV head), computed once per model.

The ordinary reconstruction scoring runs once on a long sample text; a head's score is the largest pair score it
gives any token of that text (KVzip section 4). Compression then needs no scoring pass: whole (layer, KV head) units
are kept or dropped by these scores (eviction level "head"). A dropped head still sees the never-evicted prefix
(the system prompt, which plays the attention-sink role) and everything appended after the context; optionally it
also keeps the first `sink` and last `recent` context tokens (DuoAttention's streaming heads; KVzip keeps neither).

    scores = head_scores(model.params, model.cfg, model.tokenizer, sample_text())  # [L, K], once per model
    save_head_scores(checkpoint_dir, scores, {"model": model.name})                 # <dir>/head_scores.json
    keep = head_keep(load_head_scores(checkpoint_dir), context_len, n, 0.6)         # [L, B, K, n]
    masked = kv.mask_context(cache, keep, prefix_len, context_len)

Layers KVzip does not evict (Gemma 3's sliding-window layers) score +inf (null in the file) and keep their context.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import generate as gen
from kvzip_jax import prompts
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import EmptyInputError, ModelFileError
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.kvzip.scoring import (
    DEFAULT_CHUNK,
    RereadInputs,
    evictable_layers,
    reread_inputs,
    score,
)

FILENAME = "head_scores.json"
DEFAULT_TOKENS = 4096
# Prose-rich docstrings first; read from the source files, so they exist wherever Python does (even under -OO).
SAMPLE_MODULES = (
    "copy",
    "sched",
    "cmd",
    "socketserver",
    "heapq",
    "doctest",
    "unittest",
    "pdb",
    "timeit",
    "argparse",
    "subprocess",
    "configparser",
    "statistics",
    "tempfile",
    "difflib",
    "typing",
    "inspect",
    "random",
    "json",
    "collections",
    "pathlib",
    "ast",
)
SAMPLE_DESCRIPTION = (
    f"docstrings of Python {sys.version_info.major}.{sys.version_info.minor} standard-library "
    f"modules ({', '.join(SAMPLE_MODULES)})"
)


class HeadScoresError(ModelFileError):
    """Head scores are missing, unreadable, or do not fit the model."""


def sample_text(modules: tuple[str, ...] = SAMPLE_MODULES) -> str:
    """The default sample: the module docstrings of `modules`, in order, joined by blank lines (about 12k tokens).

    Deterministic for a given Python version. The bundled demo document is left out on purpose: it is the context
    the demo compresses, and head scores are meant to be independent of the context.
    """
    docs = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
            docs.append(doc or "")
    return "\n\n".join(doc for doc in docs if doc)


def sample_tokens(tokenizer, text: str, max_tokens: int = DEFAULT_TOKENS) -> tuple[np.ndarray, int]:
    """(tokens [prefix | context] int32, prefix_len): text laid out as a context (prompts.split_for_reuse) and
    cut to its first max_tokens context tokens."""
    if max_tokens < 1:
        raise EmptyInputError(f"head scores need at least one sample token, got max_tokens={max_tokens}")
    context, _ = prompts.split_for_reuse(tokenizer, text, [])
    return context.ids()[: context.context_start + max_tokens], context.context_start


def head_scores(
    params, cfg: ModelConfig, tokenizer, text: str, max_tokens: int = DEFAULT_TOKENS, chunk_size: int = DEFAULT_CHUNK
) -> np.ndarray:
    """[L, K] float32 head scores of a model from a sample text (its first max_tokens tokens; see sample_text)."""
    tokens, prefix_len = sample_tokens(tokenizer, text, max_tokens)
    reread = reread_inputs(tokenizer, [prefix_len], [tokens[prefix_len:]], chunk_size)
    return context_head_scores(params, cfg, tokens, reread)


def check_heads(cfg: ModelConfig) -> None:
    """HeadScoresError for a model whose layers cache no per-head pairs (MLA: one latent row per token for every
    head), where dropping a KV head would drop the layer."""
    if cfg.mla is not None:
        raise HeadScoresError(
            "head-level KVzip does not apply to multi-head latent attention: every head reads the "
            "same latent row; use --level pair, pair-uniform or layer"
        )


def context_head_scores(params, cfg: ModelConfig, tokens: np.ndarray, reread: RereadInputs) -> np.ndarray:
    """[L, K] float32: the max over the context of kvzip.score for one row tokens [prefix | context] and its reread
    inputs; +inf in the layers outside evictable_layers(cfg), so they are never dropped."""
    check_heads(cfg)
    capacity = -(-len(tokens) // 256) * 256
    _, cache = gen.prefill(params, cfg, [tokens], capacity=capacity)
    scores = jax.jit(score)(params, cfg, cache, reread)  # [L, 1, K, n], -inf past the context
    per_head = np.array(scores[:, 0].max(axis=-1), np.float32)  # [L, K], a writable copy
    fixed = [layer for layer in range(cfg.num_layers) if layer not in evictable_layers(cfg)]
    per_head[fixed] = np.inf
    return per_head


def head_keep(
    head_scores, context_len, n: int, ratio, sink: int = 0, recent: int = 0, evictable: tuple[int, ...] | None = None
) -> jax.Array:
    """keep [L, B, K, n] bool for head scores [L, K] and context_len [B] (n >= every context length).

    ratio: the fraction of evictable (layer, KV head) units that keep their whole context, exactly
    floor(ratio x units) of them (the highest scores; ties to the lower layer, then head), as in KVzip. Every other
    unit keeps only its first `sink` and last `recent` context tokens; these windows come on top of the ratio.
    evictable: the layers that compete (default: those whose scores are all finite); the others keep everything.
    Pass evictable explicitly under jit.
    """
    if sink < 0 or recent < 0:
        raise ValueError(f"sink and recent are token counts >= 0, got {sink}, {recent}")
    if evictable is None:
        evictable = tuple(int(i) for i in np.flatnonzero(np.isfinite(np.asarray(head_scores)).all(axis=1)))
    context_len = jnp.asarray(context_len, jnp.int32)
    L, K = np.shape(head_scores)
    B = context_len.shape[0]
    scores = jnp.broadcast_to(jnp.asarray(head_scores, jnp.float32)[:, None, :, None], (L, B, K, n))
    keep = keep_mask(scores, context_len, ratio, "head", evictable)  # [L, B, K, n]
    offset = jnp.arange(n)[None, :]  # [1, n]
    window = (offset < sink) | (offset >= context_len[:, None] - recent)  # [B, n]
    window &= offset < context_len[:, None]
    return keep | window[None, :, None, :]


def scores_file(path: str | Path) -> Path:
    """Where head scores live: `path` itself if it names a .json file, else <path>/head_scores.json."""
    path = Path(path)
    return path if path.suffix == ".json" else path / FILENAME


def save_head_scores(path: str | Path, scores, meta: dict | None = None) -> Path:
    """Writes head scores [L, K] (+inf as null) and `meta` (model, sample, tokens...) as JSON, atomically
    (a temporary file renamed into place). path: a checkpoint folder or a .json file. Returns the file."""
    scores = np.asarray(scores, np.float32)
    if scores.ndim != 2:
        raise ValueError(f"head scores are [layers, KV heads], got shape {scores.shape}")
    target = scores_file(path).absolute()
    rows = [[float(x) if np.isfinite(x) else None for x in row] for row in scores]
    record = {**(meta or {}), "shape": list(scores.shape), "scores": rows}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def load_head_scores(path: str | Path, cfg: ModelConfig | None = None) -> np.ndarray:
    """Head scores [L, K] float32 (null read as +inf) from a checkpoint folder or a .json file.

    Raises HeadScoresError when the file is missing or malformed, or (given cfg) does not fit the model or the model
    has no per-head pairs (check_heads).
    """
    if cfg is not None:
        check_heads(cfg)
    target = scores_file(path)
    try:
        record = json.loads(target.read_text())
        scores = np.array([[np.inf if x is None else x for x in row] for row in record["scores"]], np.float32)
    except FileNotFoundError:
        raise HeadScoresError(
            f"no head scores at {target}; compute them once per model with `kvzip-jax head-scores --model MODEL`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HeadScoresError(f"{target} is not a head-scores file ({type(e).__name__}: {e})") from None
    if scores.ndim != 2 or (cfg is not None and scores.shape != (cfg.num_layers, cfg.num_kv_heads)):
        expected = "[layers, KV heads]" if cfg is None else f"[{cfg.num_layers}, {cfg.num_kv_heads}]"
        raise HeadScoresError(f"{target} holds head scores of shape {list(scores.shape)}, expected {expected}")
    return scores
