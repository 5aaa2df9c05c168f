"""The (data, seq, tensor) mesh: partition rules, exact distributed selection, and sharded runs that equal the
unsharded one (8 simulated CPU devices in a subprocess: tests/multidevice_checks.py)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from kvzip_jax import sharding
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.kvzip.budget import top_counts
from kvzip_jax.sharding.select import ordered_keys
from tests.conftest import simulated_devices_flags

# Each axis split: data over 8; tensor over 4 beside data (the seq=1 path with tensor=4, which (1,1,4) walked
# too); data, seq and tensor at once (the seq-split path: merged attention, split writes, no gather over seq,
# which (1,2,4) walked too). Each mesh compiles every program again.
MESHES = ("8,1,1", "2,1,4", "2,2,2")


@pytest.mark.heavy
def test_sharded_runs_equal_one_device():
    """Per mesh: prefill logits, KVzip scores and 16 greedy decode steps over the masked cache within 1e-5 of the
    unsharded run, kept masks bit-identical, every output's sharding the rules', parameter bytes per device about
    total / tensor, and the distributed selection equal to the sort on random, tie-heavy and all-equal scores."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=simulated_devices_flags(8), TF_CPP_MIN_LOG_LEVEL="2")
    script = Path(__file__).with_name("multidevice_checks.py")
    done = subprocess.run(
        [sys.executable, str(script), *MESHES],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=script.parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [w for m in MESHES for w in ("ok", m)]


def test_tensor_must_divide_kv_heads():
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=32,
        rms_norm_eps=1e-6,
        max_position=64,
        rope=RopeSpec(theta=1e4),
    )
    sharding.check_mesh(cfg, AbstractMesh((1, 1, 2), sharding.AXES))
    with pytest.raises(sharding.MeshError, match="tensor=4 does not divide the model's 2 KV heads"):
        sharding.check_mesh(cfg, AbstractMesh((1, 1, 4), sharding.AXES))
    with pytest.raises(sharding.MeshError, match="needs 16 devices"):
        sharding.make_mesh(data=4, tensor=4)
    with pytest.raises(sharding.MeshError, match="positive"):
        sharding.make_mesh(data=0)


def test_partition_rules():
    mesh = AbstractMesh((2, 1, 4), sharding.AXES)
    assert sharding.param_spec("layers_0/qkv", (64, 256), mesh) == PartitionSpec(None, "tensor")
    assert sharding.param_spec("layers_3/o", (128, 64), mesh) == PartitionSpec("tensor", None)
    assert sharding.param_spec("layers_3/down", (96, 64), mesh) == PartitionSpec("tensor", None)
    assert sharding.param_spec("embed", (128, 64), mesh) == PartitionSpec("tensor", None)
    assert sharding.param_spec("embed", (101, 64), mesh) == PartitionSpec(None, None)  # 4 does not divide 101
    assert sharding.param_spec("layers_0/k_norm", (16,), mesh) == PartitionSpec()
    with pytest.raises(KeyError, match="no partition rule"):
        sharding.param_spec("layers_0/mystery", (4,), mesh)


def test_ordered_keys_keep_the_float_order():
    x = jnp.asarray([-jnp.inf, -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.0, 3e38, jnp.inf], jnp.float32)
    keys = np.asarray(ordered_keys(x)).astype(np.int64)
    assert (np.diff(keys) >= 0).all() and keys[5] == keys[6]  # -0.0 == 0.0
    assert (np.diff(np.delete(keys, 5)) > 0).all()


def test_bisection_equals_the_sort_on_one_device():
    """The distributed selection's arithmetic on a one-device mesh (the multi-device run checks the shards):
    random, tie-heavy, all-equal and partly -inf scores; counts 0, 1, all and more than all."""
    rng = np.random.default_rng(0)
    shape = (2, 3, 4, 50)  # [L, B, K, n]: 400 candidates per row
    cases = [
        rng.standard_normal(shape),
        rng.integers(0, 4, shape) / 3,
        np.full(shape, 0.5),
        np.where(rng.random(shape) < 0.3, -np.inf, rng.random(shape)),
    ]
    mesh = jax.make_mesh((1, 1, 1), sharding.AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    select = jax.jit(sharding.top_counts_sharded, static_argnums=(2, 3, 4))
    for scores in cases:
        scores = jnp.asarray(scores, jnp.float32)
        for counts in ([0, 37, 600], [1, 399, 400]):
            counts = jnp.asarray(counts, jnp.int32).reshape(1, 3, 1, 1)
            want = top_counts(scores.transpose(1, 0, 2, 3).reshape(3, -1), counts.reshape(3))
            got = select(scores, counts, (0, 2, 3), mesh, PartitionSpec(None, "data"))
            assert (np.asarray(got).transpose(1, 0, 2, 3).reshape(3, -1) == np.asarray(want)).all()
