"""Big models loaded sharded: HF safetensors converted straight onto a (data, seq, tensor) mesh, and orbax checkpoints
restored into another mesh's layout than the one that saved them.

The folders are random bf16 weights written by transformers at the real head layouts of LLaMA-3.1-8B, Qwen2.5-7B and
Gemma-3-12B (hidden size, q / KV heads, head_dim, rope, qkv bias, sliding window: what decides the sharding) with
2 layers, and with vocab 1024 and intermediate 512 instead of 128256-262208 and 14336-18944: at the real sizes one
folder is 2-3 GB and its generation alone takes minutes on 2 cores. Both stay divisible by 8, like the real ones, so
every sharded dimension splits as it would in the real model.

Multi-device checks run in a subprocess on 8 simulated CPU devices (this test process has already started JAX with
one): `python tests/test_sharded_weights.py convert|orbax FOLDER ...` prints "ok ..." lines, raises otherwise.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import sharding
from kvzip_jax.cli import main as cli_main
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.models.params import param_shapes
from kvzip_jax.models.transformer import forward
from kvzip_jax.weights import load, load_checkpoint, params_from_hf, save_checkpoint
from kvzip_jax.weights.assemble import SourceTensor, assemble_params, flat_param_shapes, source_shape
from kvzip_jax.weights.hf import _slot
from tests.conftest import simulated_devices_flags

ROOT = Path(__file__).resolve().parents[1]
DEVICES, TIMEOUT_S = 8, 300
LAYERS, VOCAB, INTERMEDIATE = 2, 1024, 512
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
MESHES = {  # model -> meshes it converts onto (tensor divides its KV heads; logits checked on the first, as each
    # compile costs seconds), and one it must refuse
    "llama-3.1-8b": ([(2, 1, 4), (1, 1, 8)], None),
    "qwen2.5-7b": ([(2, 1, 4), (1, 1, 4)], (1, 1, 8)),
    "gemma-3-12b": ([(1, 1, 8), (2, 1, 4)], None),
}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 8)).astype(np.int32)  # [B, T]
ATOL, RTOL = 1e-5, 1e-6  # logits: Gemma's tied embeddings give self-logits near 40, equal to a few float32 ulps


def hf_config(name: str):
    """The transformers config of `name`: real attention layout, LAYERS layers, shrunk vocab and MLP width."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    small = dict(vocab_size=VOCAB, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS)
    if name == "llama-3.1-8b":
        return LlamaConfig(
            **small,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters=LLAMA3_ROPE,
        )
    if name == "qwen2.5-7b":
        return Qwen2Config(
            **small,
            hidden_size=3584,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
    return Gemma3TextConfig(
        **small,
        hidden_size=3840,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=GEMMA3_ROPE,
    )


def write_hf_folder(name: str, folder: Path) -> Path:
    """Random bf16 weights of `name` saved by transformers (safetensors), plus a small word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(folder)
    return folder


def run_checks(*args: str) -> str:
    """Runs this file as a script on DEVICES simulated CPU devices; returns its output, failing on an error."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=simulated_devices_flags(DEVICES))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(f"{args[0]}: {time.perf_counter() - start:.1f} s\n{done.stdout}")
    return done.stdout


# ---------------------------------------------------------------- tests (in the pytest process)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    return {name: write_hf_folder(name, tmp_path_factory.mktemp(name.replace(".", "_"))) for name in MESHES}


def test_conversion_reads_one_parameter_at_a_time():
    """assemble_params reads a parameter's tensors only after the previous parameter was placed."""
    cfg = ModelConfig(
        architecture="qwen2",
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        intermediate_size=24,
        rms_norm_eps=1e-6,
        max_position=64,
        rope=RopeSpec(1e4),
        qkv_bias=True,
        tie_embeddings=False,
    )
    names = [
        f"model.layers.{i}.{n}"
        for i in range(2)
        for n in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "self_attn.o_proj.weight",
        )
        + tuple(f"self_attn.{x}_proj.{w}" for x in "qkv" for w in ("weight", "bias"))
    ]
    names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    events, shapes = [], flat_param_shapes(cfg)

    def tensor(name):
        slot = _slot(cfg, name, "model.")
        shape = source_shape(cfg, slot, shapes)
        return SourceTensor(name, slot, shape, lambda: events.append(("read", slot.path)) or np.ones(shape, np.float32))

    def place(path, value):
        events.append(("place", path))
        return value.shape

    tree = assemble_params(cfg, [tensor(n) for n in names[::-1]], place)
    assert tree["layers_1"]["qkv"] == (16, 32) and tree["lm_head"] == (16, 32)
    open_path = None
    for kind, path in events:  # read* place, one parameter after another
        if kind == "read":
            assert open_path in (None, path), f"{path} read while {open_path} was not placed"
            open_path = path
        else:
            assert path == open_path
            open_path = None
    assert [p for k, p in events if k == "place"] == list(shapes)


@pytest.mark.heavy
def test_hf_folders_convert_onto_meshes(hf_folders):
    """Every model onto each mesh its KV heads allow: layouts, values, bytes per device, logits; Qwen2.5-7B's 4 KV
    heads refuse tensor=8 with MeshError."""
    out = run_checks("convert", *(str(hf_folders[name]) for name in MESHES))
    for name, (meshes, refused) in MESHES.items():
        for mesh in meshes:
            assert f"ok {name} {mesh}" in out
        if refused:
            assert f"ok {name} refuses {refused}" in out


@pytest.mark.heavy
def test_orbax_checkpoint_restores_across_meshes(hf_folders, tmp_path):
    """`convert --mesh 1,1,4 --dtype bfloat16` (orbax save from sharded params), restored into (2,1,2), (1,1,8) and
    one device; a float32 save from (2,1,4) restored into (1,1,2)."""
    out = run_checks("orbax", str(hf_folders["llama-3.1-8b"]), str(tmp_path))
    for line in (
        "saved (1, 1, 4) bfloat16",
        "restored (2, 1, 2)",
        "restored (1, 1, 8)",
        "restored one device",
        "saved (2, 1, 4) float32",
        "restored (1, 1, 2)",
        "refuses (1, 1, 3)",
    ):
        assert f"ok {line}" in out


# ---------------------------------------------------------------- the subprocess (8 CPU devices)


@jax.jit
def _logits(params, tokens, cache, cfg):
    """Float32 logits [B, T, V] of tokens [B, T] run on an empty cache."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(params, tokens, positions, cache, cfg, logits="all")[0]


def _forward_logits(params, cfg, mesh=None) -> np.ndarray:
    """_logits of TOKENS on `mesh` (params already laid out there) or on one device."""
    cache = kv.init_cache(cfg, TOKENS.shape[0], 16)
    if mesh is None:
        return np.asarray(_logits(params, TOKENS, cache, cfg))
    with jax.set_mesh(mesh):
        return np.asarray(_logits(params, TOKENS, sharding.shard_cache(cache, mesh), cfg))


def _check_layout(params, cfg, mesh, reference, label: str) -> None:
    """Every leaf on the partition rules' layout, each device's shard equal to its slice of reference; each device
    holds total / tensor bytes (norms, replicated, are a few kB)."""

    want = dict(jax.tree_util.tree_flatten_with_path(sharding.param_shardings(param_shapes(cfg), mesh))[0])
    expected = dict(jax.tree_util.tree_flatten_with_path(reference)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert set(got) == set(want) == set(expected), f"{label}: keys differ"
    for path, leaf in got.items():
        name = f"{label} {jax.tree_util.keystr(path)}"
        assert leaf.sharding.mesh == mesh and leaf.sharding.spec == want[path].spec, (
            f"{name}: {leaf.sharding} != {want[path]}"
        )
        assert leaf.dtype == expected[path].dtype, f"{name}: dtype {leaf.dtype}"
        for shard in leaf.addressable_shards:  # each device holds its own slice of the value
            np.testing.assert_array_equal(np.asarray(shard.data), expected[path][shard.index], err_msg=name)
    total = sum(leaf.nbytes for leaf in got.values())
    held = sharding.bytes_per_device(params)
    tensor = dict(zip(mesh.axis_names, mesh.axis_sizes))["tensor"]
    assert set(held) == set(mesh.devices.flat), f"{label}: held on {sorted(held)}"
    for device, n in held.items():
        assert abs(n / (total / tensor) - 1) < 0.02, f"{label}: {device} holds {n} of {total} bytes"


def _convert_checks(folders: list[str]) -> None:
    for folder, (name, (meshes, refused)) in zip(folders, MESHES.items()):
        cfg, reference = params_from_hf(folder, "float32")  # numpy, on the host
        logits = _forward_logits(jax.tree.map(jnp.asarray, reference), cfg)
        for i, shape in enumerate(meshes):
            mesh = sharding.make_mesh(*shape)
            if i == 0:
                cfg_sharded, params = params_from_hf(folder, "float32", mesh)
            else:  # through kvzip_jax.load, which casts the leaves again
                model = load(folder, "float32", mesh=mesh)
                cfg_sharded, params = model.cfg, model.params
            assert cfg_sharded == cfg
            _check_layout(params, cfg, mesh, reference, f"{name} {shape}")
            if i == 0:
                np.testing.assert_allclose(
                    _forward_logits(params, cfg, mesh), logits, rtol=RTOL, atol=ATOL, err_msg=f"{name} {shape} logits"
                )
            print(f"ok {name} {shape}", flush=True)
        if refused:
            try:
                params_from_hf(folder, mesh=sharding.make_mesh(*refused))
            except sharding.MeshError as e:
                assert "KV heads" in str(e)
                print(f"ok {name} refuses {refused}", flush=True)
            else:
                raise AssertionError(f"{name} converted onto {refused}")


def _orbax_checks(folder: str, out: str) -> None:
    cfg, reference = params_from_hf(folder, "float32")
    logits = _forward_logits(jax.tree.map(jnp.asarray, reference), cfg)
    ck16 = Path(out) / "bf16"
    assert cli_main(["convert", "--hf", folder, "--out", str(ck16), "--dtype", "bfloat16", "--mesh", "1,1,4"]) == 0
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(ck16 / "params").item_metadata
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(stored)} == {"bfloat16"}
    print("ok saved (1, 1, 4) bfloat16", flush=True)
    for shape, dtype in (((2, 1, 2), jnp.float32), ((1, 1, 8), jnp.bfloat16)):  # the folder is bf16: exact in both
        mesh = sharding.make_mesh(*shape)
        cfg2, params, _ = load_checkpoint(ck16, dtype, mesh)
        assert cfg2 == cfg
        _check_layout(params, cfg, mesh, jax.tree.map(lambda a: a.astype(dtype), reference), f"restored {shape}")
        if dtype == jnp.float32:
            np.testing.assert_allclose(_forward_logits(params, cfg, mesh), logits, rtol=RTOL, atol=ATOL)
        print(f"ok restored {shape}", flush=True)
    _, single, _ = load_checkpoint(ck16, jnp.float32)
    for path, leaf in jax.tree_util.tree_flatten_with_path(single)[0]:
        assert leaf.sharding.device_set == {jax.local_devices()[0]}, jax.tree_util.keystr(path)
    np.testing.assert_allclose(_forward_logits(single, cfg), logits, rtol=RTOL, atol=ATOL)
    print("ok restored one device", flush=True)

    source = sharding.make_mesh(2, 1, 4)  # float32 save from params replicated over data, split over tensor
    _, on_source, tokenizer = load_checkpoint(ck16, jnp.float32, source)
    save_checkpoint(Path(out) / "f32", cfg, on_source, tokenizer)
    print("ok saved (2, 1, 4) float32", flush=True)
    mesh = sharding.make_mesh(1, 1, 2)
    _, params, _ = load_checkpoint(Path(out) / "f32", mesh=mesh)
    _check_layout(params, cfg, mesh, reference, "restored (1, 1, 2)")
    print("ok restored (1, 1, 2)", flush=True)
    try:
        load_checkpoint(ck16, mesh=sharding.make_mesh(1, 1, 3))
    except sharding.MeshError:
        print("ok refuses (1, 1, 3)", flush=True)
    else:
        raise AssertionError("8 KV heads restored onto tensor=3")


if __name__ == "__main__":
    started = time.perf_counter()
    {"convert": lambda *a: _convert_checks(list(a)), "orbax": _orbax_checks}[sys.argv[1]](*sys.argv[2:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{sys.argv[1]}: {time.perf_counter() - started:.1f} s, peak RSS {peak:.2f} GiB")
