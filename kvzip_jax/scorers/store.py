"""Trained scorers on disk, written atomically:

  <dir>/params/         orbax (StandardCheckpointer) parameter tree, every leaf stacked over layers
  <dir>/manifest.json   {"kind": "gate" | "linear", "config": the sizes (GateConfig's fields for a gate; layers,
                        hidden, kv_heads for a linear scorer), "model": the model's name, "model_config": a
                        fingerprint of its config, and whatever else the caller records (data size, held-out loss,
                        seconds)}

Everything is first written into a temporary sibling folder that is renamed into place only once complete; on any
failure the temporary folder is removed, so a scorer folder either is complete or does not exist.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.errors import KvzipError
from kvzip_jax.weights.checkpoint import atomic_dir

PARAMS, MANIFEST = "params", "manifest.json"
KINDS = {
    "gate": ("q_w", "q_b", "k_w", "q_norm", "k_norm", "k_base", "b"),
    "linear": ("w", "b"),
}


class ScorerFileError(KvzipError):
    """A trained scorer's folder cannot be written where asked (it exists already), or cannot be read."""


class ScorerMismatchError(ScorerFileError, ValueError):
    """No usable trained scorer for the model asked for: the folder is missing or unreadable, or it was trained for
    another model or model config."""


def scorer_config(kind: str, params: dict) -> dict[str, int]:
    """The sizes of a scorer read from its parameters' shapes (every leaf stacked over layers)."""
    if kind not in KINDS:
        raise ValueError(f"unknown scorer kind {kind!r}; expected one of {sorted(KINDS)}")
    if set(params) != set(KINDS[kind]):
        raise ValueError(f"a {kind} scorer has parameters {sorted(KINDS[kind])}, got {sorted(params)}")
    shape = lambda name: tuple(np.shape(params[name]))
    if kind == "linear":
        L, D, H = shape("w")
        return {"layers": L, "hidden": D, "kv_heads": H}
    L, D, _ = shape("q_w")
    _, H, S, R = shape("k_base")
    G = shape("b")[2]
    return {"layers": L, "hidden": D, "kv_heads": H, "group": G, "rank": R, "sinks": S}


def _jsonable(value):
    """numpy scalars and arrays, paths and dataclasses as JSON values."""
    if isinstance(value, (np.generic, np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    if isinstance(value, Path):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot write {type(value).__name__} into a manifest")


def save_scorer(
    directory: str | Path, kind: str, params: dict, manifest: dict, overwrite: bool = False, config=None
) -> Path:
    """Writes a scorer's params (stacked over layers) and its manifest into `directory`, atomically. manifest must
    name "model" and "model_config"; config: the scorer's config (a dataclass such as GateConfig, or a dict) whose
    fields are recorded, checked against the params' shapes (None: the sizes read from the shapes). An existing
    directory is refused (ScorerFileError) unless overwrite."""
    import orbax.checkpoint as ocp

    inferred = scorer_config(kind, params)
    if config is None:
        fields = inferred
    else:
        fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
        wrong = {k: (fields[k], v) for k, v in inferred.items() if k in fields and fields[k] != v}
        if wrong:
            raise ValueError(f"config does not match the params' shapes (config, params): {wrong}")
        fields = {**inferred, **fields}
    missing = [key for key in ("model", "model_config") if key not in manifest]
    if missing:
        raise ValueError(f"the manifest must name {missing}")
    if manifest.get("kind", kind) != kind:
        raise ValueError(f"the manifest says kind {manifest['kind']!r}, saving a {kind!r} scorer")
    record = {"kind": kind, "config": fields, **{k: v for k, v in manifest.items() if k not in ("kind", "config")}}
    text = json.dumps(record, indent=2, default=_jsonable) + "\n"  # before writing anything: fails on bad values
    directory = Path(directory).absolute()
    with atomic_dir(directory, overwrite, error=ScorerFileError) as tmp:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / PARAMS, jax.tree.map(jnp.asarray, params))
            checkpointer.wait_until_finished()
        (tmp / MANIFEST).write_text(text)
    return directory


def _read_manifest(directory: Path, wanted: str) -> dict:
    if not (directory / MANIFEST).is_file() or not (directory / PARAMS).is_dir():
        raise ScorerMismatchError(f"no trained scorer at {directory} (needs {MANIFEST} and {PARAMS}/){wanted}")
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScorerMismatchError(f"cannot read {directory / MANIFEST} ({type(e).__name__}: {e}){wanted}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("kind") not in KINDS
        or not isinstance(manifest.get("config"), dict)
    ):
        raise ScorerMismatchError(f"{directory / MANIFEST} is not a scorer manifest{wanted}")
    return manifest


def load_scorer(directory: str | Path, model: str | None = None, model_config: str | None = None):
    """(kind, params stacked over layers on this host's first device, manifest) from a folder written by
    save_scorer. model, model_config: when given, the manifest must name the same (else ScorerMismatchError, as for
    a missing or unreadable folder)."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    wanted = "".join(
        f", wanted {name} {value!r}" for name, value in (("model", model), ("model_config", model_config)) if value
    )
    manifest = _read_manifest(directory, wanted)
    for name, value in (("model", model), ("model_config", model_config)):
        if value is not None and manifest.get(name) != value:
            raise ScorerMismatchError(
                f"the scorer at {directory} was trained for {name} {manifest.get(name)!r}, not {value!r}"
            )
    kind = manifest["kind"]
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            stored = checkpointer.metadata(directory / PARAMS).item_metadata
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), stored)
            params = checkpointer.restore(directory / PARAMS, dict(target))
        found = scorer_config(kind, params)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        message = str(e).splitlines()[0] if str(e) else ""
        raise ScorerMismatchError(
            f"cannot restore {directory / PARAMS} ({type(e).__name__}: {message}){wanted}"
        ) from None
    wrong = {k: (manifest["config"].get(k), v) for k, v in found.items() if manifest["config"].get(k) != v}
    if wrong:
        raise ScorerMismatchError(f"{directory / PARAMS} does not match {MANIFEST} (manifest, params): {wrong}")
    return kind, params, manifest
