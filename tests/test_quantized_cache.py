"""Quantized caches (cache.quantized): every form attends as its dequantized twin, the full-precision window flushes
by its rule, marks rewind exactly, bytes follow the format, and no float copy of a quantized store is made."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.models import attention, ragged_attention
from kvzip_jax.models.cached_attention import quantized_attention
from kvzip_jax.models.params import init_params
from kvzip_jax.quant import groups as quant
from tests.test_compressed_cache import CFG, CONTEXT, PARAMS, QUESTION, SCORES, _context_cache, _masked, answer_alike

FORMATS = [quant.QuantFormat(bits=8, group=8), quant.QuantFormat(bits=4, group=4, scale_dtype="float16")]
copied = lambda tree: jax.tree.map(jnp.array, tree)


def _form(name: str) -> kv.KVCache:
    keep = keep_mask(SCORES, jnp.array([CONTEXT]), 0.3)
    if name == "dense":
        return _context_cache()
    if name == "masked":
        return _masked(keep)
    if name == "compacted":  # a masked cache with a per-slot bias, as Attention Matching leaves it
        masked = _masked(keep)
        bias = lambda layer: jnp.where(  # on filled slots only: new tokens get none
            kv.visible_slots(dataclasses.replace(layer, keep=None)),
            jnp.asarray(np.random.default_rng(3).normal(0, 1, layer.keep.shape), jnp.float32),
            0.0,
        )
        return dataclasses.replace(
            masked, layers=tuple(dataclasses.replace(layer, bias=bias(layer)) for layer in masked.layers)
        )
    compacted = _form("compacted") if name == "ragged-compacted" else _masked(keep)
    return kv.pack(compacted, 16)


def _dequantized_twin(cache: kv.KVCache) -> kv.KVCache:
    """The unquantized cache holding what a quantized one (with an empty window) stands for: centred keys with their
    centres added back."""

    def keys(layer):
        k = quant.dequantize(layer.store.k)
        return k if layer.key_center is None else k + kv._per_slot(layer.store, layer.key_center)

    return kv.KVCache(
        tuple(
            dataclasses.replace(layer.store, k=keys(layer), v=quant.dequantize(layer.store.v)) for layer in cache.layers
        ),
        cache.next_position,
    )


@pytest.mark.parametrize(
    "form,fmt,center",
    [
        ("dense", FORMATS[0], True),
        pytest.param("masked", FORMATS[1], True, marks=pytest.mark.heavy),  # make test-fast: the first and last
        pytest.param("compacted", FORMATS[0], True, marks=pytest.mark.heavy),
        pytest.param("ragged", FORMATS[1], True, marks=pytest.mark.heavy),
        ("ragged-compacted", FORMATS[1], True),
        pytest.param("masked", FORMATS[1], False, marks=pytest.mark.heavy),
        pytest.param("ragged-compacted", FORMATS[0], False, marks=pytest.mark.heavy),
    ],
    ids=[
        "dense-int8",
        "masked-int4",
        "compacted-int8",
        "ragged-int4",
        "ragged-compacted-int4",
        "masked-int4-uncentred",
        "ragged-compacted-int8-uncentred",
    ],
)
def test_every_form_attends_as_its_dequantized_twin(form, fmt, center):
    """A question and 6 greedy tokens fit the window: logits within 1e-5 of the twin's and the same tokens (int8 and
    int4 on both store kinds: the attention test below covers each width on each); centred keys (the default) attend
    as their twin with the centres added back, through the logit attention adds to the store's log-sum-exp."""
    cache = kv.quantized(_form(form), fmt, window=16, center=center)
    assert (cache.layers[0].key_center is None) == (not center)
    cache = answer_alike(cache, copied(_dequantized_twin(cache)), 6, atol=1e-5)
    assert int(cache.layers[0].window.lengths[0, 0]) == len(QUESTION) + 6  # nothing flushed


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("ragged", [False, True])
def test_attention_over_store_and_window_equals_dense_attention(ragged, bits):
    """The store (dequantized block by block, in chunks for a ragged one) then the window, as one online softmax,
    equals dense attention over [dequantized store | window] with the causal bound on the new tokens."""
    rng = np.random.default_rng(0)
    B, K, G, H, T, R = 2, 2, 3, 16, 3, 8
    stored = np.array([[5, 0], [16, 9]])  # [B, K] (an empty head included)
    in_window = np.array([[4, 4], [7, 7]])  # the T new tokens are the window's last T
    q = jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, 16, H)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.normal(size=(B, K, 16)), jnp.float32)
    wk, wv = (jnp.asarray(rng.normal(size=(B, K, R, H)), jnp.float32) for _ in range(2))
    fmt = quant.QuantFormat(bits=bits, group=8)
    store = kv.LayerCache(
        k=quant.quantize(k, fmt), v=quant.quantize(v, fmt), lengths=jnp.asarray(stored, jnp.int32), bias=bias
    )
    if ragged:
        offsets = jnp.asarray([[0, 16], [0, 16]], jnp.int32)
        flat = lambda x: jax.tree.map(lambda a: a.reshape((B, K * 16) + a.shape[3:]), x)
        store = kv.RaggedLayerCache(
            k=flat(store.k),
            v=flat(store.v),
            lengths=store.lengths,
            offsets=offsets,
            bias=bias.reshape(B, K * 16),
            block=8,
        )
    layer = kv.QuantizedLayerCache(store, kv.LayerCache(k=wk, v=wv, lengths=jnp.asarray(in_window, jnp.int32)))
    query_slots = jnp.asarray(stored + in_window - T)[..., None] + jnp.arange(T)  # [B, K, T]
    out = quantized_attention(q, layer, query_slots, None, 0.25)

    keys = jnp.concatenate([quant.dequantize(quant.quantize(k, fmt)), wk], axis=2)  # [B, K, 16 + R, H]
    values = jnp.concatenate([quant.dequantize(quant.quantize(v, fmt)), wv], axis=2)
    slot = jnp.arange(16 + R)
    key_slots = jnp.where(slot < 16, slot, jnp.asarray(stored)[..., None] + slot - 16)  # [B, K, 16 + R]
    visible = jnp.where(slot < 16, slot < jnp.asarray(stored)[..., None], slot - 16 < jnp.asarray(in_window)[..., None])
    mask = attention.attention_mask(query_slots, key_slots, visible, None)
    full_bias = jnp.concatenate([bias, jnp.zeros((B, K, R))], axis=2)
    expected, _, _ = attention.dense_attention(q, keys, values, mask, 0.25, full_bias)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", ["masked", pytest.param("ragged-compacted", marks=pytest.mark.heavy)])
def test_int8_keys_beside_int4_values_attend_flush_and_count_in_their_own_formats(form):
    """k8v4 (quant.kv_formats("8/4")): int8 keys beside int4 values attend as their dequantized twin; a flush writes
    each in its own format, within its bound; a pair costs the mean of an int8 and an int4 pair."""
    keys, values = quant.kv_formats("8/4", group=4)
    cache = kv.quantized(_form(form), keys, window=16, value_fmt=values)
    store = cache.layers[0].store
    assert (store.k.format, store.v.format) == (keys, values) and (keys.bits, values.bits) == (8, 4)
    int8, int4 = (kv.quantized(_form(form), fmt, window=16) for fmt in (keys, values))
    assert 2 * kv.used_bytes(cache) == kv.used_bytes(int8) + kv.used_bytes(int4)
    answer_alike(cache, copied(_dequantized_twin(cache)), 6, atol=1e-5)

    layer = kv.quantized(_form(form), keys, window=4, value_fmt=values).layers[0]
    start = np.asarray(layer.store.lengths)
    new = jnp.asarray(np.random.default_rng(2).normal(size=(1, CFG.num_kv_heads, 9, CFG.head_dim)), jnp.float32)
    layer = jax.jit(kv.write)(layer, new, -new, jnp.array([9]))
    assert (layer.store.k.format, layer.store.v.format) == (keys, values)
    np.testing.assert_array_equal(np.asarray(layer.store.lengths), start + 8)  # all but the last of 9 in a window of 4
    for h in range(CFG.num_kv_heads):
        slots = (
            slice(int(layer.store.offsets[0, h] + start[0, h]), None)
            if isinstance(layer.store, kv.RaggedLayerCache)
            else (h, slice(int(start[0, h]), None))
        )
        stored = jax.tree.map(lambda a: a[0][slots][:8], layer.store.v)  # [8, H]
        error = np.abs(np.asarray(quant.dequantize(stored)) - -np.asarray(new[0, h, :8]))
        assert np.all(error <= np.asarray(quant.error_bound(stored)) + 1e-5)


@pytest.mark.parametrize("form,center", [("dense", True), ("ragged", True), ("ragged", False)])
def test_the_window_flushes_all_but_its_last_rows_into_the_store(form, center):
    """Writes of 3, 6, 1 and 9 tokens into a window of 4: after n tokens in [window | new], all but
    ((n - 1) mod 4) + 1 move to the store, quantized within the format's bound (centred keys: less the layer's
    key_center, which the flushes keep); the window keeps the rest exactly."""
    fmt = quant.QuantFormat(bits=4, group=4)
    cache = kv.quantized(_form(form), fmt, window=4, center=center)
    layer = cache.layers[0]
    centre = np.asarray(layer.key_center[0]) if center else np.zeros((CFG.num_kv_heads, CFG.head_dim))
    rng = np.random.default_rng(1)
    written = []  # every appended key row, in order
    store_start, window_len = np.asarray(layer.store.lengths), 0
    for T in (3, 6, 1, 9):
        k_new = jnp.asarray(rng.normal(size=(1, CFG.num_kv_heads, T, CFG.head_dim)), jnp.float32)
        layer = jax.jit(kv.write)(layer, k_new, -k_new, jnp.array([T]))
        written.append(np.asarray(k_new[0]))
        total = window_len + T
        window_len = (total - 1) % 4 + 1
        rows = np.concatenate(written, axis=1)  # [K, n, H]
        assert np.array_equal(np.asarray(layer.window.lengths), np.full((1, CFG.num_kv_heads), window_len))
        np.testing.assert_array_equal(np.asarray(layer.window.k[0, :, :window_len]), rows[:, -window_len:])
        np.testing.assert_array_equal(np.asarray(layer.window.v[0, :, :window_len]), -rows[:, -window_len:])
        flushed = rows.shape[1] - window_len
        assert np.array_equal(np.asarray(layer.store.lengths), store_start + flushed)
        for h in range(CFG.num_kv_heads):
            got, bound = _store_rows(layer.store, h, int(store_start[0, h]), flushed)
            assert np.all(np.abs(got - (rows[h, :flushed] - centre[h])) <= bound + 1e-5)


def test_centred_keys_spend_int4_levels_on_every_channel_not_on_an_offset_one():
    """Keys with one channel near -355 on every token (Qwen2.5-Coder-1.5B's layer 0, from its key bias): per-token
    int4 spends its levels on it and random queries' logits err by units; centred per channel first, the logits err
    by less than a twentieth of that. key_center is the midpoint of each channel's range over the head's visible pairs
    (an evicted outlier is ignored) in bf16, the same for the ragged form of the cache, 0 for a head with none."""
    rng = np.random.default_rng(2)
    B, K, C, H = 1, 3, 32, 16
    k = rng.normal(size=(B, K, C, H)).astype(np.float32)
    k[..., 3] += -355 + rng.uniform(-3, 3, size=(B, K, C))
    k[0, 1, 5, 7] = 1e4  # evicted below
    keep = np.ones((B, K, C), bool)
    keep[0, 1, 5] = False
    lengths = jnp.asarray([[30, 30, 0]], jnp.int32)  # head 2 holds nothing
    layer = kv.LayerCache(
        k=jnp.asarray(k),
        v=jnp.asarray(rng.normal(size=(B, K, C, H)), jnp.float32),
        lengths=lengths,
        keep=jnp.asarray(keep),
    )
    cache = kv.KVCache((layer,), jnp.array([30]))
    q = rng.normal(size=(64, H)).astype(np.float32)
    visible = np.asarray(kv.visible_slots(layer))
    errors = {}
    for center in (False, True):
        quantized = kv.quantized(cache, quant.QuantFormat(bits=4, group=16), center=center)
        got = np.asarray(_dequantized_twin(quantized).layers[0].k)
        errors[center] = np.abs(np.einsum("qh,bkch->bkcq", q, got - k))[visible].mean()
    assert errors[True] < errors[False] / 20 and errors[False] > 5, errors
    seen = visible.any(axis=2)[..., None]  # [B, K, 1]: head 2 holds nothing, its centres are 0
    high = np.where(seen, np.where(visible[..., None], k, -np.inf).max(axis=2), 0.0)  # [B, K, H]
    low = np.where(seen, np.where(visible[..., None], k, np.inf).min(axis=2), 0.0)
    want = (high + low) / 2
    centres = kv.quantized(cache, quant.QuantFormat(bits=4, group=16)).layers[0].key_center
    assert centres.dtype == jnp.bfloat16  # the format's scale dtype
    np.testing.assert_allclose(np.asarray(centres, np.float32), want, rtol=2**-8, atol=0)
    ragged = kv.quantized(kv.pack(cache, 8), quant.QuantFormat(bits=4, group=16)).layers[0].key_center
    np.testing.assert_array_equal(np.asarray(ragged), np.asarray(centres))


def _store_rows(store, head: int, start: int, count: int):
    """(dequantized key rows, their error bound) of one head's store slots [start, start + count)."""
    if isinstance(store, kv.RaggedLayerCache):
        first = int(store.offsets[0, head]) + start
        pick = lambda a: a[0, first : first + count]
    else:
        pick = lambda a: a[0, head, start : start + count]
    rows = jax.tree.map(pick, store.k)
    return np.asarray(quant.dequantize(rows)), np.asarray(quant.error_bound(rows))


@pytest.mark.parametrize("form", ["masked", "ragged"])
def test_questions_with_flushes_rewind_exactly(form):
    """With a window of 4, a question and its answer flush the window; rewinding to the mark gives the cache back
    (the mark's window included), so a question asked after another is answered as alone, again and again."""
    fmt = quant.QuantFormat(bits=8, group=8)
    fresh = lambda: kv.quantized(_form(form), fmt, window=4)
    q1, q2 = QUESTION, QUESTION[::-1].copy()
    alone, _ = gen.ask(PARAMS, CFG, fresh(), q2, 6)
    first, cache = gen.ask(PARAMS, CFG, fresh(), q1, 6)
    second, cache = gen.ask(PARAMS, CFG, cache, q2, 6)
    assert second == alone

    _, cache = gen.prefill(PARAMS, CFG, [q1[:2]], cache)  # 2 tokens in the window: the mark must restore them
    before, snapshot = kv.mark(cache), copied(cache)
    answers = []
    for _ in range(2):
        answer, cache = gen.ask(PARAMS, CFG, cache, q2, 6)
        answers.append(answer)
        _, cache = gen.prefill(PARAMS, CFG, [q2], cache)
        assert int(cache.layers[0].store.lengths[0, 0]) > int(snapshot.layers[0].store.lengths[0, 0])  # flushed
        cache = kv.rewind(cache, before)
        for got, then in zip(cache.layers, snapshot.layers):
            np.testing.assert_array_equal(np.asarray(got.store.lengths), np.asarray(then.store.lengths))
            np.testing.assert_array_equal(np.asarray(got.window.lengths), np.asarray(then.window.lengths))
            n = int(then.window.lengths[0, 0])
            assert n == 2
            np.testing.assert_array_equal(np.asarray(got.window.k[:, :, :n]), np.asarray(then.window.k[:, :, :n]))
    assert answers[0] == answers[1]


def test_a_rewind_past_the_marks_window_keeps_what_was_flushed():
    """A point after the mark that a flush moved into the store stays there (answer_forced rewinds so)."""
    cache = kv.quantized(_form("ragged"), quant.QuantFormat(bits=8, group=8), window=4)
    before = kv.mark(cache)
    stored = np.asarray(cache.layers[0].store.lengths)
    _, cache = gen.prefill(PARAMS, CFG, [np.arange(10, dtype=np.int32)], cache)  # 8 flushed, 2 in the window
    for ahead, (in_store, in_window) in {9: (8, 1), 6: (6, 0)}.items():
        to = dataclasses.replace(
            before, lengths=tuple(x + ahead for x in before.lengths), next_position=before.next_position + ahead
        )
        layer = kv.rewind(copied(cache), to).layers[0]
        np.testing.assert_array_equal(np.asarray(layer.store.lengths), stored + in_store)
        np.testing.assert_array_equal(np.asarray(layer.window.lengths), np.full_like(stored, in_window))


def test_room_counts_what_the_store_takes_in_flushes():
    """room() = tokens that can be appended before a flush would overrun the store; writing that many fits."""
    cache = kv.quantized(_form("ragged"), quant.QuantFormat(bits=8, group=8), window=4)
    room = int(cache.room()[0])
    store_room = int(kv._room(cache.layers[0].store).min())
    assert room == (store_room // 4 + 1) * 4
    _, cache = gen.prefill(PARAMS, CFG, [np.arange(room, dtype=np.int32) % CFG.vocab_size], cache)
    assert int(cache.room()[0]) == 0
    assert np.array_equal(
        np.asarray(kv.kept_per_head(cache)),
        np.asarray(kv.kept_per_head(kv.quantized(_form("ragged"), quant.QuantFormat(bits=8, group=8), window=4)))
        + room,
    )


def test_bytes_of_kvzip_at_0_3_with_int4_are_below_0_085_of_the_bf16_cache():
    """Head dim 64, group 64, bf16 scales and zero points: the kept pairs cost 0.28125x their bf16 bytes, and the
    key centres one bf16 per channel and KV head (what a context of 1,024 tokens carries under the bar)."""
    cfg = dataclasses.replace(CFG, head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=64)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, seed=0, scale=0.1))
    T = 1024
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, T).astype(np.int32)
    full = gen.prefill(params, cfg, [tokens], capacity=T)[1]  # all context (a prefix would be kept whole)
    assert full.layers[0].k.dtype == jnp.bfloat16
    scores = jnp.asarray(np.random.default_rng(1).random((cfg.num_layers, 1, cfg.num_kv_heads, T)), jnp.float32)
    masked = kv.mask_context(full, keep_mask(scores, jnp.array([T]), 0.3), jnp.array([0]), jnp.array([T]))
    int4 = kv.quantized(kv.pack(masked, 0), quant.QuantFormat(bits=4, group=64))
    ratio = kv.used_bytes(int4) / kv.used_bytes(full)
    assert ratio <= 0.085, ratio
    centres = cfg.num_layers * cfg.num_kv_heads * 64 * 2
    uncentred = kv.quantized(kv.pack(masked, 0), quant.QuantFormat(bits=4, group=64), center=False)
    assert kv.used_bytes(int4) - kv.used_bytes(uncentred) == centres
    quantized_full = kv.used_bytes(kv.quantized(full, quant.QuantFormat(bits=4, group=64)))
    assert (quantized_full - centres) / kv.used_bytes(full) == 0.28125


@pytest.mark.parametrize("ragged", [True, False])
def test_a_compiled_decode_step_holds_no_float_copy_of_a_quantized_store(ragged):
    """A ragged store is dequantized chunk by chunk, a dense one block by block: the compiled step's temporaries
    stay below half a float32 copy of the store's keys alone."""
    cfg = dataclasses.replace(
        CFG, head_dim=64, num_heads=4, num_kv_heads=2, hidden_size=64, num_layers=1, layer_types=(), max_position=8192
    )
    params = init_params(cfg, seed=0, scale=0.1)
    full = gen.prefill(params, cfg, [np.arange(4096, dtype=np.int32) % cfg.vocab_size], capacity=8192)[1]
    cache = kv.quantized(kv.pack(full, 64) if ragged else full, quant.QuantFormat(bits=4, group=64))
    store = cache.layers[0].store
    compiled = gen.forward_step.lower(
        params, jnp.zeros((1, 1), jnp.int32), jnp.array([1], jnp.int32), cache, cfg
    ).compile()
    float_keys = int(np.prod(store.k.shape)) * 4  # one float32 copy of the store's keys
    if ragged:
        assert store.k.shape[1] > 2 * ragged_attention.RAGGED_CHUNK_SLOTS
    assert compiled.memory_analysis().temp_size_in_bytes < float_keys / 2


def test_jit_equals_eager_and_misuse_is_named():
    cache = _form("masked")
    fmt = quant.QuantFormat(bits=4, group=8)
    eager = kv.quantized(cache, fmt, window=8)
    jitted = jax.jit(kv.quantized, static_argnums=(1, 2))(cache, fmt, 8)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ragged = kv.quantized(_form("ragged"), fmt, 8)
    chex.assert_trees_all_equal(jax.jit(kv.quantized, static_argnums=(1, 2))(_form("ragged"), fmt, 8), ragged)
    with pytest.raises(TypeError, match="quantize after compressing"):
        kv.pack(eager, 8)
    with pytest.raises(TypeError, match="quantized already"):
        kv.quantized(eager)
    with pytest.raises(ValueError, match="per token"):
        kv.quantized(cache, quant.QuantFormat(bits=4, group=8, along="tokens"))
    with pytest.raises(ValueError, match="window"):
        kv.quantized(cache, fmt, window=0)
    with pytest.raises(ValueError, match="before the cache was quantized"):
        kv.rewind(eager, kv.mark(cache))


def test_the_clis_default_window_is_the_caches():
    from kvzip_jax.cli import options

    assert options.KV_WINDOW == kv.WINDOW
