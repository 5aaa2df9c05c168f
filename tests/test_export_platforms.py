"""Cross-platform export on a CPU host: `jax.export` lowers our entry points for the accelerators this machine does
not have, so a lowering error on a GPU or a TPU shows up here first. Tiny random model (2 layers, 4 query heads over
2 KV heads, head dim 16), two rows with contexts of 20 and 27 tokens; every export is from abstract arguments (shapes
and dtypes), nothing is compiled for the accelerators.

What lowers, for which platforms (each test asserts its platforms, output shapes and custom calls):

- XLA paths (`attention_impl="xla"`, what "auto" takes on a CPU or a TPU): the compress step (KVzip scoring +
  eviction), one decode step over the masked and over the ragged compressed cache, the ragged cache's decode loop
  (sampling included) and the paged decode attention over exported tpu and gpu pages lower for ("cuda", "tpu") in
  one multi-platform module with no custom call.
- The compress step holds two host callbacks (`score`'s chunk progress and `check_context_cache`'s layout check,
  jax.debug.callback): jax.export serializes no host callback, so it exports when traced inside
  `kvzip.without_host_callbacks()` (strict xfail on the step traced outside it).
- Our Pallas kernels (ragged_decode, decode_attention, score_max, float and int8 / int4 QuantizedRows) lower through
  Triton for "cuda" (custom call `__gpu$xla.gpu.triton`, which jax.export accepts only when told: Triton IR has no
  compatibility guarantee), alone and inside the decode steps and the compress step. They choose their lowering at
  trace time from the target platform (`dispatch.target_platform()`, the default backend's), so the tests set it to
  the platform they export for. For "tpu" the same kernels (QuantizedRows included) take their TPU
  variants and lower to Mosaic (`tpu_custom_call`) under an abstract TPU v5e, alone and inside the decode steps and
  the compress step. The Triton and the Mosaic kernel of one call do not export in one ("cuda", "tpu")
  module through `lax.platform_dependent` with this jax (strict xfail): each kept branch's pallas_call is still lowered
  for every platform of the module, and the Triton one refuses "tpu" (`ValueError: Compiler params for platform gpu
  cannot be used for tpu lowering.`), so each platform is exported on its own.
- tpu-inference's Pallas `ragged_paged_attention` (the wheel's kernel.py, loaded by file as the reference is) over our
  exported tpu pages lowers for "tpu" to Mosaic (`tpu_custom_call`) at head dim 128 in float32 and bfloat16, and its
  hd64 variant at head dim 64 in float32, under an abstract TPU v5e device (jax's Mosaic lowering asks the current
  device for its TPU generation; on a CPU host an abstract mesh's device answers), with explicit block sizes and VMEM
  limit (the wheel derives its defaults from the real TPU's version). The hd64 kernel in bfloat16 does not lower with
  this jax: it calls `pltpu.reciprocal`, which jax 0.10 and 0.11.0 do not have (the wheel pins jax 0.11.2).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax import kvzip, serving
from kvzip_jax.config import ModelConfig
from kvzip_jax.kvzip import scoring as kvscore
from kvzip_jax.models.params import init_params
from kvzip_jax.serving import tpu_inference_kernel as engine
from pallas_kernels import QuantizedRows, decode_attention, dispatch, ragged_decode, score_max
from tests.test_serving import serving_config

ACCELERATORS = ("cuda", "tpu")
TRITON = "__gpu$xla.gpu.triton"  # the custom call of a Pallas kernel lowered through Triton
ALLOW_TRITON = (export.DisabledSafetyCheck.custom_call(TRITON),)  # jax.export refuses it unless told
MOSAIC = "tpu_custom_call"  # the custom call of a Pallas kernel lowered through Mosaic (TPU); jax.export accepts it
TPU_V5E = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
)
PREFIX, CONTEXTS, RATIO, CAPACITY, REREAD, PAGE = 4, (20, 27), 0.3, 64, 32, 8
# attention_impl explicit: "auto" takes the Triton kernels on a GPU host, which do not lower for TPU
CFG = serving_config(16, attention_impl="xla")
PALLAS = dataclasses.replace(CFG, attention_impl="pallas")
B = len(CONTEXTS)


def _abstract(tree):
    """The shapes and dtypes of a pytree's arrays (what an export needs), structure and static fields kept."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _export(fn, *args, platforms=ACCELERATORS, disabled_checks=()) -> export.Exported:
    """fn jitted afresh (no trace cached by another test) and exported for `platforms` from abstract args."""
    return export.export(jax.jit(fn), platforms=platforms, disabled_checks=disabled_checks)(*_abstract(args))


def _custom_calls(exported: export.Exported) -> list[str]:
    """The targets of the module's custom calls, in order."""
    text = exported.mlir_module()
    return [line.split("custom_call @", 1)[1].split("(", 1)[0] for line in text.splitlines() if "custom_call @" in line]


def _check(exported: export.Exported, fn, *args, platforms=ACCELERATORS) -> None:
    """The export is for `platforms` and returns what fn returns (structure, shapes, dtypes)."""
    assert exported.platforms == platforms
    expected = jax.eval_shape(fn, *args)
    assert exported.out_tree == jax.tree.structure(expected)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [(x.shape, x.dtype) for x in jax.tree.leaves(expected)]


# ------------------------------------------------------------------------------------------------ inputs


@functools.cache
def _params():
    return init_params(CFG, seed=1, scale=0.15)


@functools.cache
def _caches(head_dim: int = CFG.head_dim):
    """(full cache [prefix | context] per row, masked at level pair, its ragged pack with room, masked at level
    pair-uniform), filled with random keys and values (no prefill: the exports need shapes, the packing real counts)."""
    rng = np.random.default_rng(0)
    filled = jnp.asarray([[PREFIX + n] * CFG.num_kv_heads for n in CONTEXTS], jnp.int32)  # [B, K]
    draw = lambda: jnp.asarray(rng.normal(size=(B, CFG.num_kv_heads, CAPACITY, head_dim)), jnp.float32)
    layer = lambda: kv.LayerCache(k=draw(), v=draw(), lengths=filled)
    full = kv.KVCache(layers=tuple(layer() for _ in range(CFG.num_layers)), next_position=filled[:, 0])
    scores = jnp.asarray(rng.random((CFG.num_layers, B, CFG.num_kv_heads, max(CONTEXTS))), jnp.float32)
    context, prefix = jnp.asarray(CONTEXTS, jnp.int32), jnp.full((B,), PREFIX, jnp.int32)
    mask = jax.jit(  # one program per level: quicker than their many eager ops
        lambda full, level: kv.mask_context(full, kvzip.keep_mask(scores, context, RATIO, level), prefix, context),
        static_argnums=1,
    )
    masked = {level: mask(full, level) for level in ("pair", "pair-uniform")}
    return full, masked["pair"], kv.pack(masked["pair"], room=16), masked["pair-uniform"]


def _reread() -> kvscore.RereadInputs:
    """One reread chunk per row: 5 prompt tokens then the context, in a window of REREAD tokens."""
    rng = np.random.default_rng(1)
    tokens = np.zeros((1, B, REREAD), np.int32)
    for b, n in enumerate(CONTEXTS):
        tokens[0, b, : 5 + n] = rng.integers(0, CFG.vocab_size, 5 + n)
    return kvscore.RereadInputs(
        tokens=jnp.asarray(tokens),
        num_valid=jnp.asarray([[5 + n for n in CONTEXTS]], jnp.int32),
        chunk_start=jnp.full((1, B), PREFIX, jnp.int32),
        chunk_len=jnp.asarray([CONTEXTS], jnp.int32),
        prefix_len=jnp.full((B,), PREFIX, jnp.int32),
        context_len=jnp.asarray(CONTEXTS, jnp.int32),
        chunk_size=REREAD,
    )


@pytest.fixture
def gpu_trace(monkeypatch):
    """The kernels' trace-time choice made as on a GPU host: compiled kernels (Triton), not interpret mode."""
    monkeypatch.setattr(dispatch, "target_platform", lambda: "cuda")


@pytest.fixture
def tpu_trace(monkeypatch):
    """The kernels' trace-time choice made as on a TPU host: their TPU variants, lowered to Mosaic."""
    monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")


@pytest.fixture
def no_host_callbacks():
    """Traced inside kvzip.without_host_callbacks(): the compress step's two host callbacks left out."""
    with kvzip.without_host_callbacks():
        yield


def _compress(cfg):
    return lambda params, cache, reread, ratio: kvzip.score_and_evict(params, cfg, cache, reread, ratio)


def _step(cfg):
    return lambda params, tokens, num_new, cache: gen.append_tokens(params, tokens, num_new, cache, cfg)


def _step_args(cache):
    return _params(), jnp.zeros((B, 1), jnp.int32), jnp.ones((B,), jnp.int32), cache


# ------------------------------------------------------------------------------------------------ compress step


def test_compress_step_exports_for_cuda_and_tpu(no_host_callbacks):
    """KVzip scoring + eviction (score_and_evict), its device computation: host callbacks left out, and named."""
    args = (_params(), _caches()[0], _reread(), jnp.float32(RATIO))
    exported = _export(_compress(CFG), *args)
    assert "callback" not in exported.mlir_module()
    _check(exported, _compress(CFG), *args)
    assert _custom_calls(exported) == []
    masked, scores = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert scores.shape == (CFG.num_layers, B, CFG.num_kv_heads, REREAD)
    assert all(
        layer.keep is not None and layer.keep.shape == (B, CFG.num_kv_heads, CAPACITY) for layer in masked.layers
    )


@pytest.mark.xfail(
    strict=True,
    raises=(TypeError, NotImplementedError),
    reason="jax.export serializes no host callback, and score_and_evict holds two (jax.debug.callback: score's chunk "
    "progress, check_context_cache's layout check): a multi-platform lowering of a python callback fails in "
    "mlir.lower_per_platform (jax 0.10.2 and 0.11.0: TypeError 'can only concatenate list (not \"tuple\") to list', "
    "in place of callback.py's NotImplementedError 'multi-platform lowering for python_callback'); one platform "
    "raises NotImplementedError 'serialization of host_callbacks is not yet implemented'",
)
def test_compress_step_with_its_host_callbacks_exports():
    _export(_compress(CFG), _params(), _caches()[0], _reread(), jnp.float32(RATIO))


def test_compress_step_with_the_score_kernel_exports_for_cuda(gpu_trace, no_host_callbacks):
    """The compress step with attention_impl="pallas": score_max lowers through Triton (the only custom call)."""
    args = (_params(), _caches()[0], _reread(), jnp.float32(RATIO))
    exported = _export(_compress(PALLAS), *args, platforms=("cuda",), disabled_checks=ALLOW_TRITON)
    _check(exported, _compress(PALLAS), *args, platforms=("cuda",))
    assert set(_custom_calls(exported)) == {TRITON}


def test_compress_step_with_the_score_kernel_exports_for_tpu(tpu_trace, no_host_callbacks):
    """The compress step with attention_impl="pallas" traced for a TPU: score_max lowers to Mosaic (the only custom
    call)."""
    args = (_params(), _caches()[0], _reread(), jnp.float32(RATIO))
    with use_abstract_mesh(TPU_V5E):
        exported = _export(_compress(PALLAS), *args, platforms=("tpu",))
    _check(exported, _compress(PALLAS), *args, platforms=("tpu",))
    assert set(_custom_calls(exported)) == {MOSAIC}


# ------------------------------------------------------------------------------------------------ decode steps


@pytest.mark.parametrize("form", ["masked", "ragged"])
def test_decode_step_exports_for_cuda_and_tpu(form):
    """One token appended to the compressed cache (generate.append_tokens): logits and a cache of the same shapes."""
    cache = dict(zip(("masked", "ragged"), _caches()[1:3]))[form]
    args = _step_args(cache)
    exported = _export(_step(CFG), *args)
    _check(exported, _step(CFG), *args)
    assert _custom_calls(exported) == []
    logits, out = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert logits.shape == (B, 1, CFG.vocab_size)
    assert jax.tree.structure(out) == jax.tree.structure(cache)  # the step keeps the cache's form and shapes
    assert [x.shape for x in jax.tree.leaves(out)] == [x.shape for x in jax.tree.leaves(cache)]


@pytest.mark.parametrize("form", ["dense", "masked", "ragged"])
def test_decode_step_with_the_kernels_exports_for_cuda(gpu_trace, form):
    """The same step with attention_impl="pallas": the layers' attention lowers through Triton (the only custom
    call)."""
    cache = dict(zip(("dense", "masked", "ragged"), _caches()[:3]))[form]
    args = _step_args(cache)
    exported = _export(_step(PALLAS), *args, platforms=("cuda",), disabled_checks=ALLOW_TRITON)
    _check(exported, _step(PALLAS), *args, platforms=("cuda",))
    assert set(_custom_calls(exported)) == {TRITON}


@pytest.mark.parametrize("form", ["dense", "masked", "ragged"])
def test_decode_step_with_the_kernels_exports_for_tpu(tpu_trace, form):
    """The same step with attention_impl="pallas" traced for a TPU: the layers' attention lowers to Mosaic (the only
    custom call)."""
    cache = dict(zip(("dense", "masked", "ragged"), _caches()[:3]))[form]
    args = _step_args(cache)
    with use_abstract_mesh(TPU_V5E):
        exported = _export(_step(PALLAS), *args, platforms=("tpu",))
    _check(exported, _step(PALLAS), *args, platforms=("tpu",))
    assert set(_custom_calls(exported)) == {MOSAIC}


def test_decode_loop_over_the_ragged_cache_exports_for_cuda_and_tpu():
    """The jitted decode loop (sampling, stop tokens, a while loop of steps) over the ragged cache."""
    ragged = _caches()[2]
    sampling = gen.Sampling.make(temperature=0.7, top_p=0.9)
    stops = jnp.full((gen.MAX_STOP_TOKENS,), -1, jnp.int32)
    loop = lambda params, logits, cache, max_new, stops, sampling: gen._decode_loop(
        params, CFG, logits, cache, max_new, stops, sampling, buffer=16
    )
    args = (_params(), jnp.zeros((B, CFG.vocab_size), jnp.float32), ragged, jnp.int32(12), stops, sampling)
    exported = _export(loop, *args)
    _check(exported, loop, *args)
    tokens, _, _ = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert tokens.shape == (B, 16) and tokens.dtype == jnp.int32


@pytest.mark.heavy  # compiles the step twice on CPU; test_decode_step_exports_for_cuda_and_tpu[ragged] exports it
def test_exported_decode_step_runs_here_as_the_step():
    """The same multi-platform module with "cpu" beside the accelerators runs here and answers as the step does."""
    args = _step_args(_caches()[2])
    exported = _export(_step(CFG), *args, platforms=("cpu",) + ACCELERATORS)
    got, want = exported.call(*args), jax.jit(_step(CFG))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ paged attention


@pytest.mark.parametrize("layout", serving.LAYOUTS)
def test_paged_decode_attention_exports_for_cuda_and_tpu(layout):
    """paged_decode_attention over an export's pages (serving.export_tpu / export_gpu of a pair-uniform cache)."""
    uniform = _caches()[3]
    pages = serving.export_tpu(uniform, PAGE, room=1) if layout == "tpu" else serving.export_gpu(uniform, PAGE, room=1)
    rng = np.random.default_rng(2)
    draw = lambda heads: jnp.asarray(rng.normal(size=(B, 1, heads, CFG.head_dim)), jnp.float32)
    q, k_new, v_new = draw(CFG.num_heads), draw(CFG.num_kv_heads), draw(CFG.num_kv_heads)
    attend = lambda q, pages, k_new, v_new: serving.paged_decode_attention(q, pages, 1, CFG.query_scale, k_new, v_new)
    exported = _export(attend, q, pages, k_new, v_new)
    _check(exported, attend, q, pages, k_new, v_new)
    assert _custom_calls(exported) == []
    assert exported.out_avals[0].shape == q.shape


# ------------------------------------------------------------------------------------------------ our Pallas kernels


def _quantized(rng, slots: int, bits: int, groups: int = 2) -> QuantizedRows:
    """Random int8 or packed int4 rows [B, slots, .] with group scales and zero points."""
    width = CFG.head_dim if bits == 8 else CFG.head_dim // 2
    codes = jnp.asarray(rng.integers(0, 256, (B, slots, width)), jnp.uint8)
    scale, zero = (jnp.asarray(rng.random((B, slots, groups)), jnp.float32) for _ in range(2))
    return QuantizedRows(codes, scale, zero)


def _kernel_calls(name: str):
    """(kernel call, its arrays) at tiny shapes: q [B, K, M = 2, H = 16] (a GQA group of 2, one token)."""
    rng = np.random.default_rng(3)
    K, H, S = CFG.num_kv_heads, CFG.head_dim, 96
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q = draw(B, K, 2, H)
    per_head = jnp.asarray([[0, 48], [0, 40]], jnp.int32), jnp.asarray([[30, 17], [5, 40]], jnp.int32)
    if name == "ragged_decode":
        call = functools.partial(ragged_decode, scale=0.25, impl="pallas", block_k=16)
        return call, (q, draw(B, S, H), draw(B, S, H), *per_head)
    if name in ("ragged_decode_int8", "ragged_decode_int4"):
        bits = int(name[-1])
        call = functools.partial(ragged_decode, scale=0.25, impl="pallas", block_k=16)
        return call, (q, _quantized(rng, S, bits), _quantized(rng, S, bits), *per_head)
    if name == "decode_attention":
        call = functools.partial(decode_attention, scale=0.25, impl="pallas", block_k=16)
        keep = jnp.asarray(rng.random((B, K, 32)) < 0.5)
        return call, (q, draw(B, K, 32, H), draw(B, K, 32, H), jnp.asarray([[30, 17], [5, 32]], jnp.int32), keep)
    call = functools.partial(score_max, impl="pallas", block_keys=16, block_rows=16)
    return call, (draw(B, K, 20, H), draw(B, K, 30, H), draw(B, K, 20))


KERNELS = ["ragged_decode", "ragged_decode_int8", "ragged_decode_int4", "decode_attention", "score_max"]


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_exports_for_cuda_through_triton(gpu_trace, name):
    call, args = _kernel_calls(name)
    exported = _export(call, *args, platforms=("cuda",), disabled_checks=ALLOW_TRITON)
    _check(exported, call, *args, platforms=("cuda",))
    assert _custom_calls(exported) == [TRITON]


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_exports_for_tpu(tpu_trace, name):
    """The TPU variants lower to one Mosaic custom call under an abstract TPU v5e."""
    call, args = _kernel_calls(name)
    with use_abstract_mesh(TPU_V5E):
        exported = _export(call, *args, platforms=("tpu",))
    _check(exported, call, *args, platforms=("tpu",))
    assert _custom_calls(exported) == [MOSAIC]


def _traced_for(monkeypatch, platform: str, call):
    """call, traced with the kernels' choice made for `platform` (a branch of lax.platform_dependent)."""

    def branch(*args):
        with monkeypatch.context() as patch:
            patch.setattr(dispatch, "target_platform", lambda: platform)
            return call(*args)

    return branch


@pytest.mark.parametrize("name", ["ragged_decode", "decode_attention", "score_max"])
@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="lax.platform_dependent keeps each platform's branch, but mlir lowers a kept branch for every platform of "
    "the module, so the Triton pallas_call is lowered for tpu too (and the Mosaic one for cuda) and refuses: "
    "'ValueError: Compiler params for platform gpu cannot be used for tpu lowering.' (jax 0.10.2); each platform "
    "exports on its own",
)
def test_kernel_exports_for_cuda_and_tpu_in_one_module(monkeypatch, name):
    call, args = _kernel_calls(name)
    branches = {platform: _traced_for(monkeypatch, platform, call) for platform in ACCELERATORS}
    both = lambda *args: jax.lax.platform_dependent(*args, **branches)
    with use_abstract_mesh(TPU_V5E):
        _export(both, *args, disabled_checks=ALLOW_TRITON)


# ------------------------------------------------------------------------------------------------ tpu-inference


def _engine_cfg(head_dim: int) -> ModelConfig:
    return dataclasses.replace(CFG, head_dim=head_dim)


@pytest.mark.parametrize(
    "head_dim, dtype",
    [
        (128, jnp.float32),
        (128, jnp.bfloat16),
        (64, jnp.float32),
        pytest.param(
            64,
            jnp.bfloat16,
            marks=pytest.mark.xfail(
                strict=True,
                raises=AttributeError,
                reason="the wheel's hd64 kernel divides by pltpu.reciprocal(l, approx=True) when its queries are not "
                "float32; jax 0.10 and 0.11.0 have no pltpu.reciprocal (AttributeError: module "
                "'jax.experimental.pallas.tpu' has no attribute 'reciprocal'; tpu-inference 0.32.0 pins jax 0.11.2)",
            ),
        ),
    ],
    ids=["hd128-float32", "hd128-bfloat16", "hd64-float32", "hd64-bfloat16"],
)
def test_tpu_inference_kernel_over_our_pages_exports_for_tpu(head_dim, dtype):
    """tpu-inference's Pallas ragged_paged_attention (hd64 variant at head dim 64, as the engine picks) over layer 1 of
    our tpu pages, one decode token per sequence as the runner sends it, lowered to Mosaic for a TPU v5e."""
    cfg = _engine_cfg(head_dim)
    rng = np.random.default_rng(4)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    pages = serving.export_tpu(_caches(head_dim)[3], PAGE, dtype=dtype, room=1)
    assert pages.hd64 == (head_dim == 64)
    module = engine.load(pages.hd64)
    block = pages.pages_per_seq  # a sequence's pages in one block
    if pages.hd64:
        kernel = functools.partial(
            module.ragged_paged_attention_hd64,
            sm_scale=cfg.query_scale,
            num_kv_pages_per_block=block,
            num_queries_per_block=1,
            vmem_limit_bytes=32 << 20,
        )
    else:
        sizes = (1, block * PAGE, 1, block * PAGE)  # (bq, bkv, bq compute, bkv compute)
        kernel = functools.partial(
            module.ragged_paged_attention,
            sm_scale=cfg.query_scale,
            d_block_sizes=sizes,
            m_block_sizes=sizes,
            vmem_limit_bytes=32 << 20,
        )
    args = (
        draw(B, cfg.num_heads, head_dim).astype(dtype),  # queries [tokens, N, H]
        draw(B, cfg.num_kv_heads, head_dim).astype(dtype),  # the new keys and values [tokens, K, H]
        draw(B, cfg.num_kv_heads, head_dim).astype(dtype),
        pages.pages[1],
        pages.kv_lens + 1,
        pages.flat_page_indices,
        jnp.arange(B + 1, dtype=jnp.int32),  # cu_q_lens: one token per sequence
        jnp.array([B, B, B], jnp.int32),  # every sequence decode-only
    )
    with use_abstract_mesh(TPU_V5E):
        exported = _export(kernel, *args, platforms=("tpu",))
    assert exported.platforms == ("tpu",)
    calls = _custom_calls(exported)
    assert calls and set(calls) == {MOSAIC}  # the hd64 kernel is one pallas_call, the main one two (decode, mixed)
    out, written = exported.out_avals
    assert (out.shape, out.dtype) == (args[0].shape, dtype)
    assert (written.shape, written.dtype) == (pages.pages[1].shape, dtype)  # the pages, new tokens written
