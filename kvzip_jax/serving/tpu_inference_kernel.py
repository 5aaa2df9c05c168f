"""The engine's own reference attention: tpu-inference's ragged paged attention references (pure jnp), loaded by file
from the installed wheel without importing its package (whose __init__ imports vllm).

Einsum legend: B batch, T new tokens per sequence, N query heads, K KV heads, H head dim.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import types
import zipfile
from pathlib import Path

import jax
import numpy as np

from kvzip_jax.errors import KvzipError
from kvzip_jax.serving.pages import PagedExport

WHEEL = "tpu_inference-0.32.0-py3-none-any.whl"
PIP = f"pip download --no-deps --ignore-requires-python tpu-inference==0.32.0 -d {Path(sys.prefix) / 'wheels'}"


def wheel_dirs() -> list[Path]:
    """Where the wheel is looked for: $KVZIP_WHEELS, then <the Python environment>/wheels (make's download)."""
    given = os.environ.get("KVZIP_WHEELS")
    return ([Path(given)] if given else []) + [Path(sys.prefix) / "wheels"]


PACKAGE = "tpu_inference.kernels.ragged_paged_attention.v3"


class EngineKernelMissingError(KvzipError):
    """tpu-inference's kernel files are not installed."""


@functools.cache
def load(hd64: bool = False) -> types.ModuleType:
    """tpu-inference's kernel module: kernel.py, or kernel_hd64.py (head dim 64)."""
    name = "kernel_hd64" if hd64 else "kernel"
    real = sys.modules.get("tpu_inference")
    if real is not None and getattr(real, "__file__", None):  # the real package is imported (vllm is there)
        return importlib.import_module(f"{PACKAGE}.{name}")
    folder = _folder()
    with _stubbed_parents(folder):
        _from_file("util", folder)
        if hd64:  # its tuned block sizes import the engine's logger (vllm); only the Pallas kernel reads them
            _stub_module(f"{PACKAGE}.tuned_block_sizes_hd64", get_tuned_block_sizes=_no_tuning)
        return _from_file(name, folder)


def ragged_paged_attention_ref(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    hd64: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The wheel's ref_ragged_paged_attention (or its hd64 variant; None: when the head dim is 64, as the engine
    chooses): (out [tokens, N, H], the pages with the new keys and values written). queries [tokens, N, H]; keys,
    values [tokens, K, H]; kv_cache the tpu pages; kv_lens [max_num_seqs] (new tokens included); page_indices
    [max_num_seqs pps]; cu_q_lens [max_num_seqs + 1]; distribution [3]. Runs eagerly (it loops over sequences)."""
    hd64 = queries.shape[-1] == 64 if hd64 is None else hd64
    module = load(hd64)
    ref = module.ref_ragged_paged_attention_hd64 if hd64 else module.ref_ragged_paged_attention
    args = (queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution)
    return ref(*args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


@functools.partial(jax.jit, static_argnames=("schedule", "sm_scale", "sliding_window", "soft_cap", "hd64"))
def scheduled_ref(
    queries, keys, values, kv_cache, *, schedule, sm_scale, sliding_window=None, soft_cap=None, hd64=None
) -> tuple[jax.Array, jax.Array]:
    """ragged_paged_attention_ref with the batch's schedule (kv_lens, page_indices, cu_q_lens, distribution, as
    tuples of ints) fixed: the reference reads them as Python values (its loop over sequences, its slices and its
    input checks), so it traces with them as constants and compiles once per schedule; every layer of a step shares
    one program."""
    kv_lens, page_indices, cu_q_lens, distribution = (np.asarray(x, np.int32) for x in schedule)
    args = (queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution)
    return ragged_paged_attention_ref(
        *args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, hd64=hd64
    )


def attend_export(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    export: PagedExport,
    layer: int,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The wheel's reference over a tpu export's layer for one step of T new tokens per sequence: q [B, T, N, H],
    k_new, v_new [B, T, K, H] -> (out [B, T, N, H], the layer's pages with the new tokens written at slots
    kv_lens + t). The batch goes as the runner sends it: kv_lens + T per sequence, decode-only distribution
    [B, B, B] for T = 1, else [0, 0, B] (mixed); through scheduled_ref (the export's tables must be concrete)."""
    if export.layout != "tpu":
        raise ValueError(f"attend_export takes a tpu export, got layout {export.layout!r}")
    B, T, N, H = q.shape
    K = k_new.shape[2]
    dtype = export.pages[layer].dtype
    schedule = (
        tuple(int(n) + T for n in np.asarray(export.kv_lens)),
        tuple(int(i) for i in np.asarray(export.flat_page_indices)),
        tuple(range(0, (B + 1) * T, T)),
        (B, B, B) if T == 1 else (0, 0, B),
    )
    out, pages = scheduled_ref(
        q.reshape(B * T, N, H),
        k_new.reshape(B * T, K, H).astype(dtype),
        v_new.reshape(B * T, K, H).astype(dtype),
        export.pages[layer],
        schedule=schedule,
        sm_scale=scale,
        sliding_window=window,
        soft_cap=soft_cap,
        hd64=export.hd64,
    )
    return out.reshape(B, T, N, H), pages


def _folder() -> Path:
    """The kernel folder: read out of the downloaded wheel (wheel_dirs, never installed: the wheel also installs
    top-level `tests` and `tools` packages) into a folder beside it, once; or an installed package's, found without
    running its __init__."""
    missing = lambda why: EngineKernelMissingError(
        f"tpu-inference's ragged paged attention kernel is not available ({why}); download its wheel: {PIP}"
    )
    for wheel in (w for d in wheel_dirs() for w in sorted(Path(d).glob(WHEEL))):
        folder = wheel.with_suffix("") / Path(*PACKAGE.split("."))
        if not (folder / "kernel.py").is_file():
            with zipfile.ZipFile(wheel) as archive:
                members = [m for m in archive.namelist() if m.startswith(PACKAGE.replace(".", "/") + "/")]
                archive.extractall(wheel.with_suffix(""), members)
        return folder
    try:
        spec = importlib.util.find_spec("tpu_inference")
    except (ImportError, ValueError) as e:
        raise missing(str(e)) from e
    if spec is None or not spec.submodule_search_locations:
        raise missing(f"no {WHEEL} in {', '.join(map(str, wheel_dirs()))} and no package tpu_inference")
    folder = Path(list(spec.submodule_search_locations)[0], *PACKAGE.split(".")[1:])
    if not (folder / "kernel.py").is_file():
        raise missing(f"no {folder / 'kernel.py'}")
    return folder


@contextlib.contextmanager
def _stubbed_parents(folder: Path):
    """Empty packages for tpu_inference and its subpackages down to the kernel folder while its files load, so their
    absolute imports of sibling files resolve; every module entry added is removed afterwards."""
    before = set(sys.modules)
    parts = PACKAGE.split(".")
    for i in range(1, len(parts) + 1):
        module = types.ModuleType(".".join(parts[:i]))
        module.__path__ = [str(folder.parents[len(parts) - i - 1])] if i < len(parts) else [str(folder)]
        sys.modules.setdefault(module.__name__, module)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name == "tpu_inference" or name.startswith("tpu_inference."):
                del sys.modules[name]


def _from_file(name: str, folder: Path) -> types.ModuleType:
    full = f"{PACKAGE}.{name}"
    spec = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


def _stub_module(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _no_tuning(*args, **kwargs):
    raise EngineKernelMissingError(
        "the hd64 Pallas kernel's tuned block sizes were not loaded (they import vllm); only the reference runs here"
    )
