"""Sharded runs against the unsharded one, on 8 simulated CPU devices. Run by tests/test_sharding.py in a
subprocess (the test process has already started JAX with one device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multidevice_checks.py 2,1,4 1,2,4 ...

Prints one line "ok MESH" per mesh (data, seq, tensor); an AssertionError otherwise.
"""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, sharding
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.kvzip.eviction import keep_mask
from kvzip_jax.kvzip.scoring import RereadInputs
from kvzip_jax.models.attention import blocked_attention
from kvzip_jax.models.params import init_params, param_shapes
from kvzip_jax.models.seq_attention import merged_attention, seq_split, split_write
from kvzip_jax.sharding import segments

CFG = ModelConfig(
    architecture="qwen2",
    vocab_size=128,
    hidden_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    intermediate_size=96,
    rms_norm_eps=1e-6,
    max_position=512,
    rope=RopeSpec(theta=1000.0),
    qkv_bias=True,
)
B, PREFIX, CONTEXT, CAPACITY, CHUNK, STEPS, RATIO = 8, 4, 45, 128, 32, 16, 0.3
ATOL = 1e-5


def inputs():
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 128, (B, PREFIX))
    lengths = CONTEXT - np.arange(B) % 3 * 7  # rows of different lengths
    contexts = [rng.integers(3, 128, n) for n in lengths]
    return [np.concatenate([p, c]) for p, c in zip(prefix, contexts)], contexts


def reread(contexts) -> RereadInputs:
    """Chunks of CHUNK context tokens, each reread after a fixed 6-token prompt (a stand-in for the reread prompt)."""
    chunks = -(-max(len(c) for c in contexts) // CHUNK)
    prompt = np.arange(6) + 100
    width = 64
    tokens = np.zeros((chunks, B, width), np.int32)
    num_valid, chunk_len = np.zeros((chunks, B), np.int32), np.zeros((chunks, B), np.int32)
    for t in range(chunks):
        for b, c in enumerate(contexts):
            piece = c[t * CHUNK : (t + 1) * CHUNK]
            tokens[t, b, : 6 + len(piece)] = np.concatenate([prompt, piece])
            num_valid[t, b], chunk_len[t, b] = 6 + len(piece), len(piece)
    starts = PREFIX + CHUNK * np.arange(chunks)[:, None] + np.zeros((1, B), int)
    return RereadInputs(
        tokens=jnp.asarray(tokens),
        num_valid=jnp.asarray(num_valid),
        chunk_start=jnp.asarray(starts, jnp.int32),
        chunk_len=jnp.asarray(chunk_len),
        prefix_len=jnp.full((B,), PREFIX, jnp.int32),
        context_len=jnp.asarray([len(c) for c in contexts], jnp.int32),
        chunk_size=CHUNK,
    )


def run(params, mesh=None):
    """(prefill logits, scores, keep, decode logits [STEPS, B, V], greedy tokens, caches) on `mesh` or one device."""
    rows, contexts = inputs()
    empty = kv.init_cache(CFG, B, CAPACITY)
    if mesh is not None:
        params, empty = sharding.shard_params(params, CFG, mesh), sharding.shard_cache(empty, mesh)
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
        logits, cache = gen.prefill(params, CFG, rows, empty, chunk=32)
        masked, scores = jax.jit(kvzip.score_and_evict)(params, CFG, cache, reread(contexts), RATIO)
        keep = jnp.stack([layer.keep for layer in masked.layers])
        packed = segments.pack_segments(masked, room=STEPS, mesh=mesh)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        decoded, tokens, fed = greedy(params, first, masked)
        decoded_packed, _, fed_packed = greedy(params, first, packed)
    return dict(
        prefill=logits,
        scores=scores,
        keep=keep,
        decode=decoded,
        tokens=tokens,
        decode_packed=decoded_packed,
        cache=cache,
        masked=fed,
        packed=fed_packed,
        params=params,
    )


def greedy(params, token, cache):
    """STEPS greedy steps, one jitted step at a time -> (logits [STEPS, B, V], tokens [STEPS, B], cache)."""
    step_logits, tokens = [], []
    for _ in range(STEPS):
        out, cache = gen.forward_step(params, token[:, None], jnp.ones((B,), jnp.int32), cache, CFG)
        step_logits.append(out[:, 0])
        token = jnp.argmax(out[:, 0], -1).astype(jnp.int32)
        tokens.append(token)
    return jnp.stack(step_logits), jnp.stack(tokens), cache


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def close(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    finite = np.isfinite(b)
    assert (np.isfinite(a) == finite).all(), f"{what}: different infinities"
    err = np.abs(a[finite] - b[finite]).max(initial=0)
    assert err <= ATOL, f"{what}: max abs difference {err:.2e} > {ATOL}"


def spec(x):
    return tuple(s for s in x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))


def check_mesh(shape, reference, params):
    mesh = sharding.make_mesh(*shape)
    got = run(params, mesh)
    close(got["prefill"], reference["prefill"], "prefill logits")
    close(got["scores"], reference["scores"], "scores")
    assert (np.asarray(got["keep"]) == np.asarray(reference["keep"])).all(), "kept masks differ"
    close(got["decode"], reference["decode"], "decode logits")
    close(got["decode_packed"], reference["decode"], "decode logits over the cache packed per seq segment")
    assert got["packed"].capacity < got["masked"].capacity, (got["packed"].capacity, got["masked"].capacity)
    assert (np.asarray(got["tokens"]) == np.asarray(reference["tokens"])).all(), "greedy tokens differ"

    # Layouts: params by the rules, caches and scores as laid out by the rules.
    want = sharding.param_shardings(param_shapes(CFG), mesh)
    for (path, x), w in zip(jax.tree_util.tree_flatten_with_path(got["params"])[0], jax.tree.leaves(want)):
        assert x.sharding.is_equivalent_to(w, x.ndim), f"{jax.tree_util.keystr(path)}: {x.sharding} != {w}"
    for name in ("cache", "masked", "packed"):
        for x, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(sharding.cache_shardings(got[name], mesh))):
            assert x.sharding.is_equivalent_to(w, x.ndim), f"{name}: {x.sharding.spec} != {w.spec}"
    s = got["scores"]
    assert s.sharding.is_equivalent_to(sharding.scores_sharding(s.shape, mesh), s.ndim), s.sharding

    # Parameter bytes per device: total / tensor, up to the replicated norms and biases.
    held = sharding.bytes_per_device(got["params"])
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    tensor = shape[2]
    assert len(held) == mesh.size and max(held.values()) <= 1.03 * total / tensor, (max(held.values()), total)
    # A decode step moves no K or V between devices (over seq: attention per shard, merged through the LSE).
    with jax.set_mesh(mesh):
        for name in ("masked", "packed"):
            step = gen.forward_step.lower(
                got["params"], got["tokens"][-1][:, None], jnp.ones((B,), jnp.int32), got[name], CFG
            )
            gathers = re.findall(r"= (\S+) (?:all-gather|all-to-all)\(", step.compile().as_text())
            assert not gathers, f"a decode step over the {name} cache gathers {gathers}"
    if shape[1] > 1:  # a cache split over seq: no prefill chunk or reread gathers it either
        check_no_gather_over_seq(mesh, got["params"])
        check_merge(mesh)
        check_write(mesh)
    check_ties(mesh)
    print("ok", ",".join(map(str, shape)), flush=True)


def check_no_gather_over_seq(mesh, params):
    """A prefill chunk and the KVzip reread over a 1,024-slot cache (several key blocks per seq shard) compile with
    no float all-gather or all-to-all."""
    with jax.set_mesh(mesh):
        large = sharding.shard_cache(kv.init_cache(CFG, B, 1024), mesh)  # several key blocks per seq shard
        reread_text = jax.jit(kvzip.score).lower(params, CFG, large, reread(inputs()[1])).compile().as_text()
        gathers = re.findall(r"= (f32\S+) (?:all-gather|all-to-all)\(", reread_text)
        assert not gathers, f"the KVzip reread gathers {gathers}"
        chunk = gen.forward_step.lower(params, jnp.zeros((B, CHUNK), jnp.int32), jnp.full((B,), CHUNK), large, CFG)
        gathers = re.findall(r"= (f32\S+) (?:all-gather|all-to-all)\(", chunk.compile().as_text())
        assert not gathers, f"a prefill chunk gathers {gathers}"


def check_merge(mesh):
    """Attention split over seq and merged through the LSE equals blocked_attention on one device: holes, biases,
    a sliding window, and a row whose keys are all masked (out 0, no NaN)."""
    rng = np.random.default_rng(2)
    T, K, G, H, C = 3, 4, 2, 16, 96
    q = jnp.asarray(rng.normal(size=(B, T, K, G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, K, C, H)), jnp.float32) for _ in range(2))
    filled = jnp.asarray(rng.integers(T, C, (B, K)), jnp.int32).at[0, 0].set(0)
    keep = jnp.asarray(rng.random((B, K, C)) < 0.7).at[1, 2].set(False)
    bias = jnp.asarray(rng.normal(size=(B, K, C)), jnp.float32)
    query_slots = filled[..., None] - T + jnp.arange(T, dtype=jnp.int32)
    subset = lambda slots: (slots < 5) | ((slots >= 40) & (slots < 70))  # noqa: E731
    in_subset = subset(jnp.broadcast_to(jnp.arange(C), (B, K, C)))
    layer = kv.LayerCache(k=k, v=v, lengths=filled, keep=keep, bias=bias)
    for window in (None, 40):
        want = blocked_attention(
            q, k, v, filled, None, None, query_slots, window, 0.25, keep, subset=subset, key_bias=bias
        )
        with jax.set_mesh(mesh):
            placed = jax.device_put(layer, sharding.cache_shardings(kv.KVCache((layer,), filled[:, 0]), mesh).layers[0])
            split = seq_split(layer)
            assert split is not None
            got = jax.jit(merged_attention, static_argnums=(3, 4, 5))(
                q, placed, query_slots, window, 0.25, split, in_subset
            )
        for part, expected, name in zip(got, want, ("out", "lse", "subset_lse")):
            assert not np.isnan(np.asarray(part)).any(), name
            close(part, expected, f"attention merged over seq shards: {name}, window {window}")
        assert not np.asarray(got[0])[1, :, 2].any(), "a row seeing no key must give 0"


def check_write(mesh):
    """Rows written shard by shard equal cache.write: a block across shard boundaries, padding rows, rows past the
    capacity dropped, and the lengths."""
    rng = np.random.default_rng(3)
    K, H, C, T = 4, 16, 96, 40
    k, v = (jnp.asarray(rng.normal(size=(B, K, C, H)), jnp.float32) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.normal(size=(B, K, T, H)), jnp.float32) for _ in range(2))
    filled = jnp.asarray(rng.integers(0, C, (B, K)), jnp.int32).at[0].set(C - 5)  # row 0 overflows
    num_new = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32).at[0].set(T)
    layer = kv.LayerCache(k=k, v=v, lengths=filled)
    want = kv.write(layer, k_new, v_new, num_new)
    with jax.set_mesh(mesh):
        placed = jax.device_put(layer, sharding.cache_shardings(kv.KVCache((layer,), filled[:, 0]), mesh).layers[0])
        split = seq_split(layer)
        got = jax.jit(split_write, static_argnums=(4,))(placed, k_new, v_new, num_new, split)
    for name in ("k", "v", "lengths"):
        assert (np.asarray(getattr(got, name)) == np.asarray(getattr(want, name))).all(), f"split_write: {name}"


def check_ties(mesh):
    """The distributed selection keeps what the sort keeps on random, tie-heavy and all-equal scores."""
    rng = np.random.default_rng(1)
    L, n = 3, 64
    context_len = jnp.asarray(n - rng.integers(0, 20, B), jnp.int32)
    cases = {
        "random": rng.random((L, B, 4, n)),
        "ties": rng.integers(0, 3, (L, B, 4, n)) / 2,
        "equal": np.ones((L, B, 4, n)),
    }
    for name, s in cases.items():
        s = jnp.asarray(s, jnp.float32)
        for level in ("pair", "pair-uniform", "layer"):
            for ratio in (0.01, 0.3, 0.77, 1.0):
                want = keep_mask(s, context_len, ratio, level)
                placed = jax.device_put(s, sharding.scores_sharding(s.shape, mesh))
                with jax.set_mesh(mesh):
                    got = jax.jit(keep_mask, static_argnums=(3,))(placed, context_len, ratio, level)
                assert (np.asarray(got) == np.asarray(want)).all(), f"selection differs: {name} {level} {ratio}"


def main(meshes):
    assert jax.device_count() >= 8, jax.devices()
    params = init_params(CFG, seed=0)
    reference = run(params)
    close(reference["decode_packed"], reference["decode"], "decode over the packed cache, one device")
    for shape in meshes:
        check_mesh(tuple(int(n) for n in shape.split(",")), reference, params)


if __name__ == "__main__":
    main(sys.argv[1:])
