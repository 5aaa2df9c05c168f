"""Tokenizers (transformers) for HF folders and GGUF files; the chat template travels with them."""

from __future__ import annotations

from pathlib import Path

from kvzip_jax.errors import ModelFileError


def tokenizer_from_hf(folder: str | Path):
    """AutoTokenizer of an HF folder (or of a converted checkpoint's tokenizer/ folder)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFileError(f"tokenizer folder not found: {folder}")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot load a tokenizer from {folder} ({e})") from None


def tokenizer_from_gguf(path: str | Path):
    """The tokenizer stored in a GGUF file's metadata (vocab, merges, special tokens, chat template).

    transformers' GGUF reader needs torch installed, even for the tokenizer alone.
    """
    import importlib.util

    from transformers import AutoTokenizer

    if importlib.util.find_spec("torch") is None:
        raise ModelFileError(
            "reading a GGUF's tokenizer needs torch (transformers' GGUF reader): pip install 'kvzip-jax[convert]'"
        )

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot load the tokenizer of {path} ({e})") from None
