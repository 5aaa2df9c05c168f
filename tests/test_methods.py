"""The methods registry: each entry's compress equals the functions it wraps (eviction: scores, budget rule, mask;
compaction: reference queries, then compact_with or compact), jitted as eagerly; bad names, options and inputs are
named; the README's table is `kvzip-jax methods`; a method defined here runs through `kvzip-jax eval` end to end."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import baselines, cli, kvzip, matching, methods
from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from tests.conftest import bundled_tokenizer, tiny_config
from tests.test_compact import _reread
from tests.test_eval_sweep import tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def setup():
    """A tiny random model's cache of [prefix 4 | context] for two rows of 40 and 29 context tokens, and every
    input a method may read."""
    cfg = tiny_config(2)
    params = init_params(cfg, seed=1, scale=0.15)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 101, 4 + n).astype(np.int32) for n in (40, 29)]
    _, cache = gen.prefill(params, cfg, rows, capacity=128)
    prefix = jnp.array([4, 4], jnp.int32)
    context = [r[4:] for r in rows]
    reread = _reread([4, 4], context, 16, rng)
    tokens = np.zeros((2, 64), np.int32)
    for b, row in enumerate(context):
        tokens[b, : len(row)] = row
    question = (jnp.asarray(rng.integers(0, 101, (2, 6)), jnp.int32), jnp.array([6, 4], jnp.int32))
    inputs = methods.Inputs(
        prefix,
        reread.context_len,
        reread=reread,
        context_tokens=jnp.asarray(tokens),
        question=question,
        key=jnp.stack([jax.random.key(1), jax.random.key(2)]),
    )
    return cfg, params, cache, inputs


def _only(method: methods.Method, inputs: methods.Inputs) -> methods.Inputs:
    """The inputs a method reads (as a sweep gives them), the rest left out."""
    return methods.Inputs(
        inputs.prefix_len, inputs.context_len, **{name: getattr(inputs, name) for name in method.reads}
    )


def _assert_same_cache(a: kv.KVCache, b: kv.KVCache) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "name",
    [
        "kvzip",
        "kvzip-plus",
        "snapkv",
        *(pytest.param(n, marks=pytest.mark.heavy) for n in ("h2o", "pyramidkv", "streamingllm", "random")),
    ],
)
def test_an_eviction_entry_is_its_scores_budget_rule_and_mask(setup, name):
    cfg, params, cache, inputs = setup
    method = methods.get(name)
    given = _only(method, inputs)
    got = jax.jit(method.compress)(params, cfg, cache, given, 0.3)
    if name.startswith("kvzip"):  # kvzip-plus: KVzip+ normalised scores (test_kvzip_score, test_kvzip_real)
        want, _ = kvzip.score_and_evict(params, cfg, cache, inputs.reread, 0.3, method.options)
        assert method.options.kvzip_plus == (name == "kvzip-plus")
    else:
        scores = baselines.baseline_scores(
            name,
            params,
            cfg,
            cache,
            inputs.prefix_len,
            inputs.context_len,
            inputs.context_tokens,
            question=given.question,
            key=inputs.key,
        )
        keep = baselines.keep_for(name, scores, inputs.context_len, 0.3, kvzip.scoring.evictable_layers(cfg))
        want = kv.mask_context(cache, keep, inputs.prefix_len, inputs.context_len)
    _assert_same_cache(got, want)
    _assert_same_cache(method.compress(params, cfg, cache, given, 0.3), got)  # eager as jitted


@pytest.mark.parametrize(
    "name", ["am-hak", *(pytest.param(n, marks=pytest.mark.heavy) for n in ("kvzip-am", "am-hak-op"))]
)
def test_a_compaction_entry_is_its_matching_config(setup, name):
    cfg, params, cache, inputs = setup
    method = methods.get(name)
    config = dataclasses.replace(method.options, ratio=0.3)
    want, _ = (matching.compact if config.on_policy else jax.jit(matching.compact))(
        params, cfg, cache, inputs.reread, config
    )
    compress = method.compress if method.eager else jax.jit(method.compress, static_argnames="ratio")
    _assert_same_cache(compress(params, cfg, cache, _only(method, inputs), 0.3), want)


def test_prepare_once_then_finish_per_ratio_is_compress(setup):
    cfg, params, cache, inputs = setup
    method = methods.get("snapkv")
    given = _only(method, inputs)
    state = method.jitted_prepare(params, cfg, cache, given, method.options)
    for ratio in (0.2, 0.7):
        _assert_same_cache(
            method.jitted_finish(params, cfg, cache, given, state, ratio, method.options),
            method.compress(params, cfg, cache, given, ratio),
        )


def test_names_options_and_inputs_are_checked(setup):
    cfg, params, cache, inputs = setup
    with pytest.raises(methods.MethodError, match="unknown method 'magic'; choose from kvzip, kvzip-plus, h2o"):
        methods.get("magic")
    with pytest.raises(methods.MethodError, match="registered already"):
        methods.register(methods.get("kvzip"))
    with pytest.raises(methods.MethodError, match=r"no option\(s\) \['levels'\]"):
        methods.get("kvzip").options_for(levels="pair")
    assert methods.get("kvzip").options_for(level="layer").level == "layer"
    no_key = methods.Inputs(inputs.prefix_len, inputs.context_len, context_tokens=inputs.context_tokens)
    random = methods.get("random")
    with pytest.raises(methods.MethodError, match="random needs the input"):
        random.compress(params, cfg, cache, no_key, 0.3)
    with pytest.raises(methods.MethodError, match="random needs the input"):  # as the sweep and the CLI call it
        random.jitted_prepare(params, cfg, cache, no_key, random.options)
    with pytest.raises(methods.MethodError, match="unknown inputs"):
        dataclasses.replace(methods.get("kvzip"), name="x", needs=("weights",))
    for name in methods.names():
        method = methods.get(name)
        assert method.family in methods.FAMILIES and method.paper and method.description
        assert "ratio" not in method.option_defaults()


def test_the_readme_method_table_is_kvzip_jax_methods(capsys):
    assert cli.main(["methods"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == methods.table()
    table = re.search(r"^\| method \| family .*?(?=\n\n)", README.read_text(), re.S | re.M)
    assert table is not None and table.group(0) == printed


def _toy_prepare(params, cfg, cache, inputs, options):
    """[L, B, K, n]: later context columns score higher (the most recent pairs stay), -inf past each context."""
    n = inputs.context_tokens.shape[1]
    columns = jnp.arange(n, dtype=jnp.float32)
    scores = jnp.where(columns < inputs.context_len[:, None], columns * options.slope, -jnp.inf)  # [B, n]
    return jnp.broadcast_to(scores[None, :, None, :], (cfg.num_layers, scores.shape[0], cfg.num_kv_heads, n))


def _toy_finish(params, cfg, cache, inputs, scores, ratio, options):
    keep = kvzip.keep_mask(scores, inputs.context_len, ratio, "pair-uniform")
    return kv.mask_context(cache, keep, inputs.prefix_len, inputs.context_len)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _ToyOptions:
    slope: float = 1.0


@pytest.mark.heavy
def test_a_method_defined_here_runs_through_eval_with_table_and_plot(capsys, monkeypatch, tmp_path):
    """A new method is one register call: the CLI lists it, the sweep runs it beside kvzip, the report tables and
    plots it; nothing else changes."""
    model = tiny_model(bundled_tokenizer(registry.SMOLLM2))
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": model)
    toy = methods.Method(
        name="toy-recent",
        family="eviction",
        question_aware=False,
        paper="(a test)",
        description="the most recent pairs",
        options=_ToyOptions(),
        prepare=_toy_prepare,
        finish=_toy_finish,
        needs=("context_tokens",),
    )
    methods.register(toy)
    try:
        assert cli.main(["methods"]) == 0 and "| `toy-recent` | eviction | no | (a test) |" in capsys.readouterr().out
        out = tmp_path / "run"
        argv = [
            "eval",
            "--model",
            "tiny",
            "--tasks",
            "passkey",
            "--contexts",
            "2",
            "--context-tokens",
            "100",
            "--methods",
            "kvzip,toy-recent",
            "--ratios",
            "1,0.3",
            "--batch-size",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
        assert cli.main(argv) == 0
    finally:
        methods.unregister("toy-recent")
    printed = capsys.readouterr().out
    assert "| passkey | toy-recent | reuse |" in printed and "| passkey | kvzip | reuse |" in printed
    for name in ("summary.md", "summary.csv", "scores.png"):
        assert (out / name).stat().st_size > 0
    assert "toy-recent" in (out / "summary.csv").read_text()


def test_method_specs_carry_options():
    method, changes = methods.parse_spec("kvzap:threshold=-4:window=64")
    assert method.name == "kvzap" and changes == {"threshold": -4, "window": 64}
    assert methods.parse_spec("kvzip:level=layer") == (methods.get("kvzip"), {"level": "layer"})
    assert methods.parse_spec("snapkv") == (methods.get("snapkv"), {})
    with pytest.raises(methods.MethodError, match="no option"):
        methods.parse_spec("kvzip:levels=layer")
    with pytest.raises(methods.MethodError, match="NAME:OPTION=VALUE"):
        methods.parse_spec("kvzip:layer")
    with pytest.raises(methods.MethodError, match="unknown method 'magic'"):
        methods.parse_spec("magic:x=1")
