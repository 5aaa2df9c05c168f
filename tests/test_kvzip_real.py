"""KVzip and KVzip+ scores on the real SmolLM2 against an independent torch computation from transformers' own
attention."""

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
CONTEXT = 360  # context tokens: three reread chunks of CHUNK, the last one short (104 tokens)
CHUNK = 128
RECORDED: list = []
INPUTS: dict = {}


def _probe(module, query, key, value, attention_mask, **kwargs):
    """transformers attention that records post-RoPE queries and all keys and values (cache included) of every
    layer."""
    RECORDED.append((module.layer_idx, query.detach().float(), key.detach().float(), value.detach().float()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _record_attention_input(module, args, kwargs):
    """A pre-hook on each self_attn: records its input, the normed hidden states [B, T, D]."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    INPUTS[module.layer_idx] = hidden.detach().float()


AttentionInterface.register("kvzip_probe", _probe)
ALL_MASK_ATTENTION_FUNCTIONS.register("kvzip_probe", sdpa_mask)  # else new tokens on a cache get a wrong mask


def torch_scores(model, prefix_len, context_len, cache, reread_rows, chunk_size):
    """([L, K, n] KVzip, [L, K, n] KVzip+) from the definition, with queries, keys, values and attention inputs read
    off transformers' attention layers (KVzip+: a row's weights over |h| of its query token, times |W_O v| of the
    query head's slice of o_proj)."""
    cfg = model.config
    L, K, G = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    scores = {plus: torch.full((L, K, context_len), float("nan")) for plus in (False, True)}
    for t, reread in enumerate(reread_rows):
        RECORDED.clear()
        INPUTS.clear()
        with torch.no_grad():
            model(torch.tensor(reread[None], dtype=torch.long), past_key_values=copy.deepcopy(cache))
        start = prefix_len + t * chunk_size
        end = min(start + chunk_size, prefix_len + context_len)
        base, T = prefix_len + context_len, len(reread)
        for layer, q, k, v in RECORDED:
            attention = model.model.layers[layer].self_attn
            q = q[0].view(K, G, T, -1)  # [K, G, T, H]
            k = k[0]  # [K, S, H]
            keys = torch.cat([k[:, :prefix_len], k[:, start:end], k[:, base : base + T]], dim=1)  # [K, P+c+T, H]
            logits = torch.einsum("kgth,ksh->kgts", q, keys) * attention.scaling
            own = torch.arange(T)[None, :] <= torch.arange(T)[:, None]  # [T, T] causal among the reread
            mask = torch.cat([torch.ones(T, prefix_len + end - start, dtype=torch.bool), own], dim=1)
            probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
            chunk = probs[..., prefix_len : prefix_len + end - start]  # [K, G, T, c]
            o_proj = attention.o_proj.weight.detach().float().T.reshape(K, G, -1, cfg.hidden_size)  # [K, G, H, D]
            writes = torch.einsum("kch,kghd->kgcd", v[0, :, start:end], o_proj).norm(dim=-1)  # [K, G, c]
            plus = chunk / INPUTS[layer][0].norm(dim=-1)[None, None, :, None] * writes[:, :, None, :]
            for key, stat in ((False, chunk), (True, plus)):
                scores[key][layer, :, start - prefix_len : end - prefix_len] = stat.amax(dim=(1, 2))
    return scores[False].numpy(), scores[True].numpy()


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """SmolLM2 in both frameworks with a CONTEXT-token context prefilled: (tokenizer, prompt, our params and cache,
    the transformers model and its cache)."""
    tok = bundled_tokenizer(registry.SMOLLM2)
    context_ids = prompts.encode_text(tok, DOCUMENT)[:CONTEXT]
    prompt, _ = prompts.split_for_reuse(tok, tok.decode(context_ids), [])
    with one_parse_per_gguf():
        cfg, params = params_from_gguf(smollm2_gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, attn_implementation="kvzip_probe"
        )
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(_record_attention_input, with_kwargs=True)
    params = jax.tree.map(jnp.asarray, params)
    _, cache = gen.prefill(params, cfg, [prompt.ids()[: prompt.context_end]])
    with torch.no_grad():
        out = model(torch.tensor(prompt.ids()[None, : prompt.context_end], dtype=torch.long), use_cache=True)
    return tok, prompt, cfg, params, cache, model, out.past_key_values


# CHUNK: three chunks (the second and third with the previous chunk's anchor, the third shorter), each normalised over
# [prefix | chunk | reread]; 2,048: one chunk, the forward's own normaliser (extended: test_kvzip_score checks
# one-chunk rereads against the numpy oracle, and CHUNK the same code on real weights).
@pytest.mark.parametrize("chunk", [CHUNK, pytest.param(2048, marks=pytest.mark.extended)])
def test_smollm2_scores_match_an_independent_torch_computation(smollm2, chunk):
    """KVzip's scores and KVzip+'s against transformers' own attention, one torch pass for both."""
    tok, prompt, cfg, params, cache, model, torch_cache = smollm2
    prefix_len, n = prompt.context_start, prompt.context_end - prompt.context_start
    reread = kvzip.reread_inputs(tok, [prefix_len], [prompt.ids()[prompt.context_slice]], chunk_size=chunk)
    assert reread.tokens.shape[0] == -(-n // chunk) and (chunk > n or (n % chunk and n // chunk >= 2))
    rows = [np.asarray(reread.tokens[t, 0, : int(reread.num_valid[t, 0])]) for t in range(reread.tokens.shape[0])]
    theirs = dict(zip((False, True), torch_scores(model, prefix_len, n, torch_cache, rows, chunk)))
    # KVzip's weights lie in [0, 1]; KVzip+'s are scaled by |W_O v| / |h| (up to ~17 here), so its bound is 1e-5 of
    # the largest score: two float32 computations of the same products agree to a few ulps of that scale.
    for plus, relative in ((False, 1e-4), (True, 1e-5)):
        ours = np.asarray(jax.jit(kvzip.score, static_argnums=(4, 5))(params, cfg, cache, reread, "softmax", plus))
        ours = ours[:, 0, :, :n]
        assert ours.shape == theirs[plus].shape and ours.shape[-1] >= CONTEXT - 10
        assert not np.isnan(theirs[plus]).any()
        diff = np.abs(ours - theirs[plus])
        budget = int(0.3 * ours.size)
        top = lambda s: set(np.argsort(-s.ravel(), kind="stable")[:budget].tolist())
        overlap = len(top(ours) & top(theirs[plus])) / budget
        name = "KVzip+" if plus else "KVzip"
        print(
            f"{name}, chunk {chunk}: scores up to {np.abs(theirs[plus]).max():.3g}, max abs diff {diff.max():.2e}, "
            f"top-30% overlap {overlap:.4f}"
        )
        np.testing.assert_allclose(ours, theirs[plus], atol=relative * np.abs(theirs[plus]).max())
        assert overlap >= 0.99, f"{name}: top-30% kept sets overlap {overlap:.4f}"
