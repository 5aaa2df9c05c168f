"""Saved caches: a (compressed) cache written once, loaded in another process with no prefill and no scoring.

    cache_io.save("doc.kv", cache, model, meta={"method": "kvzip", "ratio": 0.3, ...})
    cache, manifest = cache_io.load("doc.kv", model)      # raises a named CacheFileError subclass on any mismatch

On disk (written into a temporary sibling folder renamed into place only when complete, so a killed save leaves
nothing that loads):

  <dir>/arrays/         orbax (StandardCheckpointer) tree of the cache: per layer k, v, lengths and, where the layer
                        has them, keep (masked), bias (compacted), offsets (ragged); a quantized layer stores
                        k_codes, k_scale, k_zero (and v's) in place of k and v, its window as window_k,
                        window_v, window_lengths, and key_center where its keys are centred; next_position
  <dir>/manifest.json   written last: format and layout version, package version, the model's identity (config hash,
                        parameter fingerprint, name and where it was loaded from), the tokenizer's hash, the dtype,
                        each layer's kind and shapes (a quantized layer: its store's kind, key and value bits,
                        groups, scale dtype and window), a sha256 per array (orbax keeps no checksum), and the caller's
                        meta (method, level, ratio, prefix and context token hashes and lengths)

`load` checks, in order: a manifest exists (CacheCorruptError: not a saved cache, or a save that never finished),
its format and layout version (CacheFormatError: a newer layout), the model, tokenizer and dtype given
(CacheMismatchError), then the arrays against their shapes and checksums (CacheCorruptError).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import dtypes
from kvzip_jax.errors import KvzipError
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights.checkpoint import atomic_dir
from kvzip_jax.weights.identity import model_identity, package_version, tokenizer_hash

FORMAT, LAYOUT_VERSION = "kvzip-jax-cache", 4  # 2: quantized layers; 3: centred keys; 4: values in other bits than
# keys (k8v4). A cache is written as the lowest version that holds it.
ARRAYS, MANIFEST = "arrays", "manifest.json"
DENSE, RAGGED, QUANTIZED = "dense", "ragged", "quantized"
QUANT_FIELDS = ("codes", "scale", "zero")


class CacheFileError(KvzipError):
    """A saved cache cannot be used: the base class of the errors below."""


class CacheCorruptError(CacheFileError):
    """Not a saved cache, a save that never finished, or arrays that are truncated or do not match their checksums."""


class CacheFormatError(CacheFileError):
    """A saved cache of another format, or of a layout newer than this kvzip-jax reads."""


class CacheMismatchError(CacheFileError):
    """A saved cache made with another model, tokenizer or dtype than the one given."""


def token_hash(ids) -> str:
    """16 hex digits of a token id sequence (int32), for the manifest's prefix and context."""
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:16]


def save(directory: str | Path, cache: kv.KVCache, model, meta: dict | None = None, overwrite: bool = False) -> Path:
    """Writes cache (dense, masked, compacted or ragged) made with `model` (registry.LoadedModel) into `directory`,
    atomically, with its manifest; meta: what the caller knows of how it was made (JSON-able). Returns the folder."""
    import orbax.checkpoint as ocp

    tree = _tree(cache)
    layers = [_layer_layout(layer) for layer in cache.layers]
    arrays = {jax.tree_util.keystr(path): _sha256(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    manifest = {
        "format": FORMAT,
        "layout_version": _layout_version(cache),
        "kvzip_jax": package_version("kvzip-jax"),
        "model": {"name": model.name, **model_identity(model.cfg, model.params)},
        "tokenizer": tokenizer_hash(model.tokenizer),
        "dtype": np.dtype(dtypes.of_params(model.params)).name,
        "batch_size": cache.batch_size,
        "next_position": np.asarray(cache.next_position).tolist(),
        "layers": layers,
        "sha256": arrays,
        "meta": meta or {},
    }
    with atomic_dir(directory, overwrite) as tmp:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp / ARRAYS, tree)
            checkpointer.wait_until_finished()
        _write_manifest(tmp / MANIFEST, manifest)
    return Path(directory)


def _write_manifest(path: Path, manifest: dict) -> None:
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def read_json(directory: str | Path, what: str) -> tuple[Path, object]:
    """(path, parsed JSON) of <directory>/manifest.json; CacheCorruptError when it is missing (`what` names the saved
    form) or unreadable."""
    path = Path(directory) / MANIFEST
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise CacheCorruptError(
            f"{directory} is not a {what} (no {MANIFEST}: never saved, or the save did not finish)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise CacheCorruptError(f"{path} is unreadable ({type(e).__name__}: {e})") from None


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a saved cache, its format and layout version checked (nothing else read)."""
    path, manifest = read_json(directory, "saved cache")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheFormatError(f"{path} is not a {FORMAT} manifest")
    version = manifest.get("layout_version")
    if not isinstance(version, int) or version > LAYOUT_VERSION:
        raise CacheFormatError(
            f"{directory} has cache layout version {version}; this kvzip-jax "
            f"({package_version('kvzip-jax')}) reads up to {LAYOUT_VERSION}: upgrade kvzip-jax"
        )
    return manifest


def check_model(manifest: dict, model) -> None:
    """Raises CacheMismatchError unless the manifest was written for this model, tokenizer and dtype."""
    saved = manifest["model"]
    dtype = np.dtype(dtypes.of_params(model.params)).name
    if manifest["dtype"] != dtype:
        raise CacheMismatchError(
            f"the cache was saved in {manifest['dtype']}; this model runs in {dtype} (load the "
            f"model with dtype={manifest['dtype']!r})"
        )
    identity = model_identity(model.cfg, model.params)
    for field, what in (("config", "configuration"), ("params", "weights")):
        if saved[field] != identity[field]:
            raise CacheMismatchError(
                f"the cache was saved with model {saved['name']!r}, whose {what} differ from "
                f"those of {model.name!r} ({field} {saved[field]} vs {identity[field]})"
            )
    if manifest["tokenizer"] != tokenizer_hash(model.tokenizer):
        raise CacheMismatchError(f"the cache was saved with another tokenizer or chat template than {model.name!r}'s")


def load(directory: str | Path, model) -> tuple[kv.KVCache, dict]:
    """(cache, manifest) from a folder written by save, for `model`; raises a CacheFileError subclass on anything
    that does not match (see the module docstring), before any array is used."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    manifest = read_manifest(directory)
    check_model(manifest, model)
    dtype = dtypes.of_params(model.params)
    try:
        target = _abstract(manifest, dtype)
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.restore(directory / ARRAYS, target)
    except CacheFileError:
        raise
    except Exception as e:  # orbax and tensorstore raise plain Exceptions on truncated or damaged files
        first = (str(e).splitlines() or [""])[0][:200]
        raise CacheCorruptError(f"cannot restore {directory / ARRAYS} ({type(e).__name__}: {first})") from None
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if manifest["sha256"].get(name) != _sha256(leaf):
            raise CacheCorruptError(
                f"{directory / ARRAYS}: array {name} does not match its checksum (the files were "
                "changed or damaged after saving)"
            )
    return _cache(tree, manifest), manifest


def _layout_version(cache: kv.KVCache) -> int:
    """The lowest layout version that holds cache: 1 unquantized, 2 quantized, 3 with centred keys, 4 with values in
    other bits than keys."""
    quantized = [layer for layer in cache.layers if isinstance(layer, kv.QuantizedLayerCache)]
    if any(layer.store.k.bits != layer.store.v.bits for layer in quantized):
        return 4
    if any(layer.key_center is not None for layer in quantized):
        return 3
    return 2 if quantized else 1


def _tree(cache: kv.KVCache) -> dict:
    """The cache as a plain dict of arrays (what orbax stores)."""
    return {
        "layers": {str(i): _fields(layer) for i, layer in enumerate(cache.layers)},
        "next_position": cache.next_position,
    }


def _fields(layer) -> dict:
    if isinstance(layer, kv.QuantizedLayerCache):
        fields = _fields(layer.store)
        for name in ("k", "v"):
            rows = fields.pop(name)
            fields.update({f"{name}_{part}": getattr(rows, part) for part in QUANT_FIELDS})
        window = layer.window
        center = {} if layer.key_center is None else {"key_center": layer.key_center}
        return {**fields, "window_k": window.k, "window_v": window.v, "window_lengths": window.lengths, **center}
    fields = {"k": layer.k, "v": layer.v, "lengths": layer.lengths}
    for name in ("keep", "bias", "offsets"):
        value = getattr(layer, name, None)
        if value is not None:
            fields[name] = value
    return fields


def _layer_layout(layer) -> dict:
    fields = {name: [list(x.shape), np.dtype(x.dtype).name] for name, x in _fields(layer).items()}
    if isinstance(layer, kv.QuantizedLayerCache):
        fmt = layer.store.k.format
        store = RAGGED if isinstance(layer.store, kv.RaggedLayerCache) else DENSE
        return {
            "kind": QUANTIZED,
            "store": store,
            "block": getattr(layer.store, "block", None),
            "bits": fmt.bits,
            "v_bits": layer.store.v.bits,  # k8v4: int8 keys, int4 values
            "group": fmt.group,
            "v_group": layer.store.v.format.group,  # they differ where k and v do (MLA)
            "scale_dtype": fmt.scale_dtype,
            "window": layer.window.capacity,
            "fields": fields,
        }
    if isinstance(layer, kv.RaggedLayerCache):
        return {"kind": RAGGED, "block": layer.block, "fields": fields}
    return {"kind": DENSE, "fields": fields}


MODEL_DTYPE_FIELDS = ("k", "v", "window_k", "window_v")  # in the model's dtype; the others as recorded


def _abstract(manifest: dict, dtype) -> dict:
    """The restore target: ShapeDtypeStructs on this host's first device (k, v and a window in the model's dtype)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    layers = {}
    for i, layout in enumerate(manifest["layers"]):
        if layout["kind"] not in (DENSE, RAGGED, QUANTIZED):
            raise CacheFormatError(f"unknown layer kind {layout['kind']!r}")
        layers[str(i)] = {
            name: jax.ShapeDtypeStruct(
                tuple(shape), dtype if name in MODEL_DTYPE_FIELDS else np.dtype(kind), sharding=sharding
            )
            for name, (shape, kind) in layout["fields"].items()
        }
    position = jax.ShapeDtypeStruct((manifest["batch_size"],), np.int32, sharding=sharding)
    return {"layers": layers, "next_position": position}


def _cache(tree: dict, manifest: dict) -> kv.KVCache:
    return kv.KVCache(
        layers=tuple(_layer(dict(tree["layers"][str(i)]), layout) for i, layout in enumerate(manifest["layers"])),
        next_position=tree["next_position"],
    )


def _layer(fields: dict, layout: dict):
    if layout["kind"] == QUANTIZED:
        bits = {"k": layout["bits"], "v": layout.get("v_bits", layout["bits"])}  # layouts 2-3: one width
        for name in ("k", "v"):
            fields[name] = quant.Quantized(*(fields.pop(f"{name}_{part}") for part in QUANT_FIELDS), bits=bits[name])
        window = kv.LayerCache(k=fields.pop("window_k"), v=fields.pop("window_v"), lengths=fields.pop("window_lengths"))
        key_center = fields.pop("key_center", None)
        return kv.QuantizedLayerCache(
            store=_layer(fields, {**layout, "kind": layout["store"]}), window=window, key_center=key_center
        )
    if layout["kind"] == RAGGED:
        return kv.RaggedLayerCache(block=layout["block"], **fields)
    return kv.LayerCache(**fields)


def _sha256(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()
