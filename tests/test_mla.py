"""Multi-head latent attention (DeepSeek-V3 style, dense MLP layers) against transformers on tiny random models,
converted through a saved safetensors folder: logits over a prefill and 16 decode steps, the cached latents and RoPE
keys, the absorbed form against the naive one, and every cache form."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import UnsupportedArchitectureError
from kvzip_jax.models.transformer import forward
from kvzip_jax.quant.groups import QuantFormat
from kvzip_jax.weights.hf import params_from_hf

from .test_compact import compact_jit_and_eager

TINY = dict(
    vocab_size=101,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=256,
    first_k_dense_replace=2,
    n_routed_experts=4,
    attn_implementation="eager",
)
VARIANTS = {
    "q_lora": dict(q_lora_rank=24),
    "no_q_lora": dict(q_lora_rank=None),
    "no_interleave": dict(q_lora_rank=24, rope_interleave=False),
    # YaRN as DeepSeek-V2-Lite and V3 configure it, scaled down: over the 36 positions of the test, RoPE
    # dimension 0 keeps its frequency and 1-3 are interpolated; cos / sin x 1 / mscale(0.707) and the softmax
    # scale x mscale(0.707)^2 (mscale 1 and mscale_all_dim 0.707 tell the two apart).
    "yarn": dict(
        q_lora_rank=24,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=0.707,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
}


def _tiny_hf_model(variant: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY, **VARIANTS[variant])).eval()
    with torch.no_grad():  # larger than default init, so that mistakes show up in the logits
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.15)
    return model


def _converted(variant: str, tmp_path_factory):
    model = _tiny_hf_model(variant)
    folder = tmp_path_factory.mktemp(variant)
    model.save_pretrained(folder)
    cfg, params = params_from_hf(folder)
    return model, cfg, jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    """(transformers model, our config, our params) converted through an HF safetensors folder, every variant."""
    return _converted(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """tiny's q_lora variant alone: for what the variants do not change (the cache forms, scoring, errors)."""
    return _converted("q_lora", tmp_path_factory)


def _tokens(cfg, batch, length, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def test_prefill_and_16_decode_steps_match_transformers(tiny):
    """Logits within 1e-4 over a 20-token prefill and 16 decode steps; the cache holds transformers' latents exactly
    and its RoPE keys up to the lane order (evens first, for an interleaved checkpoint)."""
    model, cfg, params = tiny
    assert cfg.mla is not None and cfg.num_kv_heads == 1 and cfg.cache_widths() == (8, 32)
    tokens = _tokens(cfg, 2, 36)
    with torch.no_grad():
        out = model(torch.tensor(tokens[:, :20], dtype=torch.long), use_cache=True)
        want = [out.logits[:, -1].numpy()]
        past = out.past_key_values
        for t in range(20, 36):
            step = model(torch.tensor(tokens[:, t : t + 1], dtype=torch.long), past_key_values=past, use_cache=True)
            want.append(step.logits[:, -1].numpy())
            past = step.past_key_values
    logits, cache = gen.prefill(params, cfg, tokens[:, :20], capacity=64)
    got = [np.asarray(logits)]
    for t in range(20, 36):
        logits, cache = gen.forward_step(
            params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([1, 1], jnp.int32), cache, cfg
        )
        got.append(np.asarray(logits[:, -1]))
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-4, rtol=0)
    interleaved = model.config.rope_interleave
    lanes = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)]) if interleaved else np.arange(8)
    for i, layer in enumerate(cache.layers):
        latents, rope_keys = past.layers[i].keys.numpy(), past.layers[i].values.numpy()  # [B, 1, T, R], [B, 1, T, dr]
        np.testing.assert_allclose(np.asarray(layer.v[:, :, :36]), latents, atol=1e-5, rtol=1e-5)
        if not interleaved:  # transformers caches the rotated key in its own lane order
            np.testing.assert_allclose(np.asarray(layer.k[:, :, :36]), rope_keys[..., lanes], atol=1e-5, rtol=1e-5)


def test_the_absorbed_form_equals_the_naive_one(one):
    """The latents up-projected per head and attended as N heads give the absorbed form's logits within 1e-5,
    over a prefill, chunk by chunk, and on a masked cache with a bias. (One variant: the query projection and the
    RoPE lane order, where the variants differ, come before the two forms part.)"""
    _, cfg, params = one
    naive = dataclasses.replace(cfg, mla_form="naive")
    tokens = _tokens(cfg, 2, 30, seed=2)
    positions = jnp.broadcast_to(jnp.arange(30, dtype=jnp.int32), (2, 30))
    prefill = jax.jit(
        lambda config: forward(
            params, jnp.asarray(tokens), positions, kv.init_cache(config, 2, 64), config, logits="all"
        )[0],
        static_argnums=0,
    )
    got, want = prefill(cfg), prefill(naive)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

    _, cache = gen.prefill(params, cfg, tokens[:, :24], capacity=64)
    rng = np.random.default_rng(0)
    keep = jnp.asarray(rng.random((2, 1, 64)) < 0.5) | (jnp.arange(64) >= 20)
    bias = jnp.where(jnp.arange(64) < 24, jnp.asarray(rng.normal(size=(2, 1, 64)), jnp.float32), 0.0)
    masked = dataclasses.replace(
        cache, layers=tuple(dataclasses.replace(layer, keep=keep, bias=bias) for layer in cache.layers)
    )
    step = lambda c, config: gen.forward_step(
        params,
        jnp.asarray(tokens[:, 24:30]),
        jnp.array([6, 6], jnp.int32),
        jax.tree.map(jnp.copy, c),
        config,
        logits="all",
    )[0]
    np.testing.assert_allclose(np.asarray(step(masked, cfg)), np.asarray(step(masked, naive)), atol=1e-5, rtol=0)


def test_every_cache_form_holds_latents(one):
    """Masked, ragged (one segment per layer: the latent is one 'KV head') and quantized MLA caches (int8 with its RoPE
    keys centred, the default, and uncentred) answer as the dense one does: greedy tokens equal; the ragged and int8
    ones with logits within 1e-4 and 5e-2."""
    _, cfg, params = one
    tokens = _tokens(cfg, 1, 24, seed=3)
    logits, dense = gen.prefill(params, cfg, tokens, capacity=64)
    everything = jnp.ones((1, 1, 64), bool)
    masked = kv.mask_context(
        dense, everything[None].repeat(cfg.num_layers, 0)[..., :20], jnp.array([2]), jnp.array([20])
    )
    ragged = kv.pack(masked, 16)
    assert ragged.layers[0].offsets.shape == (1, 1)
    assert kv.used_bytes(ragged) == cfg.num_layers * 24 * (8 + 32) * 4  # k_rope and latent per token, float32
    forms = {
        "masked": masked,
        "ragged": ragged,
        "int8": kv.quantized(ragged, QuantFormat(bits=8, group=8)),
        "int8-uncentred": kv.quantized(ragged, QuantFormat(bits=8, group=8), center=False),
    }
    want, _, want_logits = gen.decode(params, cfg, logits, jax.tree.map(jnp.copy, dense), 8, return_logits=True)
    for name, cache in forms.items():
        got, _, got_logits = gen.decode(params, cfg, logits, jax.tree.map(jnp.copy, cache), 8, return_logits=True)
        assert got == want, name
        np.testing.assert_allclose(
            np.asarray(got_logits), np.asarray(want_logits), atol=5e-2 if name.startswith("int8") else 1e-4, rtol=0
        )


def test_moe_layers_and_attention_biases_are_named_errors():
    moe = transformers.DeepseekV3Config(**{**TINY, "first_k_dense_replace": 1}).to_dict()
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts"):
        ModelConfig.from_hf(moe)
    biased = transformers.DeepseekV3Config(**{**TINY, "attention_bias": True}).to_dict()
    with pytest.raises(UnsupportedArchitectureError, match="attention_bias"):
        ModelConfig.from_hf(biased)


def test_kvzip_jax_convert_round_trips_a_saved_deepseek_folder(tmp_path):
    """`kvzip-jax convert --hf` writes the checkpoint; registry.load reads it back to the same config and the
    same logits as the folder converted in memory (a YaRN config: its RoPE parameters make the trip too)."""
    import shutil

    from kvzip_jax.cli import main as cli_main
    from kvzip_jax.weights import registry
    from tests.conftest import tokenizer_folder

    model = _tiny_hf_model("yarn", seed=4)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    for file in tokenizer_folder(registry.SMOLLM2).iterdir():  # convert saves the folder's tokenizer beside the weights
        shutil.copy(file, folder / file.name)
    assert cli_main(["convert", "--hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    cfg, params = params_from_hf(folder)
    loaded = registry.load(str(tmp_path / "ck"))
    assert loaded.cfg == cfg and cfg.rope.kind == "yarn"
    tokens = _tokens(cfg, 1, 12, seed=5)
    want = gen.prefill(jax.tree.map(jnp.asarray, params), cfg, tokens)[0]
    np.testing.assert_array_equal(np.asarray(gen.prefill(loaded.params, loaded.cfg, tokens)[0]), np.asarray(want))


def _reread(cfg, prefix: int, context: np.ndarray, prompt: int = 6):
    """One-chunk reread inputs over rows [prefix | context]: [random prompt | the context] (KVzip's layout, the
    prompt standing in for its instruction and anchor), as kvzip.reread_inputs lays them out."""
    from kvzip_jax.kvzip.scoring import RereadInputs

    B, n = context.shape
    tokens = np.concatenate([_tokens(cfg, B, prompt, seed=9), context], axis=1)  # [B, prompt + n]
    width = -(-tokens.shape[1] // 64) * 64
    padded = np.zeros((1, B, width), np.int32)
    padded[0, :, : tokens.shape[1]] = tokens
    full = lambda value: jnp.full((1, B), value, jnp.int32)
    return RereadInputs(
        tokens=jnp.asarray(padded),
        num_valid=full(tokens.shape[1]),
        chunk_start=full(prefix),
        chunk_len=full(n),
        prefix_len=jnp.full((B,), prefix, jnp.int32),
        context_len=jnp.full((B,), n, jnp.int32),
        chunk_size=64,
    ), tokens


def test_kvzip_scores_on_an_mla_cache_are_the_max_over_heads_and_rows_of_the_rereads_softmax(one):
    """Per layer and cached context token: the largest attention weight any head gives it from any reread row, read
    from transformers' own eager attention over [cache | reread] (1e-5); budgets exact per layer and token; the
    ragged latent cache at 0.3 holds at most 0.32x the full one's bytes."""
    from kvzip_jax import kvzip
    from kvzip_jax.kvzip.eviction import keep_mask

    model, cfg, params = one
    prefix, n = 4, 40
    rows = _tokens(cfg, 2, prefix + n, seed=6)
    _, cache = gen.prefill(params, cfg, rows, capacity=256)
    reread, tokens = _reread(cfg, prefix, rows[:, prefix:])
    scores = np.asarray(jax.jit(kvzip.score)(params, cfg, cache, reread))  # [L, B, 1, n]
    with torch.no_grad():
        past = model(torch.tensor(rows, dtype=torch.long), use_cache=True).past_key_values
        weights = model(
            torch.tensor(tokens, dtype=torch.long), past_key_values=past, use_cache=True, output_attentions=True
        ).attentions  # per layer [B, N, T, cache + T]
    want = np.stack([w.numpy()[:, :, :, prefix : prefix + n].max(axis=(1, 2)) for w in weights])[:, :, None]
    np.testing.assert_allclose(scores[..., :n], want, atol=1e-5, rtol=0)

    keep = keep_mask(jnp.asarray(scores), jnp.full((2,), n), 0.3)  # [L, B, 1, n]
    assert (np.asarray(keep[..., :n]).sum(axis=(0, 2, 3)) == int(0.3 * cfg.num_layers * n)).all()
    masked = kv.mask_context(cache, keep, jnp.full((2,), prefix), jnp.full((2,), n))
    full_bytes = kv.used_bytes(cache)
    ragged = kv.pack(masked, 0)
    context_share = (kv.used_bytes(ragged) - 2 * cfg.num_layers * prefix * (8 + 32) * 4) / (
        full_bytes - 2 * cfg.num_layers * prefix * (8 + 32) * 4
    )
    assert context_share <= 0.32 and kv.nbytes(ragged) < kv.nbytes(cache)


@pytest.mark.extended  # its parts run by default: KVzip scores, every cache form (here), kv bits (test_eval_sweep)
def test_an_eval_sweep_runs_on_an_mla_model(tmp_path):
    """KVzip and Attention Matching (kept and fitted latents) over a tiny random MLA model through the sweep, int4
    too: every answer recorded, the report's tables and plots written, the kept latents' bytes falling with the ratio
    and the bits."""
    from kvzip_jax.eval import report
    from kvzip_jax.eval import sweep as sw
    from kvzip_jax.models.params import init_params
    from kvzip_jax.weights import registry
    from kvzip_jax.weights.registry import LoadedModel
    from tests.conftest import bundled_tokenizer
    from tests.test_eval_sweep import examples

    tok = bundled_tokenizer(registry.SMOLLM2)
    cfg = ModelConfig.from_hf(transformers.DeepseekV3Config(**TINY, **VARIANTS["q_lora"]).to_dict())
    cfg = dataclasses.replace(cfg, vocab_size=len(tok), max_position=2048, tie_embeddings=True)
    model = LoadedModel("tiny-mla", cfg, init_params(cfg, seed=0, scale=0.3), tok)
    config = sw.SweepConfig(
        methods=("kvzip", "am-hak", "am-hak-fl"), ratios=(0.2,), batch_size=3, kv_bits=(16, 4), kv_group=8
    )
    path = tmp_path / "results.jsonl"
    sw.run_sweep(model, examples(), config, path, progress=False)
    written = report.write_report(path, tmp_path)
    assert all(p.stat().st_size > 0 for p in written.values()) and "pareto" in written
    rows = {(r["method"], r["ratio"]): r for r in report.summarize(report.read_records(path))}
    assert rows["full", 1.0]["n"] == sum(len(ex.questions) for ex in examples())
    assert rows["kvzip", 0.2]["bytes_share"] < rows["full", 1.0]["bytes_share"] == 100.0
    assert rows["kvzip+int4", 0.2]["bytes_share"] < rows["kvzip", 0.2]["bytes_share"]
    for method in ("am-hak", "am-hak-fl"):
        assert rows[method, 0.2]["n"] == rows["full", 1.0]["n"] and rows[method, 0.2]["bytes_share"] < 100.0


def test_head_level_kvzip_and_refined_attention_matching_are_named_errors_on_mla(one):
    from kvzip_jax import matching
    from kvzip_jax.kvzip.head_level import HeadScoresError, context_head_scores

    _, cfg, params = one
    with pytest.raises(HeadScoresError, match="does not apply to multi-head latent attention"):
        context_head_scores(params, cfg, _tokens(cfg, 1, 20)[0], None)
    rows = _tokens(cfg, 1, 24)
    _, cache = gen.prefill(params, cfg, rows, capacity=64)
    reread, _ = _reread(cfg, 4, rows[:, 4:])
    with pytest.raises(ValueError, match="refine_steps must be 0 on multi-head latent attention"):
        matching.compact(params, cfg, cache, reread, matching.MatchingConfig(ratio=0.3, refine_steps=2))


@pytest.mark.heavy
def test_attention_matching_on_mla_fits_one_bias_per_kept_token_for_every_head(one):
    """AM on the latent cache, per layer: the reference queries are every head's absorbed ones. Keeping every token,
    every head attends to new queries as before (1e-3, test_matching's bar). At 0.3 (HAK over the heads' pooled
    attention; jit and eager agree, as test_compact asks) the kept latents are the cache's own with one bias each,
    and on queries the fit never saw (a pass of random tokens) the heads' log-masses are far closer to the full
    context's than evicting the same tokens gives (error ratio < 0.1 in every layer and row), their outputs closer
    over all layers and rows together (the values are not refitted, so one layer and row of the four is 1.10x
    eviction's)."""
    from kvzip_jax import matching
    from kvzip_jax.matching.self_study import probes_from_rows

    _, cfg, params = one
    prefix, n, B = 4, 40, 2
    rows = _tokens(cfg, B, prefix + n, seed=6)
    _, cache = gen.prefill(params, cfg, rows, capacity=256)
    reread, _ = _reread(cfg, prefix, rows[:, prefix:])
    seen = matching.reference_queries(params, cfg, cache, reread)  # per layer [B, 1, N R, R + dr]
    fresh_rows = [[_tokens(cfg, 1, 24, seed=20 + 2 * p + b)[0] for b in range(B)] for p in range(3)]
    fresh = matching.reference_queries(params, cfg, cache, None, ("self-study",), probes=probes_from_rows(fresh_rows))
    R, dr = cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    assert seen.q[0].shape[1] == 1 and seen.q[0].shape[-1] == R + dr

    config = matching.MatchingConfig(ratio=0.3, budget="uniform")
    compacted, counts = compact_jit_and_eager(params, cfg, cache, reread, config)
    context = slice(prefix, prefix + n)
    output_errors = np.zeros(2)  # fitted, evicted
    for i, (layer, before) in enumerate(zip(compacted.layers, cache.layers)):
        keys = np.concatenate([np.asarray(before.v), np.asarray(before.k)], axis=-1)[:, 0, context]  # [B, n, R + dr]
        latents = np.asarray(before.v)[:, 0, context]  # [B, n, R]
        keep, bias = np.asarray(layer.keep)[:, 0, context], np.asarray(layer.bias)[:, 0, context]
        np.testing.assert_array_equal(np.asarray(layer.v), np.asarray(before.v))  # values kept, not refitted
        assert (keep.sum(axis=1) == np.asarray(counts)[i, :, 0]).all()
        for b in range(B):
            q_seen = seen.q[i][b, 0][np.asarray(seen.valid[b])]
            q_new = fresh.q[i][b, 0][np.asarray(fresh.valid[b])]
            want = matching.attend(q_new, keys[b], latents[b], cfg.query_scale)
            _, beta, _ = matching.fit_head(
                q_seen, keys[b], latents[b], jnp.arange(n), cfg.query_scale, fit_values=False
            )  # every token kept: attention as it was
            for got, target in zip(matching.attend(q_new, keys[b], latents[b], cfg.query_scale, beta), want):
                np.testing.assert_allclose(np.asarray(got), np.asarray(target), atol=1e-3)  # as test_matching's
            kept = keep[b]
            fitted = matching.attend(q_new, keys[b][kept], latents[b][kept], cfg.query_scale, bias[b][kept])
            evicted = matching.attend(q_new, keys[b][kept], latents[b][kept], cfg.query_scale)
            error = lambda got, target: float(jnp.mean((got - target) ** 2))
            output_errors += [error(fitted[0], want[0]), error(evicted[0], want[0])]
            assert error(fitted[1], want[1]) < 0.1 * error(evicted[1], want[1]), (i, b)
    assert output_errors[0] < output_errors[1]


def test_attention_matching_with_fitted_latents_holds_key_and_value_latents_apart(one, tmp_path):
    """latent_values 'fitted': each compacted layer takes the split layout (k = [latent | RoPE key], the cache's own
    at every slot; v the value latents, refitted at the kept context slots and as they were elsewhere); jit and eager
    agree. At the same bytes it keeps fewer tokens (each holds a second latent), whose outputs on queries the fit
    never saw are closer to the full context's than those of the kept-latents fit (pooled over layers and rows, as
    studies/mla_matching_variants measured on larger random models). The compacted cache decodes in every form: the
    naive form equals the absorbed one (1e-5); ragged gives the masked cache's greedy tokens and logits (1e-4), int8
    its greedy tokens; new tokens go in the split layout; a saved ragged cache loads back exactly."""
    from kvzip_jax import cache_io, matching
    from kvzip_jax.matching.self_study import probes_from_rows
    from kvzip_jax.weights import registry
    from kvzip_jax.weights.registry import LoadedModel
    from tests.conftest import bundled_tokenizer

    _, cfg, params = one
    R, dr = cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    prefix, n, B = 4, 40, 2
    rows = _tokens(cfg, B, prefix + n, seed=6)
    logits, cache = gen.prefill(params, cfg, rows, capacity=128)
    reread, _ = _reread(cfg, prefix, rows[:, prefix:])
    configs = {v: matching.MatchingConfig(ratio=0.3, budget="uniform", latent_values=v) for v in ("kept", "fitted")}
    fitted, counts = compact_jit_and_eager(params, cfg, cache, reread, configs["fitted"])
    kept, kept_counts = jax.jit(matching.compact)(params, cfg, cache, reread, configs["kept"])
    assert (np.asarray(counts) < np.asarray(kept_counts)).all()
    packed = {v: kv.pack(c, 16) for v, c in (("fitted", fitted), ("kept", kept))}
    fixed = cfg.num_layers * B * prefix * (2 * R + dr) * 4  # the prefix is never compacted, but takes the layout
    full_context = cfg.num_layers * B * n * (R + dr) * 4
    share = (kv.used_bytes(packed["fitted"]) - fixed) / full_context
    kept_share = (kv.used_bytes(packed["kept"]) - cfg.num_layers * B * prefix * (R + dr + 1) * 4) / full_context
    assert share <= 0.3 + 1e-9 and abs(share - kept_share) < 2 * (2 * R + dr + 1) / ((R + dr) * n)

    fresh_rows = [[_tokens(cfg, 1, 24, seed=20 + 2 * p + b)[0] for b in range(B)] for p in range(3)]
    fresh = matching.reference_queries(params, cfg, cache, None, ("self-study",), probes=probes_from_rows(fresh_rows))
    context = slice(prefix, prefix + n)
    errors = np.zeros(2)  # fitted latents, kept latents
    for i, (layer, other, before) in enumerate(zip(fitted.layers, kept.layers, cache.layers)):
        keys = np.asarray(mla_latent_keys(before))[:, 0]  # [B, C, R + dr]
        assert layer.k.shape[-1] == R + dr and other.k.shape[-1] == dr
        np.testing.assert_array_equal(np.asarray(layer.k)[:, 0], keys)  # every slot's key, as the cache had it
        v, v_before = np.asarray(layer.v)[:, 0], np.asarray(before.v)[:, 0]
        keep = np.asarray(layer.keep)[:, 0]
        np.testing.assert_array_equal(v[~keep], v_before[~keep])
        for b in range(B):
            q_new = fresh.q[i][b, 0][np.asarray(fresh.valid[b])]
            want, _ = matching.attend(q_new, keys[b, context], v_before[b, context], cfg.query_scale)
            for j, (lay, mask) in enumerate(((layer, keep[b]), (other, np.asarray(other.keep)[b, 0]))):
                m = np.flatnonzero(mask[context]) + prefix
                got, _ = matching.attend(
                    q_new, keys[b, m], np.asarray(lay.v)[b, 0, m], cfg.query_scale, np.asarray(lay.bias)[b, 0, m]
                )
                errors[j] += float(jnp.mean((got - want) ** 2))
    assert errors[0] < errors[1], errors

    naive = dataclasses.replace(cfg, mla_form="naive")
    step = lambda c, config: gen.forward_step(
        params,
        jnp.asarray(_tokens(cfg, B, 6, seed=8)),
        jnp.array([6, 6], jnp.int32),
        jax.tree.map(jnp.copy, c),
        config,
        logits="all",
    )
    got, after = step(fitted, cfg)[:2]
    np.testing.assert_allclose(np.asarray(got), np.asarray(step(fitted, naive)[0]), atol=1e-5, rtol=0)
    written = np.asarray(after.layers[0].k)[:, 0, prefix + n : prefix + n + 6]  # the new tokens' keys
    np.testing.assert_array_equal(written[..., :R], np.asarray(after.layers[0].v)[:, 0, prefix + n : prefix + n + 6])
    want, _, want_logits = gen.decode(params, cfg, logits, jax.tree.map(jnp.copy, fitted), 6, return_logits=True)
    for name, form in (
        ("ragged", packed["fitted"]),
        ("int8", kv.quantized(packed["fitted"], QuantFormat(8, 8))),
        ("int8-uncentred", kv.quantized(packed["fitted"], QuantFormat(8, 8), center=False)),
    ):
        tokens, _, form_logits = gen.decode(params, cfg, logits, jax.tree.map(jnp.copy, form), 6, return_logits=True)
        assert tokens == want, name
        if name == "ragged":
            np.testing.assert_allclose(np.asarray(form_logits), np.asarray(want_logits), atol=1e-4, rtol=0)
    model = LoadedModel("tiny-mla", cfg, params, bundled_tokenizer(registry.SMOLLM2))
    loaded, _ = cache_io.load(cache_io.save(tmp_path / "fitted", packed["fitted"], model), model)
    chex.assert_trees_all_equal(loaded, packed["fitted"])
    with pytest.raises(matching.LatentValuesError, match="this model has no latent cache"):
        matching.compact(
            params,
            dataclasses.replace(cfg, mla=None, architecture="llama", num_kv_heads=4, head_dim=16),
            cache,
            reread,
            configs["fitted"],
        )


def mla_latent_keys(layer):
    from kvzip_jax.models.mla import latent_keys

    return latent_keys(layer.k, layer.v)
