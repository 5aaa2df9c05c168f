"""KVzip scores on the real SmolLM2 against an independent torch computation from transformers' own attention."""

import copy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvzip_jax import generate as gen
from kvzip_jax import kvzip, prompts
from kvzip_jax.weights import registry
from kvzip_jax.weights.gguf import params_from_gguf
from tests.conftest import bundled_tokenizer, one_parse_per_gguf

DOCUMENT = (Path(__file__).resolve().parents[1] / "kvzip_jax" / "data" / "demo_document.txt").read_text()
CHUNK = 512
RECORDED: list = []


def _probe(module, query, key, value, attention_mask, **kwargs):
    """transformers attention that records post-RoPE queries and all keys (cache included) of every layer."""
    RECORDED.append((module.layer_idx, query.detach().float(), key.detach().float()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kvzip_probe", _probe)
ALL_MASK_ATTENTION_FUNCTIONS.register("kvzip_probe", sdpa_mask)  # else new tokens on a cache get a wrong mask


def torch_scores(model, prefix_len, context_len, cache, reread_rows, chunk_size):
    """[L, K, n] from the definition, with queries and keys read off transformers' attention layers."""
    cfg = model.config
    L, K, G = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    scores = torch.full((L, K, context_len), float("nan"))
    for t, reread in enumerate(reread_rows):
        RECORDED.clear()
        with torch.no_grad():
            model(torch.tensor(reread[None], dtype=torch.long), past_key_values=copy.deepcopy(cache))
        start = prefix_len + t * chunk_size
        end = min(start + chunk_size, prefix_len + context_len)
        base, T = prefix_len + context_len, len(reread)
        for layer, q, k in RECORDED:
            q = q[0].view(K, G, T, -1)  # [K, G, T, H]
            k = k[0]  # [K, S, H]
            keys = torch.cat([k[:, :prefix_len], k[:, start:end], k[:, base : base + T]], dim=1)  # [K, P+c+T, H]
            logits = torch.einsum("kgth,ksh->kgts", q, keys) * model.model.layers[layer].self_attn.scaling
            own = torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # [T, T] causal among the reread
            mask = torch.cat([torch.ones(T, prefix_len + end - start, dtype=torch.bool), own], dim=1)
            probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
            scores[layer, :, start - prefix_len : end - prefix_len] = probs[
                ..., prefix_len : prefix_len + end - start
            ].amax(dim=(1, 2))
    return scores.numpy()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """SmolLM2 in both frameworks with a 1,500-token context prefilled: (tokenizer, prompt, our params and cache, the
    transformers model and its cache)."""
    tok = bundled_tokenizer(registry.SMOLLM2)
    context_ids = prompts.encode_text(tok, DOCUMENT)[:1500]
    prompt, _ = prompts.split_for_reuse(tok, tok.decode(context_ids), [])
    with one_parse_per_gguf():
        cfg, params = params_from_gguf(smollm2_gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, attn_implementation="kvzip_probe"
        )
    params = jax.tree.map(jnp.asarray, params)
    _, cache = gen.prefill(params, cfg, [prompt.ids()[: prompt.context_end]])
    with torch.no_grad():
        out = model(torch.tensor(prompt.ids()[None, : prompt.context_end], dtype=torch.long), use_cache=True)
    return tok, prompt, cfg, params, cache, model, out.past_key_values


# 512: three chunks, each normalised over [prefix | chunk | reread]; 2,048: one chunk, the forward's own normaliser
# (extended: test_kvzip_score checks one-chunk rereads against the numpy oracle, and 512 the same code on real weights).
@pytest.mark.parametrize("chunk", [512, pytest.param(2048, marks=pytest.mark.extended)])
def test_smollm2_scores_match_an_independent_torch_computation(smollm2, chunk):
    tok, prompt, cfg, params, cache, model, torch_cache = smollm2
    prefix_len, n = prompt.context_start, prompt.context_end - prompt.context_start
    reread = kvzip.reread_inputs(tok, [prefix_len], [prompt.ids()[prompt.context_slice]], chunk_size=chunk)
    assert reread.tokens.shape[0] == -(-n // chunk)
    ours = np.asarray(jax.jit(kvzip.score)(params, cfg, cache, reread))[:, 0, :, :n]
    rows = [np.asarray(reread.tokens[t, 0, : int(reread.num_valid[t, 0])]) for t in range(reread.tokens.shape[0])]
    theirs = torch_scores(model, prefix_len, n, torch_cache, rows, chunk)
    assert ours.shape == theirs.shape and ours.shape[-1] >= 1400
    assert not np.isnan(theirs).any()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    budget = int(0.3 * ours.size)
    top = lambda s: set(np.argsort(-s.ravel(), kind="stable")[:budget].tolist())
    overlap = len(top(ours) & top(theirs)) / budget
    print(f"chunk {chunk}: max abs diff {np.abs(ours - theirs).max():.2e}, top-30% overlap {overlap:.4f}")
    assert overlap >= 0.99, f"top-30% kept sets overlap {overlap:.4f}"
