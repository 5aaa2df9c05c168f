"""Converted checkpoints on disk, written atomically:

  <dir>/params/       orbax (StandardCheckpointer) parameter tree in the source's precision (bf16 safetensors stay
                      bf16 on disk), restored against abstract_params(cfg)'s shapes in the dtype asked for, onto one
                      device or straight into a mesh's layout (any mesh, whichever one saved it)
  <dir>/config.json   ModelConfig.to_dict()
  <dir>/tokenizer/    tokenizer.save_pretrained (chat template included)

Everything is first written into a temporary sibling folder that is renamed into place only once complete; on any
failure the temporary folder is removed, so a checkpoint folder either is complete or does not exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp

from kvzip_jax import sharding
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ModelFileError, WeightShapeError
from kvzip_jax.models.params import abstract_params, param_shapes
from kvzip_jax.weights.tokenizer import tokenizer_from_hf

PARAMS, CONFIG, TOKENIZER = "params", "config.json", "tokenizer"


def is_checkpoint(path: str | Path) -> bool:
    """True for a folder laid out by save_checkpoint."""
    path = Path(path)
    return (path / CONFIG).is_file() and (path / PARAMS).is_dir()


@contextlib.contextmanager
def atomic_dir(target: str | Path, overwrite: bool = False, error: type[Exception] = ModelFileError):
    """Yields a temporary sibling folder of `target`; renames it to `target` when the block succeeds, removes it
    when the block raises. An existing `target` is replaced only with overwrite=True (else `error`)."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise error(f"{target} already exists; remove it or pass overwrite=True")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        if not target.exists():
            os.rename(tmp, target)
        elif overwrite:
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            raise error(f"{target} was created by another writer meanwhile")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _restore_target(cfg: ModelConfig, stored, dtype, mesh) -> dict:
    """abstract_params' shapes in `dtype` (None: each array's stored dtype, from the checkpoint's metadata `stored`)
    with explicit shardings: sharding.param_shardings (the mesh already checked), or this host's first device without
    a mesh. Built leaf by leaf, not by eval_shape (which can drop shardings, flax#5110), so orbax reads each device's
    slice straight from disk into its layout, casting while reading."""
    shardings = (
        sharding.param_shardings(param_shapes(cfg), mesh)
        if mesh is not None
        else jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]),
            param_shapes(cfg),
            is_leaf=lambda x: isinstance(x, tuple),
        )
    )
    stored_dtypes = {
        jax.tree_util.keystr(path): leaf.dtype for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]
    }

    def target(path, s, where):
        chosen = dtype or stored_dtypes.get(jax.tree_util.keystr(path), s.dtype)
        return jax.ShapeDtypeStruct(s.shape, chosen, sharding=where)

    return jax.tree_util.tree_map_with_path(target, abstract_params(cfg), shardings)


def save_checkpoint(directory: str | Path, cfg: ModelConfig, params: dict, tokenizer, overwrite: bool = False) -> Path:
    """Writes params (float arrays, each stored in its own dtype; numpy, or jax arrays on any sharding, written by
    their devices), config and tokenizer into `directory`, atomically."""
    import orbax.checkpoint as ocp

    expected = jax.tree.map(lambda s: s.shape, abstract_params(cfg))
    actual = jax.tree.map(lambda a: tuple(a.shape), params)
    if actual != expected:
        raise WeightShapeError(f"params do not match the layout of the config: got {actual}, expected {expected}")
    with atomic_dir(directory, overwrite) as tmp:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / PARAMS, jax.tree.map(jnp.asarray, params))
            checkpointer.wait_until_finished()
        (tmp / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp / TOKENIZER))
    return Path(directory)


def load_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / CONFIG
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ModelFileError(f"no {CONFIG} in {directory}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelFileError(f"{path} is not a kvzip-jax config ({type(e).__name__}: {e})") from None


def load_checkpoint(directory: str | Path, dtype=None, mesh=None) -> tuple[ModelConfig, dict, object]:
    """(config, parameter tree of jax arrays, tokenizer) from a folder written by save_checkpoint. dtype: the
    arrays' dtype (cast while reading, so an 8B float32 checkpoint never sits in memory as float32); None: as
    stored. mesh: a (data, seq, tensor) mesh to restore onto, whatever mesh it was saved from, each device reading
    only its shards (layout: sharding.param_shardings; MeshError if the model does not fit it); None: this host's
    first device."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not is_checkpoint(directory):
        raise ModelFileError(f"{directory} is not a converted checkpoint (needs {CONFIG} and {PARAMS}/)")
    cfg = load_config(directory)
    if mesh is not None:
        sharding.check_mesh(cfg, mesh)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(directory / PARAMS).item_metadata
            params = checkpointer.restore(directory / PARAMS, _restore_target(cfg, stored, dtype, mesh))
    except ValueError as e:
        raise WeightShapeError(f"{directory / PARAMS} does not match {CONFIG}: {str(e).splitlines()[0]}") from None
    except (OSError, RuntimeError) as e:
        raise ModelFileError(f"cannot restore {directory / PARAMS} ({type(e).__name__}: {e})") from None
    return cfg, params, tokenizer_from_hf(directory / TOKENIZER)
