"""Decoding with the cache kept in a serving engine's pages (kvzip_jax.serving.decode) and the saved export
(serving.export_io). On tiny random GQA models (head dims 64 and 128; two sequences of 37 and 50 context tokens, a
5-token question, pages of 8 slots), a KVzip 0.3 pair-uniform cache exported to tpu-inference's layout decodes 32
greedy tokens through the wheel's own ref_ragged_paged_attention the same as kvzip-jax's ragged decode
(generate.decode) does; the GPU layout through the jnp paged reference the same; the pages end up holding the ragged
cache's keys and values; the RoPE positions are the logical ones; a stop token takes a sequence out of the batch as
generate.decode stops it. A saved export loads bit for bit and decodes the same tokens; a flipped byte, a truncated
file, another model or tokenizer, another format are named errors; a failed save leaves nothing. One real-model test:
the same on Qwen2.5-Coder-0.5B with KVzip's own scores."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import cache as kv
from kvzip_jax import cache_io, kvzip, prompts, serving
from kvzip_jax import generate as gen
from kvzip_jax.errors import ContextTooLongError
from kvzip_jax.models.params import init_params
from kvzip_jax.serving import decode as paged
from kvzip_jax.serving import export_io
from kvzip_jax.weights import registry
from tests.conftest import _checkpoints_dir, drop_compiled_and_freed
from tests.test_serving import CONTEXTS, PAGE, PREFIX, RATIO, TOL, serving_config

QUESTION, NEW = 5, 32
EXPORTS = {"tpu": serving.export_tpu, "gpu": serving.export_gpu}


class _Vocab:
    """A stand-in tokenizer: what weights.identity.tokenizer_hash reads."""

    def __init__(self, size: int, template: str = ""):
        self.vocab, self.all_special_ids, self.chat_template = {f"t{i}": i for i in range(size)}, [0], template

    def get_vocab(self):
        return self.vocab


@pytest.fixture(scope="module", params=[64, 128], ids=["hd64", "hd128"])
def tiny(request):
    """(model, masked pair-uniform cache at RATIO, question [B, QUESTION], kept pairs [B], ragged decode: tokens, the
    ragged cache after them, the question's logits)."""
    cfg = serving_config(request.param)
    model = registry.LoadedModel("tiny", cfg, init_params(cfg, seed=1, scale=0.15), _Vocab(cfg.vocab_size))
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, PREFIX + n).astype(np.int32) for n in CONTEXTS]
    _, cache = gen.prefill(model.params, cfg, rows, capacity=64)
    scores = jnp.asarray(rng.random((cfg.num_layers, 2, cfg.num_kv_heads, max(CONTEXTS))), jnp.float32)
    context = jnp.array(CONTEXTS, jnp.int32)
    keep = kvzip.keep_mask(scores, context, RATIO, "pair-uniform")
    masked = kv.mask_context(cache, keep, jnp.full((2,), PREFIX, jnp.int32), context)
    question = rng.integers(0, cfg.vocab_size, (2, QUESTION)).astype(np.int32)
    logits, ragged = gen.prefill(model.params, cfg, list(question), kv.pack(masked, room=QUESTION + NEW))
    tokens, ragged = gen.decode(model.params, cfg, logits, ragged, NEW)
    kept = np.asarray(kv.kept_per_head(masked))[0, :, 0]
    return model, masked, question, kept, (tokens, ragged, logits)


def _paged(model, export, question, new=NEW, **kwargs):
    logits, export = paged.append(model.params, model.cfg, question, export)
    tokens, export = paged.decode(model.params, model.cfg, logits, export, new, **kwargs)
    return tokens, export, logits


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
def test_greedy_decoding_in_the_pages_is_kvzip_jaxs_ragged_decoding(tiny, layout):
    model, masked, question, kept, (want, ragged, question_logits) = tiny
    export = EXPORTS[layout](masked, PAGE, room=QUESTION + NEW)
    logits, after_question = paged.append(model.params, model.cfg, question, export)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(question_logits), **TOL)
    tokens, export = paged.decode(model.params, model.cfg, logits, after_question, NEW)
    assert tokens == want and all(len(row) == NEW for row in tokens)
    assert len({t for row in want for t in row}) > 4  # the rows say more than one token over and over
    np.testing.assert_array_equal(np.asarray(export.kv_lens), kept + QUESTION + NEW)
    np.testing.assert_array_equal(np.asarray(export.positions), PREFIX + np.array(CONTEXTS) + QUESTION + NEW)
    np.testing.assert_array_equal(np.asarray(export.positions), np.asarray(ragged.next_position))
    for i, layer in enumerate(ragged.layers):  # the pages hold what the ragged cache holds, kept pairs and new
        k, v = serving.read_pages(export, i)  # [B, S, K, H]
        for b, n in enumerate(np.asarray(export.kv_lens)):
            for h in range(model.cfg.num_kv_heads):
                start = int(layer.offsets[b, h])
                assert int(layer.lengths[b, h]) == n
                np.testing.assert_allclose(np.asarray(k[b, :n, h]), np.asarray(layer.k[b, start : start + n]), **TOL)
                np.testing.assert_allclose(np.asarray(v[b, :n, h]), np.asarray(layer.v[b, start : start + n]), **TOL)


def test_new_tokens_take_the_logical_positions_not_kv_lens(tiny):
    model, masked, question, kept, (_, _, question_logits) = tiny
    export = serving.export_gpu(masked, PAGE, room=QUESTION)
    assert (np.asarray(export.positions) > np.asarray(export.kv_lens)).all()
    physical = dataclasses.replace(export, positions=export.kv_lens)  # what one length per sequence would give
    logits, _ = paged.append(model.params, model.cfg, question, physical)
    assert np.abs(np.asarray(logits) - np.asarray(question_logits)).max() > 1e-3


def test_the_engines_writes_are_write_pages_and_its_attention_the_reference(tiny):
    model, masked, question, _, _ = tiny
    cfg = model.cfg
    export = serving.export_tpu(masked, PAGE, room=QUESTION)
    rng = np.random.default_rng(5)
    draw = lambda heads: jnp.asarray(rng.normal(size=(2, QUESTION, heads, cfg.head_dim)), jnp.float32)
    q, k, v = draw(cfg.num_heads), draw(cfg.num_kv_heads), draw(cfg.num_kv_heads)
    layer = dataclasses.replace(export, pages=(export.pages[1],))
    engine_out, engine = paged.engine_attend(q, k, v, layer, None, cfg.query_scale)
    ours_out, ours = paged.reference_attend(q, k, v, layer, None, cfg.query_scale)
    np.testing.assert_allclose(np.asarray(engine_out), np.asarray(ours_out), **TOL)
    np.testing.assert_array_equal(np.asarray(engine.pages[0]), np.asarray(ours.pages[0]))  # the same bytes written
    assert np.asarray(engine.pages[0] != export.pages[1]).any()
    # a whole step of the model: the engine's kernel and the jnp reference over the same tpu pages
    engine_logits, engine = paged.append(model.params, cfg, question, export, kernel="engine")
    ours_logits, ours = paged.append(model.params, cfg, question, export, kernel="reference")
    np.testing.assert_allclose(np.asarray(engine_logits), np.asarray(ours_logits), **TOL)
    for a, b in zip(engine.pages, ours.pages):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
def test_a_stop_token_takes_its_sequence_out_of_the_batch(tiny, layout):
    model, masked, question, kept, (want, _, question_logits) = tiny
    new = 8
    stop = next(t for t in want[0][2:new] if t not in want[0][:2] and t not in want[1][:new])  # row 0 stops there
    ragged = kv.pack(masked, room=QUESTION + new)
    logits, ragged = gen.prefill(model.params, model.cfg, list(question), ragged)
    expected, ragged = gen.decode(model.params, model.cfg, logits, ragged, new, stop_tokens=[stop])
    assert expected[0][-1] == stop and len(expected[0]) < new and len(expected[1]) == new
    tokens, export, _ = _paged(
        model, EXPORTS[layout](masked, PAGE, room=QUESTION + new), question, new, stop_tokens=[stop]
    )
    assert tokens == expected
    fed = np.array([len(row) - (row[-1] == stop) for row in tokens])  # a stop token is emitted, not fed
    np.testing.assert_array_equal(np.asarray(export.kv_lens), kept + QUESTION + fed)
    np.testing.assert_array_equal(np.asarray(export.positions), np.asarray(ragged.next_position))


def test_no_room_and_a_kernel_for_another_layout_are_named(tiny):
    model, masked, question, _, _ = tiny
    short = serving.export_gpu(masked, PAGE, room=QUESTION)
    free = int(np.min(short.pages_per_seq * PAGE - np.asarray(short.kv_lens)))
    logits, short = paged.append(model.params, model.cfg, question, short)
    with pytest.raises(ContextTooLongError, match="room="):
        paged.decode(model.params, model.cfg, logits, short, free - QUESTION + 1)
    with pytest.raises(ValueError, match="reads the tpu layout"):
        paged.append(
            model.params, model.cfg, question, serving.export_gpu(masked, PAGE, room=QUESTION), kernel="engine"
        )


def test_a_saved_export_loads_bit_for_bit_and_decodes_the_same_tokens(tiny, tmp_path):
    model, masked, question, _, (want, _, _) = tiny
    for layout, dtype, new in (("gpu", None, NEW), ("tpu", None, 4), ("tpu", jnp.bfloat16, 0)):
        export = EXPORTS[layout](masked, PAGE, dtype, room=QUESTION + NEW)
        folder = tmp_path / f"{layout}-{jnp.dtype(dtype or jnp.float32).name}"
        export_io.save(folder, export, model, meta={"level": "pair-uniform"})
        back, manifest = export_io.load(folder, model)
        assert manifest["meta"] == {"level": "pair-uniform"} and manifest["layout"] == layout
        assert jax.tree.structure(back) == jax.tree.structure(export)  # the static fields too (hd64, page size)
        for a, b in zip(jax.tree.leaves(export), jax.tree.leaves(back)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if new:
            assert _paged(model, back, question, new)[0] == [row[:new] for row in want]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-float32", "tpu-bfloat16", "tpu-float32"]  # no temp


def test_a_damaged_export_or_another_model_is_a_named_error(tiny, tmp_path, monkeypatch):
    model, masked, _, _, _ = tiny
    folder = export_io.save(tmp_path / "doc.pages", serving.export_tpu(masked, PAGE, room=4), model)
    other = dataclasses.replace(model, params=init_params(model.cfg, seed=2, scale=0.15))
    with pytest.raises(cache_io.CacheMismatchError, match="weights differ"):
        export_io.load(folder, other)
    with pytest.raises(cache_io.CacheMismatchError, match="tokenizer"):
        export_io.load(folder, dataclasses.replace(model, tokenizer=_Vocab(model.cfg.vocab_size, "{{ x }}")))
    pages = folder / "arrays" / "pages.1.bin"
    data = bytearray(pages.read_bytes())
    data[len(data) // 3] ^= 0x01
    pages.write_bytes(bytes(data))
    with pytest.raises(cache_io.CacheCorruptError, match="pages.1.bin does not match its checksum"):
        export_io.load(folder, model)
    pages.write_bytes(bytes(data[:-4]))
    with pytest.raises(cache_io.CacheCorruptError, match="holds"):
        export_io.load(folder, model)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(cache_io.CacheFormatError, match="upgrade kvzip-jax"):
        export_io.load(folder, model)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": cache_io.FORMAT}))
    with pytest.raises(cache_io.CacheFormatError, match="not a kvzip-jax-paged manifest"):
        export_io.load(folder, model)
    (folder / "manifest.json").unlink()
    with pytest.raises(cache_io.CacheCorruptError, match="never saved"):
        export_io.load(folder, model)
    original = type(pages).write_bytes

    def disk_full_at_layer_1(self, data):
        if self.name == "pages.1.bin":
            raise OSError("no space left on device")
        return original(self, data)

    monkeypatch.setattr(type(pages), "write_bytes", disk_full_at_layer_1)
    with pytest.raises(OSError, match="no space"):
        export_io.save(tmp_path / "killed.pages", serving.export_gpu(masked, PAGE), model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.pages"]  # the half-written folder is gone


DOCUMENT = (
    "The survey team left Longyearbyen on the fourth of May with three sledges, two snowmobiles and a drill for ice "
    "cores. On the ninth day a crevasse opened under the second sledge; the glaciologist Henrik Aas broke his leg "
    "and was flown out by a helicopter piloted by Ingrid Solberg. The backup drill travelled in crate K-4471, which "
    "reached the camp a week late because the supply ship was held in Tromso by a storm. The team recovered cores "
    "from four sites, the deepest at 212 metres, and returned on the second of June. The complete results will be "
    "presented in Trondheim next spring, after the isotope measurements are finished in Bergen."
)


def test_qwen_decodes_32_tokens_through_the_engines_kernel_as_kvzip_jax_does(qwen_gguf):
    """Qwen2.5-Coder-0.5B (head dim 64: the engine's hd64 kernel), KVzip's own scores at 0.3, pair-uniform: 32
    greedy tokens through tpu-inference's reference over the tpu pages and through the jnp reference over the GPU
    blocks are the ragged decode's."""
    drop_compiled_and_freed()
    model = registry.load(registry.QWEN, _checkpoints_dir())
    params, cfg, tok = model.params, model.cfg, model.tokenizer
    context, suffixes = prompts.split_for_reuse(tok, DOCUMENT, ["Tell the story of the expedition in detail."])
    _, cache = gen.prefill(params, cfg, [context.ids()])
    reread = kvzip.reread_inputs(tok, [context.context_start], [context.ids()[context.context_slice]])
    config = kvzip.KVzipConfig(level="pair-uniform")
    masked, _ = jax.jit(kvzip.score_and_evict)(params, cfg, cache, reread, 0.3, config)
    del cache
    drop_compiled_and_freed()  # the scoring programs are not needed again: the decode's peak need not sit on them
    question = np.asarray(suffixes[0], np.int32)[None]  # [1, T]
    room = question.shape[1] + NEW
    logits, ragged = gen.prefill(params, cfg, list(question), kv.pack(masked, room=room))
    want, _ = gen.decode(params, cfg, logits, ragged, NEW)
    print("ragged:", repr(tok.decode(want[0])))
    assert len(set(want[0])) > 8  # an answer, not one token repeated
    for layout, export in EXPORTS.items():
        got, _, _ = _paged(model, export(masked, 16, room=room), question)
        print(f"{layout}:", repr(tok.decode(got[0])))
        assert got == want, layout
