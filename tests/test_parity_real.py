"""Parity in float32 with transformers loading the same bundled GGUF: logits, per-layer K/V and greedy decoding."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvzip_jax import generate as gen
from kvzip_jax.weights import registry
from kvzip_jax.weights.gguf import params_from_gguf
from kvzip_jax.weights.hf import params_from_hf
from tests.conftest import bundled_tokenizer

DOCUMENT = (Path(__file__).resolve().parents[1] / "kvzip_jax" / "data" / "demo_document.txt").read_text()
LOGIT_TOL = 2e-3
KV_TOL = 2e-3


def _oracle(gguf_path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _ours(gguf_path: Path):
    cfg, params = params_from_gguf(gguf_path)
    return cfg, jax.tree.map(jnp.asarray, params)


def _long_tokens(tokenizer, n: int) -> np.ndarray:
    ids = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return np.asarray(ids[:n], np.int32)


def _chat_tokens(tokenizer, text: str) -> np.ndarray:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return np.asarray(ids, np.int32)


def _check_prompt(model, cfg, params, tokens: np.ndarray, check_kv: bool = True):
    with torch.no_grad():
        out = model(torch.tensor(tokens[None], dtype=torch.long), use_cache=True)
    ref_logits = out.logits[0, -1].numpy()
    logits, cache = gen.prefill(params, cfg, [tokens])
    diff = float(np.abs(np.asarray(logits[0]) - ref_logits).max())
    print(f"{cfg.architecture}, {tokens.size} tokens: last-token logits differ by at most {diff:.1e}")
    assert diff <= LOGIT_TOL, f"last-token logits differ by {diff} on a {tokens.size}-token prompt"
    assert int(np.argmax(logits[0])) == int(np.argmax(ref_logits))
    if not check_kv:
        return
    T = tokens.size
    for i, layer in enumerate(cache.layers):
        ref_k = out.past_key_values.layers[i].keys[0].numpy()  # [K, T or window - 1, H]
        ref_v = out.past_key_values.layers[i].values[0].numpy()
        kept = ref_k.shape[1]
        np.testing.assert_allclose(np.asarray(layer.k[0, :, T - kept:T]), ref_k, atol=KV_TOL, rtol=0,
                                   err_msg=f"layer {i} keys")
        np.testing.assert_allclose(np.asarray(layer.v[0, :, T - kept:T]), ref_v, atol=KV_TOL, rtol=0,
                                   err_msg=f"layer {i} values")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    cfg, params = _ours(smollm2_gguf)
    return _oracle(smollm2_gguf), cfg, params, bundled_tokenizer(registry.SMOLLM2)


def test_smollm2_logits_and_kv_match_on_three_prompts(smollm2):
    model, cfg, params, tok = smollm2
    prompts = [_chat_tokens(tok, "What is the capital of France?"),
               _chat_tokens(tok, "Write a haiku about the sea."),
               _long_tokens(tok, 1100)]
    for tokens in prompts:
        _check_prompt(model, cfg, params, tokens)


def test_smollm2_greedy_32_tokens_equal_transformers(smollm2):
    model, cfg, params, tok = smollm2
    for text in ("What is the capital of France?", "Give me three tips for staying focused while studying."):
        tokens = _chat_tokens(tok, text)
        with torch.no_grad():
            ref = model.generate(torch.tensor(tokens[None], dtype=torch.long), max_new_tokens=32,
                                 do_sample=False)[0, tokens.size:].tolist()
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


@pytest.mark.slow
def test_gemma3_matches_past_its_sliding_window(gemma_gguf):
    cfg, params = _ours(gemma_gguf)
    assert cfg.sliding_window == 512
    tok = bundled_tokenizer(registry.GEMMA)
    model = _oracle(gemma_gguf)
    tokens = np.concatenate([[tok.bos_token_id], _long_tokens(tok, 1150)]).astype(np.int32)
    _check_prompt(model, cfg, params, tokens)


@pytest.mark.slow
def test_qwen_coder_matches_with_biases_and_gqa_7(qwen_gguf):
    cfg, params = _ours(qwen_gguf)
    assert (cfg.qkv_bias, cfg.group_size) == (True, 7)
    tok = bundled_tokenizer(registry.QWEN)
    model = _oracle(qwen_gguf)
    # One prompt (one compilation): a chat turn, its special tokens included, then 1,050 tokens of prose.
    _check_prompt(model, cfg, params, np.concatenate([_chat_tokens(tok, "What is the capital of France?"),
                                                      _long_tokens(tok, 1050)]))
