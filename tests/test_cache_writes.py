"""Cache writes are safe by construction: a head keeps what fits its room, its length stays true, no head writes
into another's segment, and the decode loop ends a full row while the rest of the batch goes on."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.kvzip.eviction import keep_mask
from tests.test_compressed_cache import CFG, PARAMS, SEQUENCE

K, H = CFG.num_kv_heads, CFG.head_dim


def _new(T, seed):
    """Distinct k, v [1, K, T, H] (every entry nonzero) to find where they were written."""
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.random((1, K, T, H)) + 1, jnp.float32),
        jnp.asarray(rng.random((1, K, T, H)) + 1, jnp.float32),
    )


@pytest.mark.parametrize("T", [4, 12])  # a block narrower than the cache, and one wider than it
def test_dense_write_keeps_what_fits_and_lengths_stay_at_capacity(T):
    C = 8
    layer = kv.init_cache(CFG, 1, C).layers[0]
    layer = kv.write(layer, *_new(6, 0), jnp.array([6]))  # 6 of 8 slots filled in both heads
    k_new, v_new = _new(T, 1)
    written = kv.write(layer, k_new, v_new, jnp.array([T]))
    np.testing.assert_array_equal(np.asarray(written.lengths), [[C, C]])  # not 6 + T
    np.testing.assert_array_equal(np.asarray(written.k[0, :, 6:]), np.asarray(k_new[0, :, :2]))  # the first 2 fit
    np.testing.assert_array_equal(np.asarray(written.k[0, :, :6]), np.asarray(layer.k[0, :, :6]))  # older untouched
    np.testing.assert_array_equal(np.asarray(written.v[0, :, 6:]), np.asarray(v_new[0, :, :2]))


def test_ragged_write_never_spills_into_the_next_heads_segment():
    _, cache = gen.prefill(PARAMS, CFG, [SEQUENCE], capacity=64)
    n = len(SEQUENCE) - 4
    scores = jnp.asarray(np.random.default_rng(0).random((CFG.num_layers, 1, K, n)), jnp.float32)
    masked = kv.mask_context(cache, keep_mask(scores, jnp.array([n]), 0.3), jnp.array([4]), jnp.array([n]))
    ragged = kv.pack(masked, 0, multiple=kv.RAGGED_BLOCK).layers[0]
    room = np.asarray(ragged.head_capacity() - ragged.lengths)[0]  # [K] what each head can still take
    T = int(room.max()) + 5  # more than any head's room
    k_new, v_new = _new(T, 2)
    written = kv.write(ragged, k_new, v_new, jnp.array([T]))
    capacity = np.asarray(ragged.head_capacity())[0]
    np.testing.assert_array_equal(np.asarray(written.lengths)[0], capacity)  # full, and no longer than full
    offsets, lengths = np.asarray(ragged.offsets)[0], np.asarray(ragged.lengths)[0]
    for head in range(K):
        start, end = offsets[head], offsets[head] + capacity[head]
        np.testing.assert_array_equal(
            np.asarray(written.k[0, start : start + lengths[head]]),
            np.asarray(ragged.k[0, start : start + lengths[head]]),
        )  # kept pairs intact
        np.testing.assert_array_equal(
            np.asarray(written.k[0, start + lengths[head] : end]), np.asarray(k_new[0, head, : room[head]])
        )  # then what fitted, in order
    assert written.k.shape == ragged.k.shape


def test_the_decode_loop_ends_a_full_row_and_the_batch_goes_on():
    """Row 0 fills its cache after 3 tokens; row 1 decodes its 10 tokens as it does alone."""
    C = 64
    long = np.random.default_rng(3).integers(0, CFG.vocab_size, C - 3).astype(np.int32)
    short = SEQUENCE[:20]
    logits, cache = gen.prefill(PARAMS, CFG, [long, short], capacity=C)
    tokens, cache = gen.decode(PARAMS, CFG, logits, cache, 10)
    alone_logits, alone = gen.prefill(PARAMS, CFG, [short], capacity=C)
    expected, _ = gen.decode(PARAMS, CFG, alone_logits, alone, 10)
    assert len(tokens[0]) == 3 and tokens[1] == expected[0] and len(expected[0]) == 10
    np.testing.assert_array_equal(np.asarray(cache.lengths())[:, 0], C)  # row 0: full, not past full
    np.testing.assert_array_equal(np.asarray(cache.lengths())[:, 1], 20 + 10)  # row 1: every token fed
