"""Shared fixtures: paths of the three bundled GGUF models (skipped with the install command if absent), their
tokenizers, and jax's compilation caches cleared between test modules before the process runs out of memory maps.

Qwen and Gemma ship in parts; they are assembled once into <checkpoints>/_gguf/ ($KVZIP_CHECKPOINTS, else the
repository's git-ignored checkpoints/ folder) and reused by later sessions.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import jax
import pytest

from kvzip_jax.weights import registry
from kvzip_jax.weights.tokenizer import tokenizer_from_gguf, tokenizer_from_hf

REPO_CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a 0.3-0.5B model through transformers (about a minute)")
    config.addinivalue_line("markers", "quality48: the 48-question quality bar (minutes; `make test-quality`, not in "
                            "`make test`)")
    config.addinivalue_line("markers", "extended: a slow check whose behaviour the default run covers through another "
                            "test (`make test-all`, not in `make test`)")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops every compiled program after a test module once the process holds half the kernel's memory maps. XLA
    CPU maps each executable's code into its own memory regions; one process running the whole suite otherwise
    reaches vm.max_map_count (65,530) and LLVM segfaults inside a later compilation. Clearing only then keeps the
    programs that modules share (the bundled models' prefill and decode) compiled most of the time."""
    yield
    if _memory_maps() > _map_limit() // 2:
        jax.clear_caches()
        gc.collect()


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


def simulated_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess on `devices` simulated CPU devices, keeping this run's own flags (make test's -O0)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def _checkpoints_dir() -> Path:
    return Path(os.environ.get("KVZIP_CHECKPOINTS") or REPO_CHECKPOINTS)


def _bundled_gguf(name: str) -> Path:
    absent = [p for p in registry.PACKAGES[name] if importlib.util.find_spec(p) is None]
    if absent:
        pytest.skip(f"bundled model {name} not installed ({', '.join(absent)}): {registry.install_command(name)}")
    return registry.bundled_gguf(name, _checkpoints_dir())


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (llama architecture)."""
    return _bundled_gguf(registry.SMOLLM2)


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2 architecture)."""
    return _bundled_gguf(registry.QWEN)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M base, Q4_K_M (gemma3 architecture)."""
    return _bundled_gguf(registry.GEMMA)


def tokenizer_folder(name: str) -> Path:
    """<checkpoints>/_tokenizers/<name>/: a bundled model's tokenizer as tokenizer_from_gguf reads it, saved once
    (atomically, under a lock the test workers share). transformers' GGUF reader takes 9-24 s per load on 2 cores,
    the saved copy about a second; test_weights checks that a saved GGUF tokenizer tokenizes and templates as the
    GGUF's own."""
    folder = _checkpoints_dir() / "_tokenizers" / name
    if not folder.is_dir():
        gguf = _bundled_gguf(name)
        with registry.folder_lock(folder):
            if not folder.is_dir():
                partial = folder.with_name(f".{name}.tmp-{os.getpid()}")
                tokenizer_from_gguf(gguf).save_pretrained(partial)
                partial.rename(folder)
    return folder


def bundled_tokenizer(name: str):
    """The tokenizer of a bundled model (tokenizer_folder's saved copy of its GGUF's)."""
    return tokenizer_from_hf(tokenizer_folder(name))
