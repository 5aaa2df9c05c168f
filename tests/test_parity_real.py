"""Parity in float32 with transformers loading the same bundled GGUF: logits, per-layer K/V and greedy decoding."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvzip_jax import generate as gen
from kvzip_jax import sharding
from kvzip_jax.eval.host_memory import release_freed
from kvzip_jax.weights import registry
from kvzip_jax.weights.gguf import params_from_gguf
from kvzip_jax.weights.hf import params_from_hf
from tests.conftest import bundled_tokenizer, drop_compiled_and_freed, one_parse_per_gguf

DOCUMENT = (Path(__file__).resolve().parents[1] / "kvzip_jax" / "data" / "demo_document.txt").read_text()
LOGIT_TOL = 2e-3
KV_TOL = 2e-3


def _oracle(gguf_path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _ours(gguf_path: Path):
    """Our conversion of the GGUF, each parameter on the device as soon as it is dequantized (a one-device mesh)."""
    return params_from_gguf(gguf_path, mesh=sharding.make_mesh())


def _long_tokens(tokenizer, n: int) -> np.ndarray:
    ids = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return np.asarray(ids[:n], np.int32)


def _chat_tokens(tokenizer, text: str) -> np.ndarray:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return np.asarray(ids, np.int32)


def _our_outputs(cfg, params, tokens: np.ndarray) -> tuple[np.ndarray, list]:
    """(last-token logits [V], per layer (k, v) [K, T, H]) of our prefill of tokens."""
    logits, cache = gen.prefill(params, cfg, [tokens])
    T = tokens.size
    return np.asarray(logits[0]), [
        (np.asarray(layer.k[0, :, :T]), np.asarray(layer.v[0, :, :T])) for layer in cache.layers
    ]


def _oracle_outputs(model, tokens: np.ndarray) -> tuple[np.ndarray, list]:
    """transformers' (last-token logits [V], per layer (k, v) [K, T or window - 1, H])."""
    with torch.no_grad():
        out = model(torch.tensor(tokens[None], dtype=torch.long), use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].numpy(), [
        (layer.keys[0].numpy(), layer.values[0].numpy()) for layer in out.past_key_values.layers
    ]


def _compare(ours, reference, architecture: str, num_tokens: int, check_kv: bool = True) -> None:
    (logits, kv), (ref_logits, ref_kv) = ours, reference
    diff = float(np.abs(logits - ref_logits).max())
    print(f"{architecture}, {num_tokens} tokens: last-token logits differ by at most {diff:.1e}")
    assert diff <= LOGIT_TOL, f"last-token logits differ by {diff} on a {num_tokens}-token prompt"
    assert int(np.argmax(logits)) == int(np.argmax(ref_logits))
    if not check_kv:
        return
    for i, ((k, v), (ref_k, ref_v)) in enumerate(zip(kv, ref_kv, strict=True)):
        kept = ref_k.shape[1]  # a sliding layer's reference holds only its window
        np.testing.assert_allclose(k[:, num_tokens - kept :], ref_k, atol=KV_TOL, rtol=0, err_msg=f"layer {i} keys")
        np.testing.assert_allclose(v[:, num_tokens - kept :], ref_v, atol=KV_TOL, rtol=0, err_msg=f"layer {i} values")


def _check_prompt(model, cfg, params, tokens: np.ndarray, check_kv: bool = True):
    _compare(_our_outputs(cfg, params, tokens), _oracle_outputs(model, tokens), cfg.architecture, tokens.size, check_kv)


def _check_one_model_at_a_time(gguf_path: Path, tokens: np.ndarray, **expected_config) -> None:
    """Our outputs from the GGUF's conversion (whose config has expected_config's values), then transformers' own
    load of the GGUF: one model in memory at a time (a 0.5B model in float32 is 2.5 GB on either side), from a
    process that holds no earlier test's compiled programs."""
    drop_compiled_and_freed()
    with one_parse_per_gguf():
        cfg, params = _ours(gguf_path)
        assert {key: getattr(cfg, key) for key in expected_config} == expected_config
        ours = _our_outputs(cfg, params, tokens)
        del params
        release_freed()
        oracle = _oracle(gguf_path)
    _compare(ours, _oracle_outputs(oracle, tokens), cfg.architecture, tokens.size)


# Gemma and Qwen first: they run before the module's SmolLM2 fixture exists, one model in memory at a time.


@pytest.mark.slow
def test_gemma3_matches_past_its_sliding_window(gemma_gguf):
    tok = bundled_tokenizer(registry.GEMMA)
    # 800 tokens: two prefill chunks, the second's queries past the 512-token window into the first's keys.
    tokens = np.concatenate([[tok.bos_token_id], _long_tokens(tok, 800)]).astype(np.int32)
    _check_one_model_at_a_time(gemma_gguf, tokens, sliding_window=512)


@pytest.mark.slow
def test_qwen_coder_matches_with_biases_and_gqa_7(qwen_gguf):
    tok = bundled_tokenizer(registry.QWEN)
    # One prompt: a chat turn, its special tokens included, then 550 tokens of prose (two prefill chunks; SmolLM2's
    # 1,100-token prompt and Gemma's cover longer ones).
    tokens = np.concatenate([_chat_tokens(tok, "What is the capital of France?"), _long_tokens(tok, 550)])
    _check_one_model_at_a_time(qwen_gguf, tokens, qkv_bias=True, group_size=7)


@pytest.mark.extended  # 6 GB of float32 weights on either side, installed on demand (make models-large)
def test_qwen_coder_1_5b_matches_with_head_dim_128_and_gqa_6(qwen_large_gguf):
    tok = bundled_tokenizer(registry.QWEN_LARGE)
    tokens = np.concatenate([_chat_tokens(tok, "What is the capital of France?"), _long_tokens(tok, 550)])
    _check_one_model_at_a_time(qwen_large_gguf, tokens, qkv_bias=True, group_size=6, head_dim=128, num_layers=28)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    with one_parse_per_gguf():
        cfg, params = _ours(smollm2_gguf)
        return _oracle(smollm2_gguf), cfg, params, bundled_tokenizer(registry.SMOLLM2)


def test_smollm2_logits_and_kv_match_on_three_prompts(smollm2):
    model, cfg, params, tok = smollm2
    prompts = [
        _chat_tokens(tok, "What is the capital of France?"),
        _chat_tokens(tok, "Write a haiku about the sea."),
        _long_tokens(tok, 1100),
    ]
    for tokens in prompts:
        _check_prompt(model, cfg, params, tokens)


def test_smollm2_greedy_32_tokens_equal_transformers(smollm2):
    model, cfg, params, tok = smollm2
    for text in ("What is the capital of France?", "Give me three tips for staying focused while studying."):
        tokens = _chat_tokens(tok, text)
        with torch.no_grad():
            ref = model.generate(torch.tensor(tokens[None], dtype=torch.long), max_new_tokens=32, do_sample=False)[
                0, tokens.size :
            ].tolist()
        logits, cache = gen.prefill(params, cfg, [tokens])
        ours, _ = gen.decode(params, cfg, logits, cache, 32, stop_tokens=[tok.eos_token_id])
        assert ours[0] == ref, (tok.decode(ours[0]), tok.decode(ref))


def test_hf_folder_and_gguf_conversions_give_the_same_logits(smollm2, tmp_path):
    model, cfg, params, tok = smollm2
    hf_config = model.config
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp_path)
    hf_cfg, hf_params = params_from_hf(tmp_path)
    tokens = _chat_tokens(tok, "Name a planet.")
    a, _ = gen.prefill(params, cfg, [tokens])
    b, _ = gen.prefill(jax.tree.map(jnp.asarray, hf_params), hf_cfg, [tokens])
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 1e-5
