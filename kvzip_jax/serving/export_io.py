"""A PagedExport saved for an engine to load: the pages, the page table, the lengths, the logical positions and a
manifest, under the saved-cache rules of cache_io (and its named errors).

    export_io.save("doc.pages", export, model, meta={"method": "kvzip", "level": "pair-uniform", ...})
    export, manifest = export_io.load("doc.pages", model)   # raises a cache_io.CacheFileError subclass on a mismatch

On disk (written into a temporary sibling folder renamed into place only when complete, so a killed save leaves
nothing that loads):

  <dir>/arrays/pages.<l>.bin    layer l's page buffer (tpu [P, ps, rows, p, width] or gpu [2, P, ps, K, H]), its raw
                                bytes in C order: an engine's KV connector reads them with numpy alone
  <dir>/arrays/page_indices.bin [B, pps] int32, the pages of each sequence in order
  <dir>/arrays/kv_lens.bin      [B] int32, each sequence's physical length (kept pairs)
  <dir>/arrays/positions.bin    [B] int32, each sequence's logical next position (RoPE continues there)
  <dir>/manifest.json           written last: format and version, package version, the model's identity (name, config
                                hash, parameter fingerprint), the tokenizer's hash, the model's dtype, the layout (tpu
                                or gpu, hd64, page size, KV heads, head dim, layers), each array's shape, dtype and
                                sha256, and the caller's meta

`load` checks, in order: a manifest exists (CacheCorruptError), its format and version (CacheFormatError), the model,
tokenizer and dtype (CacheMismatchError, cache_io.check_model), then each array's size and checksum
(CacheCorruptError).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvzip_jax import dtypes
from kvzip_jax.cache_io import CacheCorruptError, CacheFormatError, CacheMismatchError, check_model, read_json
from kvzip_jax.serving.pages import LAYOUTS, PagedExport
from kvzip_jax.weights.checkpoint import atomic_dir
from kvzip_jax.weights.identity import model_identity, package_version, tokenizer_hash

FORMAT, VERSION = "kvzip-jax-paged", 1
ARRAYS, MANIFEST = "arrays", "manifest.json"
TABLES = ("page_indices", "kv_lens", "positions")

__all__ = ["CacheCorruptError", "CacheFormatError", "CacheMismatchError", "load", "read_manifest", "save"]


def save(directory: str | Path, export: PagedExport, model, meta: dict | None = None, overwrite: bool = False) -> Path:
    """Writes export (made from a cache of `model`, registry.LoadedModel) into `directory`, atomically, its manifest
    last; meta: what the caller knows of how it was made (JSON-able). Returns the folder."""
    if len(export.pages) != model.cfg.num_layers:
        raise CacheMismatchError(f"an export of {len(export.pages)} layers for a model of {model.cfg.num_layers}")
    arrays = {**{f"pages.{i}": p for i, p in enumerate(export.pages)}, **{n: getattr(export, n) for n in TABLES}}
    host = {name: np.ascontiguousarray(np.asarray(x)) for name, x in arrays.items()}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "kvzip_jax": package_version("kvzip-jax"),
        "model": {"name": model.name, **model_identity(model.cfg, model.params)},
        "tokenizer": tokenizer_hash(model.tokenizer),
        "dtype": np.dtype(dtypes.of_params(model.params)).name,
        "layout": export.layout,
        "hd64": export.hd64,
        "page_size": export.page_size,
        "num_kv_heads": export.num_kv_heads,
        "head_dim": export.head_dim,
        "num_layers": len(export.pages),
        "arrays": {
            name: {"shape": list(x.shape), "dtype": x.dtype.name, "sha256": hashlib.sha256(x.tobytes()).hexdigest()}
            for name, x in host.items()
        },
        "meta": meta or {},
    }
    with atomic_dir(directory, overwrite) as tmp:
        (tmp / ARRAYS).mkdir()
        for name, x in host.items():
            (tmp / ARRAYS / f"{name}.bin").write_bytes(x.tobytes())
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return Path(directory)


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a saved export, its format and version checked (nothing else read)."""
    path, manifest = read_json(directory, "saved paged export")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CacheFormatError(f"{path} is not a {FORMAT} manifest (format {found!r}; a saved cache loads with ask)")
    version = manifest.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CacheFormatError(
            f"{directory} has paged export version {version}; this kvzip-jax ({package_version('kvzip-jax')}) reads "
            f"up to {VERSION}: upgrade kvzip-jax"
        )
    if manifest.get("layout") not in LAYOUTS:
        raise CacheFormatError(f"{path}: unknown layout {manifest.get('layout')!r}")
    return manifest


def load(directory: str | Path, model) -> tuple[PagedExport, dict]:
    """(export, manifest) from a folder written by save, for `model`; raises a CacheFileError subclass on anything
    that does not match (module docstring) before any array is used."""
    directory = Path(directory).absolute()
    manifest = read_manifest(directory)
    check_model(manifest, model)
    arrays = {}
    for name, spec in manifest["arrays"].items():
        path = directory / ARRAYS / f"{name}.bin"
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CacheCorruptError(f"cannot read {path} ({type(e).__name__}: {e})") from None
        dtype, shape = jnp.dtype(spec["dtype"]), tuple(spec["shape"])
        if len(data) != dtype.itemsize * int(np.prod(shape)):
            raise CacheCorruptError(f"{path} holds {len(data)} bytes; {shape} {dtype.name} takes another count")
        if hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CacheCorruptError(
                f"{path} does not match its checksum (the files were changed or damaged after saving)"
            )
        arrays[name] = jnp.asarray(np.frombuffer(data, dtype).reshape(shape))
    layers = manifest["num_layers"]
    missing = [n for n in (*TABLES, *(f"pages.{i}" for i in range(layers))) if n not in arrays]
    if missing:
        raise CacheCorruptError(f"{directory / MANIFEST} lists no array {', '.join(missing)}")
    export = PagedExport(
        pages=tuple(arrays[f"pages.{i}"] for i in range(layers)),
        **{name: arrays[name] for name in TABLES},
        page_size=manifest["page_size"],
        layout=manifest["layout"],
        num_kv_heads=manifest["num_kv_heads"],
        head_dim=manifest["head_dim"],
        hd64=manifest["hd64"],
    )
    return export, manifest
