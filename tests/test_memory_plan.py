"""The memory planner: per-device bytes from shapes alone, and a named error before anything is allocated."""

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from kvzip_jax import memory_plan, sharding
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.sharding import memory

GiB = 1 << 30
LLAMA_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    max_position=131072,
    rope=RopeSpec(theta=5e5),
    tie_embeddings=False,
)


def mesh(data=1, seq=1, tensor=1):
    return AbstractMesh((data, seq, tensor), sharding.AXES)


def test_llama_8b_at_128k():
    """scale.md's figures: 16 GiB of bf16 cache at 128K (plus a 1-byte keep mask per slot), ~15 GiB of params."""
    need = memory_plan.plan(LLAMA_8B, jnp.bfloat16, 131072, capacity=131072)
    assert need.cache == 32 * 8 * 131072 * (2 * 128 * 2 + 1)
    assert 14.9 * GiB < need.params < 15.0 * GiB  # 8.03e9 parameters
    assert need.scores == 4 * 32 * 8 * 131072 and need.workspace < GiB  # one layer at a time: 0.3 GiB
    assert memory.check(need, available=80 * GiB) is need


def test_shards_divide_each_part():
    one = memory_plan.plan(LLAMA_8B, jnp.bfloat16, 131072, batch=2, capacity=131072)
    split = memory_plan.plan(
        LLAMA_8B, jnp.bfloat16, 131072, batch=2, mesh=mesh(data=2, seq=2, tensor=8), capacity=131072
    )
    assert split.cache * 32 == one.cache and split.scores * 32 == one.scores
    assert one.params / 8 < split.params < 1.01 * one.params / 8  # norms replicated
    assert split.workspace < one.workspace


def test_refuses_before_allocating():
    need = memory_plan.plan(LLAMA_8B, jnp.float32, 131072)
    with pytest.raises(
        memory.MemoryPlanError, match="needs 62.42 GiB .* of 24.00 GiB available; the largest part is the cache"
    ):
        memory.check(need, available=24 * GiB)
    with pytest.raises(MemoryError):  # also a MemoryError for callers that catch those
        memory.check(need, available=24 * GiB)
    memory.check(memory_plan.plan(LLAMA_8B, jnp.bfloat16, 131072, mesh=mesh(tensor=8)), available=24 * GiB)


def test_this_machine_and_bad_mesh():
    assert memory.device_memory() > 0  # /proc/meminfo on this CPU
    with pytest.raises(memory.MemoryPlanError):  # 60 GiB of float32 on this 24 GiB machine
        memory.check(memory_plan.plan(LLAMA_8B, jnp.float32, 131072))
    with pytest.raises(sharding.MeshError):
        memory_plan.plan(LLAMA_8B, jnp.float32, 1024, mesh=mesh(tensor=3))
