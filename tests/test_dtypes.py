"""The dtype policy: bfloat16 or float32 by choice, "auto" by backend, caches follow the params, float32 where
numbers accumulate (logits, scores), a named error for anything else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvzip_jax import dtypes
from kvzip_jax import generate as gen
from kvzip_jax.cli import main as cli_main
from kvzip_jax.kvzip import RereadInputs, score
from tests.test_compressed_cache import CFG, PARAMS, PREFIX, SEQUENCE


def test_auto_is_float32_on_cpu_and_the_choices_resolve():
    assert jax.default_backend() == "cpu"
    assert dtypes.resolve("auto") == jnp.float32 and dtypes.resolve(None) == jnp.float32
    assert dtypes.resolve("bfloat16") == jnp.bfloat16 and dtypes.resolve(jnp.float32) == jnp.float32


@pytest.mark.parametrize("bad", ["float16", "int8", "fp8", 3])
def test_other_dtypes_are_named(bad):
    with pytest.raises(dtypes.DtypeError, match="auto, float32, bfloat16"):
        dtypes.resolve(bad)


def test_a_bfloat16_model_fills_a_bfloat16_cache_and_returns_float32_numbers():
    p16 = dtypes.cast_params(PARAMS, "bfloat16")
    assert dtypes.of_params(p16) == jnp.bfloat16
    logits, cache = gen.prefill(p16, CFG, [SEQUENCE])
    assert logits.dtype == jnp.float32
    assert {layer.k.dtype for layer in cache.layers} == {jnp.dtype(jnp.bfloat16)}
    logits32, _ = gen.prefill(PARAMS, CFG, [SEQUENCE])
    # Same random model in two precisions. Each bfloat16 rounding is 2^-8 relative; through two layers of large
    # random weights they stay within a tenth of the logits' spread (the bar that matters, next-token agreement on
    # real weights, is tests/test_bfloat16.py).
    diff = np.abs(np.asarray(logits) - np.asarray(logits32))
    assert diff.max() < 0.1 * np.asarray(logits32).std()
    assert diff.max() > 1e-4  # it really ran in bfloat16

    n = len(SEQUENCE) - PREFIX
    reread = RereadInputs(
        tokens=jnp.asarray(np.concatenate([[7, 8, 9], SEQUENCE[PREFIX:]])[None, None], jnp.int32),
        num_valid=jnp.asarray([[n + 3]], jnp.int32),
        chunk_start=jnp.asarray([[PREFIX]], jnp.int32),
        chunk_len=jnp.asarray([[n]], jnp.int32),
        prefix_len=jnp.asarray([PREFIX], jnp.int32),
        context_len=jnp.asarray([n], jnp.int32),
        chunk_size=n,
    )
    scores = score(p16, CFG, cache, reread)
    assert scores.dtype == jnp.float32 and np.isfinite(np.asarray(scores)).all()


def test_cli_dtype_and_attention_impl_flags_are_on_every_model_command(capsys):
    for command in ("compress", "eval", "head-scores"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        out = capsys.readouterr().out
        assert "--dtype {auto,float32,bfloat16}" in out and "--attention-impl {auto,xla,pallas}" in out, command
    with pytest.raises(SystemExit):
        cli_main(["convert", "--help"])
    assert "--dtype {source,float32,bfloat16}" in capsys.readouterr().out
