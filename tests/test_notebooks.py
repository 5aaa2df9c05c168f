"""The colab/ notebooks, executed on CPU with small inputs (nbclient: the plain Jupyter executor, no extra layer;
each notebook's cell tagged "parameters" is overridden by appending assignments): every one runs top to bottom, its
outputs hold the answers, the highlighted text and the plots, and the committed files carry no outputs."""

import base64
import dataclasses
import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kvzip_jax.models.params import init_params
from kvzip_jax.weights import registry
from kvzip_jax.weights.checkpoint import save_checkpoint
from tests.conftest import bundled_tokenizer, tiny_config

COLAB = Path(__file__).resolve().parents[1] / "colab"
SMALL = {  # notebook -> parameter overrides for a CI run on 2 CPU cores
    "quickstart": {"MAX_NEW_TOKENS": 8, "DOCUMENT_CHARS": 1000},
    "what_was_kept": {"DOCUMENT_CHARS": 1000},
    "sweep": {
        "TASKS": ("passkey",),
        "METHODS": ("kvzip", "streamingllm"),
        "RATIOS": (1.0, 0.3),
        "CONTEXTS": 2,
        "CONTEXT_TOKENS": 150,
    },
}


def test_every_notebook_is_tested_and_committed_without_outputs():
    assert sorted(p.stem for p in COLAB.glob("*.ipynb")) == sorted(SMALL)
    for path in COLAB.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), f"{path.name} has outputs"
        assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1, path.name


def _run(name: str, model_dir: Path, tmp_path: Path) -> list[dict]:
    """Executes colab/<name>.ipynb with the model at model_dir and SMALL[name]; returns every output of every cell."""
    nb = nbformat.read(COLAB / f"{name}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    overrides = {"MODEL": str(model_dir), **SMALL[name]}
    cell.source += "\n# CI overrides\n" + "\n".join(f"{key} = {value!r}" for key, value in overrides.items())
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return [output for c in nb.cells if c.cell_type == "code" for output in c.outputs]


def _text(outputs) -> str:
    return "".join(o.get("text", "") + "".join(o.get("data", {}).get("text/plain", "")) for o in outputs)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer, as a checkpoint folder: the notebooks' plumbing, printouts and
    pictures need no trained model (the CLI tests answer from SmolLM2's compressed caches, tests/test_cli.py)."""
    tokenizer = bundled_tokenizer(registry.SMOLLM2)
    cfg = dataclasses.replace(tiny_config(2), vocab_size=len(tokenizer))
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    return save_checkpoint(path, cfg, init_params(cfg, seed=1, scale=0.15), tokenizer)


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_and_shows_its_results(name, tiny_checkpoint, tmp_path):
    outputs = _run(name, tiny_checkpoint, tmp_path)
    assert not [o for o in outputs if o.output_type == "error"]
    text = _text(outputs)
    pngs = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    assert all(png.startswith(b"\x89PNG") for png in pngs)
    if name == "quickstart":
        questions = json.loads((COLAB.parent / "kvzip_jax" / "data" / "demo_questions.json").read_text())
        for item in questions:  # each question with its full-cache, KVzip and Attention Matching answers
            assert f"Q: {item['question']}" in text
        assert text.count("  full cache  (") == 3 and text.count("  KVzip 0.3   (") == 3
        assert text.count("  am-hak 0.1 (") == 3 and "prefill: " in text
    elif name == "what_was_kept":
        pages = ["".join(o["data"]["text/html"]) for o in outputs if "text/html" in o.get("data", {})]
        assert len(pages) == 2 and all(page.count('<span class="t"') > 100 for page in pages)  # KVzip, SnapKV
        assert len(pngs) == 3  # two kept-share figures and the score histogram
        assert "KVzip and SnapKV agree on" in text
    else:
        assert len(pngs) == 1
        markdown = "".join("".join(o["data"].get("text/markdown", "")) for o in outputs if "data" in o)
        assert "kvzip" in markdown and "streamingllm" in markdown
