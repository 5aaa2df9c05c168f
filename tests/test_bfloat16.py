"""bfloat16 against float32 on the real models: teacher-forced next-token agreement and KVzip's kept sets.

Both runs share everything but the dtype of params and cache (softmax, norms, RoPE, scores and logits accumulate in
float32 either way), so what differs is bfloat16's 8-bit mantissa on weights, activations and cached keys/values.
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import dtypes, kvzip, prompts
from kvzip_jax import generate as gen
from kvzip_jax.weights import registry
from tests.conftest import _checkpoints_dir

DOCUMENT = (Path(__file__).resolve().parents[1] / "kvzip_jax" / "data" / "demo_document.txt").read_text()
POSITIONS = 1200  # teacher-forced positions compared (the issue asks for >= 1,000)
RATIO = 0.3


# Qwen's pair is extended (make test-all): SmolLM2's runs the same bfloat16 paths on real weights in a quarter of
# the time.
@pytest.fixture(scope="module", params=[registry.SMOLLM2, pytest.param(registry.QWEN, marks=pytest.mark.extended)])
def model_pair(request):
    """(name, tokenizer, cfg, float32 params, bfloat16 params), from the bundled model's converted checkpoint (it
    stores the GGUF's dequantized float32 / float16 tensors as they are)."""
    request.getfixturevalue("smollm2_gguf" if request.param == registry.SMOLLM2 else "qwen_gguf")  # installed
    # SmolLM2's GGUF lies in its package, not in <checkpoints>/_gguf: the checkpoints folder is named, not derived
    model = registry.load(request.param, _checkpoints_dir(), dtype="float32")
    return model.name, model.tokenizer, model.cfg, model.params, dtypes.cast_params(model.params, "bfloat16")


def _context(tok, limit: int) -> np.ndarray:
    """[prefix | context] token ids of the demo document's first `limit` tokens, with its prompt layout."""
    ids = prompts.encode_text(tok, DOCUMENT)
    assert len(ids) >= limit, "the demo document is shorter than the positions the test needs"
    prompt, _ = prompts.split_for_reuse(tok, tok.decode(ids[:limit]), [])
    return prompt, prompt.ids()[: prompt.context_end]


def _next_tokens(params, cfg, tokens, chunk: int = 612) -> tuple[np.ndarray, gen.kv.KVCache]:
    """(teacher-forced argmax next token at every position, the cache as it held the first chunk's tokens), chunk by
    chunk over one cache (the logits of one chunk, [chunk, V] float32, never those of the whole text at once; the
    last chunk right-padded to the same shape)."""
    cache = gen.on_params_device(
        gen.kv.init_cache(cfg, 1, gen.capacity_for(len(tokens) + chunk, cfg), dtypes.of_params(params)), params
    )
    predicted, first = [], None
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        block = np.zeros((1, chunk), np.int32)  # [1, T]
        block[0, : piece.size] = piece
        argmax, cache = _argmax_step(params, jnp.asarray(block), jnp.asarray([piece.size], jnp.int32), cache, cfg)
        predicted.append(np.asarray(argmax[0, : piece.size]))
        first = cache if first is None else first  # not donated: it stays valid as the loop appends
    assert cache.layers[0].k.dtype == dtypes.of_params(params)
    return np.concatenate(predicted), first


@functools.partial(jax.jit, static_argnames=("cfg",))
def _argmax_step(params, block, num_new, cache, cfg):
    """block [1, T] (its first num_new [1] real) appended to cache -> (argmax next token at each position [1, T],
    cache)."""
    logits, cache = gen.append_tokens(params, block, num_new, cache, cfg, logits="all")  # [1, T, V] float32
    assert logits.dtype == jnp.float32
    return jnp.argmax(logits, axis=-1), cache


@pytest.fixture(scope="module")
def forced(model_pair):
    """(prompt, tokens, {dtype: (teacher-forced next tokens, the cache of the first chunk)}): one forward per dtype
    serves both tests (the cache that teacher forcing leaves after its first 612 tokens is a prefilled context of
    [prefix | about 590 context tokens] for KVzip to score)."""
    _, tok, cfg, p32, p16 = model_pair
    prompt, tokens = _context(tok, POSITIONS)
    return prompt, tokens, {"float32": _next_tokens(p32, cfg, tokens), "bfloat16": _next_tokens(p16, cfg, tokens)}


@pytest.mark.real_model  # model_pair loads its GGUF through getfixturevalue, out of conftest's sight
def test_bfloat16_predicts_the_float32_next_token(model_pair, forced):
    name = model_pair[0]
    _, tokens, runs = forced
    (a, _), (b, _) = runs["float32"], runs["bfloat16"]
    assert len(a) == len(tokens)
    agreement = float(np.mean(a == b))
    print(f"{name}: bfloat16 top-1 agrees with float32 at {agreement:.2%} of {len(a)} positions")
    assert len(a) >= 1000
    assert agreement >= 0.99


@pytest.mark.real_model  # model_pair loads its GGUF through getfixturevalue, out of conftest's sight
def test_bfloat16_keeps_the_float32_kvzip_pairs(model_pair, forced):
    name, tok, cfg, p32, p16 = model_pair
    prompt, tokens, runs = forced
    prefix_len = prompt.context_start
    tokens = tokens[: int(runs["float32"][1].next_position[0])]  # [prefix | context] the first chunk's cache holds
    context_len = len(tokens) - prefix_len
    assert context_len >= 500
    keeps = []
    for params, (_, cache) in ((p32, runs["float32"]), (p16, runs["bfloat16"])):
        assert cache.layers[0].k.dtype == dtypes.of_params(params) and int(cache.next_position[0]) == len(tokens)
        reread = kvzip.reread_inputs(tok, [prefix_len], [tokens[prefix_len:]])
        scores = jax.jit(kvzip.score)(params, cfg, cache, reread)
        assert scores.dtype == jnp.float32
        keeps.append(
            np.asarray(
                kvzip.keep_mask(
                    scores, jnp.asarray([context_len]), RATIO, evictable=kvzip.scoring.evictable_layers(cfg)
                )
            )
        )
    kept32, kept16 = keeps
    overlap = float((kept32 & kept16).sum() / kept32.sum())
    print(f"{name}: bfloat16 keeps {overlap:.2%} of float32's top-{RATIO:.0%} pairs")
    assert kept32.sum() == kept16.sum()
    assert overlap >= 0.97
