"""kvzip-jax compress --export-paged on a tiny random model (SmolLM2's tokenizer, read from its saved copy; no model
weights): the pages written for either layout load for the same model and answer the question token for token as
the ragged cache the same run saved does; a cache that is not pair-uniform is one line naming --level pair-uniform,
and nothing is written; flags that do not go together are usage errors before the model loads."""

import dataclasses

import pytest

from kvzip_jax import cache_io, cli, prompts
from kvzip_jax import generate as gen
from kvzip_jax.models.params import init_params
from kvzip_jax.serving import decode as paged
from kvzip_jax.serving import export_io
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer, tiny_config
from tests.test_cli import CONTEXT, QUESTION, _fails_with_one_line, context_file  # noqa: F401 (fixture)

NEW = 8


@pytest.fixture(scope="module")
def tiny_model():
    tokenizer = bundled_tokenizer(registry.SMOLLM2)
    cfg = dataclasses.replace(tiny_config(2), vocab_size=len(tokenizer))
    return registry.LoadedModel("tiny", cfg, init_params(cfg, seed=1, scale=0.15), tokenizer)


@pytest.fixture
def tiny(monkeypatch, tiny_model):
    """The tiny model, as the CLI's registry.load returns it."""
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": tiny_model)
    return tiny_model


def _compress(context_file, *flags):
    return ["compress", "--model", "tiny", "--context", str(context_file), "--ratio", "0.3", *flags]


@pytest.mark.parametrize("layout", ["tpu", "gpu"])
def test_export_paged_loads_and_answers_as_the_saved_cache(capsys, tiny, context_file, tmp_path, layout):
    pages, saved = tmp_path / "doc.pages", tmp_path / "doc.kv"
    question = ["--question", QUESTION, "--max-new-tokens", str(NEW), "--chunk-size", "64", "--level", "pair-uniform"]
    export_flags = ["--export-paged", str(pages), "--page-size", "8", "--paged-layout", layout, "--save", str(saved)]
    assert cli.main(_compress(context_file, *question, *export_flags)) == 0
    out = capsys.readouterr().out
    assert f"exported to {pages}/" in out and f"{layout} pages of 8 slots" in out and out.count("\nA: ") == 1
    export, manifest = export_io.load(pages, tiny)
    cache, _ = cache_io.load(saved, tiny)
    assert manifest["meta"]["level"] == "pair-uniform" and manifest["meta"]["method"] == "kvzip"
    assert (export.layout, export.page_size) == (layout, 8)
    lengths = cache.layers[0].lengths  # [1, K]: the same count in every (layer, KV head)
    assert int(export.kv_lens[0]) == int(lengths[0, 0]) and int(export.positions[0]) == int(cache.next_position[0])
    context, suffixes = prompts.split_for_reuse(tiny.tokenizer, CONTEXT, [QUESTION])
    assert int(export.positions[0]) == len(context) > int(export.kv_lens[0])  # compressed, positions logical
    stops = prompts.stop_token_ids(tiny.tokenizer)
    want = gen.ask(tiny.params, tiny.cfg, cache, suffixes[0], NEW, stop_tokens=stops)[0]
    logits, export = paged.append(tiny.params, tiny.cfg, suffixes[0], export)
    assert paged.decode(tiny.params, tiny.cfg, logits, export, NEW, stop_tokens=stops)[0] == [want]


def test_a_cache_that_is_not_pair_uniform_is_named_before_anything_is_written(capsys, tiny, context_file, tmp_path):
    pages, saved = tmp_path / "doc.pages", tmp_path / "doc.kv"
    argv = _compress(context_file, "--chunk-size", "64", "--export-paged", str(pages), "--save", str(saved))
    _fails_with_one_line(capsys, argv, "one length per sequence", "--level pair-uniform")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context.txt"]


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--page-size", "8"], "go with --export-paged"),
        (["--paged-layout", "gpu"], "go with --export-paged"),
        (["--export-paged", "x", "--kv-bits", "8"], "no --kv-bits"),
        (["--export-paged", "x", "--page-size", "0"], "--page-size must be >= 1"),
    ],
)
def test_export_paged_flags_that_do_not_go_together_exit_2_before_loading(
    capsys, monkeypatch, context_file, flags, fragment
):
    monkeypatch.setattr(registry, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_compress(context_file, "--question", QUESTION, *flags))
    assert exit_info.value.code == cli.EXIT_USER_ERROR and fragment in capsys.readouterr().err
