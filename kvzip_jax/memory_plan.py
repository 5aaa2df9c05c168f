"""What a run needs per device, before anything is allocated: params, the cache, and the largest working set of
a prefill chunk or a KVzip reread chunk. Checking it against a device is sharding.memory's part.

    need = memory_plan.plan(cfg, dtype, context_tokens=32768, batch=1, mesh=mesh, chunk=2048)
    memory.check(need)           # MemoryPlanError, naming the largest part, when it cannot fit the device

Estimates in bytes per device (the most loaded one), from shapes alone:
  params      every parameter's shard (the partition rules)
  cache       L layers x K and V [B/data, K/tensor, C/seq, H] in the cache dtype, plus the keep mask (1 byte a slot)
  scores      KVzip scores [L, B, K, n] float32 over (data, tensor, seq), held until eviction
  workspace   one layer of a chunk forward in float32 (nothing of a layer outlives it): the residual stream and
              its norm [B, T, D], the fused projections [B, T, (N + 2K) H], the queries [B, T, N H] in a few
              layouts, one MLP token block's [2F] and [F] (layers.MLP_TOKEN_BLOCK; widths over tensor), the
              online-softmax blocks of attention (attention.BLOCK_ELEMENTS per KV head), the last-token logits
Sharded dimensions divide their size (a dimension the axis does not divide stays whole). Activations, chunk width and
XLA's own buffers make this an estimate: bench/long_context.py prints it beside the measured peak.
"""

from __future__ import annotations

import math

import numpy as np

from kvzip_jax.config import ModelConfig
from kvzip_jax.models.attention import BLOCK_ELEMENTS
from kvzip_jax.models.layers import MLP_TOKEN_BLOCK
from kvzip_jax.models.params import param_shapes
from kvzip_jax.sharding.memory import MemoryPlan
from kvzip_jax.sharding.mesh import DATA, SEQ, TENSOR, axis_size, check_mesh, spec_for
from kvzip_jax.sharding.rules import param_spec

DEFAULT_ROOM = 256  # slots a default cache keeps for a question and its answer (generate.prefill's reserve)
QUERY_COPIES = 5  # a layer's query-sized buffers live at once (XLA CPU's buffer assignment of a reread chunk)


def _shard(mesh, axes, shape) -> int:
    """Elements of the largest shard of an array of `shape` laid out over `axes`."""
    spec = spec_for(mesh, axes, shape) if mesh is not None else (None,) * len(shape)
    return math.prod(-(-dim // (axis_size(mesh, name) if name else 1)) for dim, name in zip(shape, spec))


def plan(
    cfg: ModelConfig,
    dtype,
    context_tokens: int,
    batch: int = 1,
    mesh=None,
    chunk: int = 2048,
    capacity: int | None = None,
    scoring: bool = True,
    with_params: bool = True,
) -> MemoryPlan:
    """The per-device bytes of prefilling `context_tokens` for `batch` rows (cache of `capacity` slots, default
    the context rounded up to 64, plus DEFAULT_ROOM for questions and answers) and, with scoring, of KVzip's scores
    and reread chunks. with_params=False: params counted as 0 (already loaded, so no longer available)."""
    if mesh is not None:
        check_mesh(cfg, mesh)
    item = np.dtype(dtype).itemsize
    params = sum(_param_shard(name, shape, mesh) * item for name, shape in _flat_shapes(cfg)) if with_params else 0
    C = capacity or -(-(context_tokens + DEFAULT_ROOM) // 64) * 64
    B, K, H, L = batch, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    slots = _shard(mesh, (DATA, TENSOR, SEQ), (B, K, C))
    cache = L * (2 * slots * H * item + slots)
    scores = 4 * L * _shard(mesh, (DATA, TENSOR, SEQ), (B, K, C)) if scoring else 0
    T = min(chunk, context_tokens) + (64 if scoring else 0)  # a reread chunk carries its prompt
    rows = _shard(mesh, (DATA, None), (B, T))
    mlp_rows = _shard(mesh, (DATA, None), (B, -(-T // -(-T // MLP_TOKEN_BLOCK))))  # one MLP token block
    width = lambda n: _shard(mesh, (TENSOR,), (n,))
    N, D, F = cfg.num_heads, cfg.hidden_size, cfg.intermediate_size
    # One layer at a time: the residual stream and its norm, then either attention (the queries in QUERY_COPIES
    # layouts: rotated, as attention rows, padded, the output; the online-softmax blocks) or one MLP token block.
    attention = rows * QUERY_COPIES * width(N * H) + _shard(mesh, (DATA, TENSOR), (B, K)) * BLOCK_ELEMENTS
    mlp = mlp_rows * (width(2 * F) + width(F))
    workspace = 4 * (rows * 2 * D + max(attention, mlp) + _shard(mesh, (DATA, None), (B, cfg.vocab_size)))
    return MemoryPlan(params, cache, scores, workspace)


def _flat_shapes(cfg: ModelConfig):
    def walk(tree, prefix):
        for key, value in tree.items():
            name = f"{prefix}/{key}" if prefix else key
            yield from walk(value, name) if isinstance(value, dict) else [(name, value)]

    return list(walk(param_shapes(cfg), ""))


def _param_shard(name: str, shape, mesh) -> int:
    if mesh is None:
        return math.prod(shape)
    spec = tuple(param_spec(name, shape, mesh)) + (None,) * len(shape)
    return math.prod(-(-dim // (axis_size(mesh, n) if n else 1)) for dim, n in zip(shape, spec))
