"""The decoder against transformers on tiny random models of every family, plus cache, prefill and decode laws."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ContextTooLongError, EmptyInputError
from kvzip_jax.models.observer import AttentionView, map_key_blocks, take_keys
from kvzip_jax.models.transformer import forward
from kvzip_jax.weights.hf import params_from_hf

TINY = dict(
    vocab_size=211,
    hidden_size=96,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attn_implementation="eager",
)

FAMILIES = {
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            max_position_embeddings=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # YaRN as Qwen2.5's long-context configs set it (factor 4 over the original context; here 64 tokens).
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16)),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}


def _tiny_hf_model(family: str, seed: int = 0):
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**TINY, **extra}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # larger than default init, so that mistakes show up in the logits
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif "norm" in name:
                p.normal_(0.0 if family == "gemma3" else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, transformers model, our config, our params) converted through an HF safetensors folder."""
    model = _tiny_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    cfg, params = params_from_hf(folder)
    return request.param, model, cfg, jax.tree.map(jnp.asarray, params)


def _tokens(cfg, batch, length, seed=1):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)


def _full_forward(params, cfg, tokens, capacity=128, **kw):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(params, jnp.asarray(tokens), positions, kv.init_cache(cfg, B, capacity), cfg, **kw)


def test_logits_and_cache_match_transformers(tiny):
    family, model, cfg, params = tiny
    tokens = _tokens(cfg, 2, 40)
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), use_cache=True)
    logits, cache, _ = _full_forward(params, cfg, tokens, logits="all")
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=0)
    hf_cache = out.past_key_values
    for i, layer in enumerate(cache.layers):
        ref_k = hf_cache.layers[i].keys.numpy()  # [B, K, T or window - 1, H]
        ref_v = hf_cache.layers[i].values.numpy()
        kept = ref_k.shape[2]  # transformers keeps only the window on sliding layers
        assert int(layer.lengths.min()) == int(layer.lengths.max()) == 40
        # float32 against torch's float32: a few ulps per op, grown over the layers; relative for keys of size ~3
        np.testing.assert_allclose(np.asarray(layer.k[:, :, 40 - kept : 40]), ref_k, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(layer.v[:, :, 40 - kept : 40]), ref_v, atol=1e-5, rtol=1e-5)
    if family == "gemma3":
        assert cfg.window_for(0) == 16 and kept < 40  # the window really cut the sliding layer


def test_chunked_prefill_then_decode_equals_full_forward(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, 2, 70)
    full, _, _ = _full_forward(params, cfg, tokens, logits="all")
    progress = []
    logits, cache = gen.prefill(params, cfg, tokens[:, :50], chunk=16, on_chunk=lambda *a: progress.append(a))
    assert progress == [(16, 50), (32, 50), (48, 50), (50, 50)]  # a progress bar's steps, one per chunk
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, 49]), atol=1e-4, rtol=0)
    for t in range(50, 70):
        step_logits, cache = gen.forward_step(
            params, jnp.asarray(tokens[:, t : t + 1]), jnp.array([1, 1], jnp.int32), cache, cfg
        )
        np.testing.assert_allclose(np.asarray(step_logits[:, 0]), np.asarray(full[:, t]), atol=1e-4, rtol=0)


def test_ragged_batch_equals_rows_one_by_one(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, 2, 60)
    rows = [tokens[0, :23], tokens[1, :60]]
    logits, cache = gen.prefill(params, cfg, rows, chunk=16)
    for b, row in enumerate(rows):
        alone, _ = gen.prefill(params, cfg, [row], chunk=16)
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(alone[0]), atol=1e-4, rtol=0)
    assert np.asarray(cache.next_position).tolist() == [23, 60]
    assert np.asarray(cache.layers[0].lengths[:, 0]).tolist() == [23, 60]


def test_multi_turn_append_continues_positions(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, 1, 45)
    full, _, _ = _full_forward(params, cfg, tokens, logits="all")
    _, cache = gen.prefill(params, cfg, tokens[:, :30], chunk=16)
    logits, cache = gen.prefill(params, cfg, tokens[:, 30:], cache, chunk=16)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(full[0, 44]), atol=1e-4, rtol=0)
    assert int(cache.next_position[0]) == 45


def test_greedy_decode_equals_step_by_step_recompute(tiny):
    _, _, cfg, params = tiny
    rows = [_tokens(cfg, 1, 20)[0], _tokens(cfg, 1, 33, seed=2)[0]]
    logits, cache = gen.prefill(params, cfg, rows)
    generated, _ = gen.decode(params, cfg, logits, cache, 8)
    for row, got in zip(rows, generated):
        seq = list(row)
        for _ in range(8):  # a fresh prefill of the whole sequence each step, same capacity bucket
            out, _ = gen.prefill(params, cfg, [np.array(seq, np.int32)], capacity=64)
            seq.append(int(jnp.argmax(out[0])))
        assert got == seq[len(row) :]


def test_stop_tokens_and_sampling_seed(tiny):
    _, _, cfg, params = tiny
    prompt = _tokens(cfg, 1, 12)
    logits, cache = gen.prefill(params, cfg, prompt)
    greedy, _ = gen.decode(params, cfg, logits, cache, 6)
    stop = greedy[0][2]
    logits, cache = gen.prefill(params, cfg, prompt)
    stopped, _ = gen.decode(params, cfg, logits, cache, 6, stop_tokens=[stop])
    assert stopped[0] == greedy[0][: greedy[0].index(stop) + 1]
    draws = []
    for seed in (7, 7, 8):
        logits, cache = gen.prefill(params, cfg, prompt)
        out, _ = gen.decode(params, cfg, logits, cache, 6, sampling=gen.Sampling.make(1.0, 0.95, seed))
        draws.append(out[0])
    assert draws[0] == draws[1]
    assert all(0 <= t < cfg.vocab_size for t in draws[2])
    logits, cache = gen.prefill(params, cfg, prompt)
    nucleus_of_one, _ = gen.decode(params, cfg, logits, cache, 6, sampling=gen.Sampling.make(1.0, 1e-6, 3))
    assert nucleus_of_one == greedy  # top_p -> 0 keeps only the most likely token


@dataclasses.dataclass(frozen=True)
class RecordProbs:
    """A trivial observer: the attention probabilities of one layer."""

    layer: int

    def __call__(self, view: AttentionView):
        return view.probs if view.layer == self.layer else None


def test_observer_sees_the_attention_it_should(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, 1, 24)
    layer = 1
    logits_plain, cache_plain, _ = _full_forward(params, cfg, tokens, capacity=32)
    logits, cache, aux = _full_forward(params, cfg, tokens, capacity=32, observer=RecordProbs(layer))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_plain), atol=1e-5)  # observing changes nothing
    probs = np.asarray(aux["observed"][layer])  # [B, K, G, T, C + T]: the 32 cache slots (empty), then new keys
    assert aux["observed"][0] is None

    # Direct computation from the cached keys and the layer's own queries (recorded by a second observer).
    @dataclasses.dataclass(frozen=True)
    class RecordQueries:
        def __call__(self, view):
            return view.q if view.layer == layer else None

    _, _, aux_q = _full_forward(params, cfg, tokens, capacity=32, observer=RecordQueries())
    q = np.asarray(aux_q["observed"][layer])[0]  # [T, K, G, H]
    k = np.asarray(cache.layers[layer].k)[0, :, :24]  # [K, S, H]
    scores = np.einsum("tkgh,ksh->kgts", q, k) * cfg.query_scale
    t, s = np.arange(24)[:, None], np.arange(24)[None, :]
    visible = s <= t
    if cfg.window_for(layer):
        visible &= (t - s) < cfg.window_for(layer)
    scores = np.where(visible, scores, -np.inf)
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs[0, :, :, :, 32:], expected, atol=1e-5)
    assert np.all(probs[..., :32] == 0)


def test_logits_at_token_indices_equal_all_logits_there(tiny):
    _, _, cfg, params = tiny
    tokens = _tokens(cfg, 2, 12)
    full, _, _ = _full_forward(params, cfg, tokens, logits="all")
    at = np.array([[0, 5, 11], [3, 3, 7]], np.int32)
    got, _, _ = _full_forward(params, cfg, tokens, logits="at", at=jnp.asarray(at))
    np.testing.assert_allclose(np.asarray(got), np.take_along_axis(np.asarray(full), at[..., None], 1), atol=1e-5)
    with pytest.raises(ValueError, match="at"):
        _full_forward(params, cfg, tokens, logits="all", at=jnp.asarray(at))


def test_new_length_in_same_bucket_does_not_recompile(tiny):
    _, _, cfg, params = tiny
    gen.prefill(params, cfg, _tokens(cfg, 1, 37), capacity=128, chunk=32)
    compiled = gen.forward_step._cache_size()
    gen.prefill(params, cfg, _tokens(cfg, 1, 45, seed=5), capacity=128, chunk=32)
    assert gen.forward_step._cache_size() == compiled


def test_chunks_of_one_width_compile_the_step_once_with_params_committed_to_a_device(tiny):
    """Params loaded from a checkpoint are committed to their device; the fresh cache goes there too, else the first
    chunk (uncommitted cache) and the later ones (the step's committed output) compile the same step twice."""
    _, _, cfg, params = tiny
    params = jax.device_put(params, jax.devices()[0])
    compiled = gen.forward_step._cache_size()
    gen.prefill(params, cfg, _tokens(cfg, 1, 96, seed=7), capacity=256, chunk=32)  # three chunks of width 32
    assert gen.forward_step._cache_size() == compiled + 1


def test_bad_input_fails_early_with_named_errors(tiny):
    _, _, cfg, params = tiny
    with pytest.raises(EmptyInputError):
        gen.prefill(params, cfg, [])
    with pytest.raises(EmptyInputError):
        gen.prefill(params, cfg, [np.array([], np.int32)])
    with pytest.raises(ContextTooLongError, match="maximum context"):
        gen.prefill(params, cfg, _tokens(cfg, 1, cfg.max_position + 1))
    _, cache = gen.prefill(params, cfg, _tokens(cfg, 1, 20), capacity=32)
    with pytest.raises(ContextTooLongError, match="capacity"):
        gen.prefill(params, cfg, _tokens(cfg, 1, 13), cache)


def test_decode_stops_when_cache_is_full(tiny):
    _, _, cfg, params = tiny
    logits, cache = gen.prefill(params, cfg, _tokens(cfg, 1, 28), capacity=32)
    out, cache = gen.decode(params, cfg, logits, cache, 10)
    assert len(out[0]) == 4  # every emitted token is also cached: 28 + 4 fill the 32 slots
    assert int(cache.layers[0].lengths.max()) == 32


def test_config_round_trip_and_hashable(tiny):
    _, model, cfg, _ = tiny
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert hash(cfg) == hash(ModelConfig.from_hf(model.config.to_dict()))


def test_ask_leaves_the_context_cache_as_it_was(tiny):
    _, _, cfg, params = tiny
    context, q1, q2 = _tokens(cfg, 1, 30)[0], _tokens(cfg, 1, 5, seed=3)[0], _tokens(cfg, 1, 7, seed=4)[0]
    _, cache = gen.prefill(params, cfg, [context], capacity=64)
    before = jax.tree.map(np.asarray, cache)
    _, cache = gen.ask(params, cfg, cache, q1, 6)
    after_q1, cache = gen.ask(params, cfg, cache, q2, 6)
    assert np.asarray(cache.next_position).tolist() == [30]
    assert all(np.array_equal(a.lengths, b.lengths) for a, b in zip(before.layers, cache.layers))
    _, fresh = gen.prefill(params, cfg, [context], capacity=64)
    only_q2, _ = gen.ask(params, cfg, fresh, q2, 6)
    assert after_q1 == only_q2


@pytest.mark.parametrize("size", [1, 4, 10, 16])
def test_map_key_blocks_equals_the_whole_computation(size):
    """Blockwise per-key statistics (the last block clipped) equal the same function over all keys at once."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 3, 5, 8)), jnp.float32)  # [B, K, T, H]
    keys = jnp.asarray(rng.normal(size=(2, 3, 10, 8)), jnp.float32)  # [B, K, S, H], S = 10
    visible = jnp.asarray(rng.random((2, 3, 5, 10)) < 0.7)  # [B, K, T, S]

    def key_max(kb, vis):  # [B, K, s, H], [B, K, T, s] -> [B, K, s]
        s = jnp.einsum("BKTH,BKSH->BKTS", q, kb)
        return jnp.where(vis, s, -jnp.inf).max(axis=2)

    def block(start, width):
        return key_max(take_keys(keys, start, width, axis=2), take_keys(visible, start, width, axis=3))

    got = map_key_blocks(block, 10, size=size)
    assert got.shape == (2, 3, 10)
    np.testing.assert_allclose(got, key_max(keys, visible), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 40])
def test_blocked_attention_over_cache_and_new_keys_equals_dense_softmax(window):
    """Online softmax over cache blocks, then the new keys in causal tiles (T = 300: two tiles, the second padded),
    equals a float64 softmax over [visible cache slots | new keys]; lse and the subset's lse too."""
    from kvzip_jax.models.attention import blocked_attention

    rng = np.random.default_rng(3)
    B, K, G, H, C, T, scale = 2, 2, 3, 8, 64, 300, 0.3
    q = rng.normal(size=(B, T, K, G, H)).astype(np.float32)
    k, v = (rng.normal(size=(B, K, C, H)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.normal(size=(B, K, T, H)).astype(np.float32) for _ in range(2))
    filled = rng.integers(10, C, (B, K)).astype(np.int32)
    keep = rng.random((B, K, C)) < 0.8
    query_slots = filled[..., None] + np.arange(T, dtype=np.int32)  # [B, K, T]
    subset = lambda slots: (slots < 5) | ((slots >= 20) & (slots < 40))
    out, lse, subset_lse = jax.jit(lambda *a: blocked_attention(*a, window, scale, jnp.asarray(keep), subset=subset))(
        q, k, v, jnp.asarray(filled), k_new, v_new, jnp.asarray(query_slots)
    )

    for b in range(B):
        for h in range(K):
            cache_slots = np.arange(C)
            keys = np.concatenate([k[b, h, : filled[b, h]], k_new[b, h]]).astype(np.float64)
            values = np.concatenate([v[b, h, : filled[b, h]], v_new[b, h]]).astype(np.float64)
            slots = np.concatenate([cache_slots[: filled[b, h]], query_slots[b, h]])
            in_subset = np.concatenate([subset(cache_slots[: filled[b, h]]), np.ones(T, bool)])
            kept = np.concatenate([keep[b, h, : filled[b, h]], np.ones(T, bool)])
            visible = (slots[None, :] <= query_slots[b, h][:, None]) & kept[None, :]  # [T, S]
            if window is not None:
                visible &= query_slots[b, h][:, None] - slots[None, :] < window
            logits = np.einsum("tgh,sh->gts", q[b, :, h].astype(np.float64), keys) * scale  # [G, T, S]
            weights = np.where(visible, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
            top = logits.max(-1)
            expected_lse = top + np.log(weights.sum(-1))
            expected_subset = top + np.log(np.where(in_subset, weights, 0.0).sum(-1))
            expected_out = np.einsum("gts,sh->tgh", weights / weights.sum(-1, keepdims=True), values)
            np.testing.assert_allclose(np.asarray(out)[b, :, h], expected_out, atol=1e-5)
            np.testing.assert_allclose(np.asarray(lse)[b, h], expected_lse, atol=1e-5)
            np.testing.assert_allclose(np.asarray(subset_lse)[b, h], expected_subset, atol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_new_keys_after_the_cache_alone_equal_one_pass(window):
    """then_new_keys continues blocked_attention's result over the cache alone (as merged from seq shards) with the
    new keys: out, lse and the subset's lse equal one pass over [cache | new keys], with a head whose cache is empty
    and a kept mask with holes."""
    from kvzip_jax.models.attention import blocked_attention, then_new_keys

    rng = np.random.default_rng(4)
    B, K, G, H, C, T, scale = 2, 2, 3, 8, 64, 70, 0.3
    q = jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32)
    k, v, k_new, v_new = (
        jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in [(B, K, C, H)] * 2 + [(B, K, T, H)] * 2
    )
    filled = jnp.asarray(rng.integers(10, C, (B, K)), jnp.int32).at[0, 1].set(0)
    keep = jnp.asarray(rng.random((B, K, C)) < 0.8)
    query_slots = filled[..., None] + jnp.arange(T, dtype=jnp.int32)
    subset = lambda slots: (slots < 5) | ((slots >= 20) & (slots < 40))
    whole = blocked_attention(q, k, v, filled, k_new, v_new, query_slots, window, scale, keep, subset=subset)
    cached = blocked_attention(q, k, v, filled, None, None, query_slots, window, scale, keep, subset=subset)
    parts = then_new_keys(q, *cached, k_new, v_new, filled, query_slots, window, scale)
    for got, want, name in zip(parts, whole, ("out", "lse", "subset_lse")):
        assert np.isfinite(np.asarray(got)).all(), name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=name)
