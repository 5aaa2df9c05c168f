"""Training data of the trained scorers, kept in one folder and built resumably:

  texts.jsonl      the model's own writing, one {"prompt", "text"} a line: texts no evaluation uses (not the bundled
                   documents, the generated tasks' or RULER's haystacks), sampled from writing prompts on fixed
                   topics; lines are appended as texts are written, so a rerun goes on from the last one
  prompts.json     {"prompt_set": "prose" | "mixed"}: the prompts the texts answer (writing_prompts; a folder
                   written before it existed holds prose)
  features/NNNNN.npz  per text: `positions` [M] sampled context columns, `hidden` [L, M, D] float16 (the normed
                   attention input at them), `kvzip` and `kvzip_plus` [L, K, n] float32 (KVzip's and KVzip+'s scores
                   of every context pair); written atomically, one file a text, skipped when present

Einsum legend: L layers, M sampled tokens, n context columns, K KV heads, D model width.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np

from kvzip_jax.errors import KvzipError

TOPICS = (
    "the history of bridges",
    "how bees find flowers",
    "a village bakery",
    "tides and the moon",
    "the first railways",
    "learning a second language",
    "volcanoes",
    "a lighthouse keeper",
    "how compilers work",
    "the water cycle",
    "chess openings",
    "a city market at dawn",
    "the invention of paper",
    "migrating birds",
    "a small software team",
    "glaciers",
    "the printing press",
    "a night train journey",
    "photosynthesis",
    "the rules of a board game the writer invents",
    "a museum of clocks",
    "deep sea creatures",
    "a family recipe",
    "how vaccines are tested",
    "an old map",
    "the economics of a fishing town",
    "building a wooden boat",
    "a mountain rescue",
    "the life of a star",
    "a library that never closes",
)
STYLES = ("an essay", "a short story", "a detailed explanation", "a dialogue between two people", "a guide", "a report")
RECORDS = (  # documents dense in identifiers and numbers, which prose seldom holds
    "an inventory with a serial code of letters and digits for every item",
    "a server log with timestamps, request ids and status codes",
    "a table of measurements with sample ids and values to three decimals",
    "a contact list with phone numbers, account numbers and postcodes",
    "a configuration file with keys, hexadecimal tokens, paths and port numbers",
    "a shipping manifest with tracking numbers, weights and dates",
)
PROMPT_SETS = ("prose", "mixed")  # mixed: prose and records taking turns


class ScorerDataError(KvzipError, ValueError):
    """A training-data folder that cannot be used (unreadable lines, a feature file of another shape)."""


def writing_prompts(count: int, prompt_set: str = "prose") -> list[str]:
    """`count` prompts in a fixed order: prose, every (style, topic) pair, then again; mixed, those prose prompts
    and the (record, topic) pairs taking turns."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt_set must be one of {PROMPT_SETS}, got {prompt_set!r}")
    prose = (f"Write {style} about {topic}. Use at least 800 words." for topic in TOPICS for style in STYLES)
    records = (f"Write {record} about {topic}, with at least 60 entries." for topic in TOPICS for record in RECORDS)
    order = prose if prompt_set == "prose" else itertools.chain.from_iterable(zip(prose, records))
    return list(itertools.islice(itertools.cycle(list(order)), count))


def folder_of(source: str | os.PathLike) -> Path:
    """The data folder a path names: the folder itself, or the folder of its texts.jsonl."""
    source = Path(source)
    if source.is_file() and source.name != "texts.jsonl":
        raise ScorerDataError(f"{source}: not a data folder's texts.jsonl")
    return source if source.is_dir() else source.parent


def prompt_set_of(folder: str | os.PathLike) -> str:
    """The prompt set a data folder's texts come from (prompts.json; a folder without one holds prose)."""
    path = Path(folder) / "prompts.json"
    return json.loads(path.read_text())["prompt_set"] if path.exists() else "prose"


def check_prompt_set(folder: str | os.PathLike, prompt_set: str) -> None:
    """Raises ScorerDataError when the folder holds texts of another prompt set; records the set in a folder
    without texts."""
    if read_texts(folder):
        if (held := prompt_set_of(folder)) != prompt_set:
            raise ScorerDataError(f"{folder} holds texts of the {held} prompts, not {prompt_set}: give another --data")
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "prompts.json").write_text(json.dumps({"prompt_set": prompt_set}))


def read_texts(folder: str | os.PathLike) -> list[dict]:
    """texts.jsonl's records (none when absent); a broken last line (an interrupted write) is dropped."""
    path = Path(folder) / "texts.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):
                break
            raise ScorerDataError(f"{path} line {number}: not JSON") from None
    return records


def append_text(folder: str | os.PathLike, prompt: str, text: str) -> None:
    """Appends one text to texts.jsonl (flushed line by line)."""
    path = Path(folder) / "texts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": prompt, "text": text}) + "\n")


def feature_path(folder: str | os.PathLike, index: int) -> Path:
    return Path(folder) / "features" / f"{index:05d}.npz"


def save_features(path: Path, **arrays) -> None:
    """Writes the arrays to path atomically (a temporary sibling renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.tmp-{os.getpid()}.npz")
    np.savez(partial, **arrays)
    os.replace(partial, path)


def load_features(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {name: data[name] for name in data.files}


def sampled_positions(context_len: int, count: int, seed: int) -> np.ndarray:
    """[min(count, context_len)] sorted context columns drawn without replacement (seeded per text)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(context_len, size=min(count, context_len), replace=False)).astype(np.int32)


def training_arrays(
    folder: str | os.PathLike, indices, target: str, floor: float = 1e-12
) -> tuple[np.ndarray, np.ndarray]:
    """(x [L, N, D] float32, y [L, N, K] float32) of the sampled tokens of the texts at `indices`: target "kvzip"
    (scores in [0, 1]) or "log_kvzip_plus" (log of KVzip+ scores, floored at `floor`)."""
    xs, ys = [], []
    for index in indices:
        features = load_features(feature_path(folder, index))
        positions = features["positions"]
        if target == "kvzip":
            y = features["kvzip"][:, :, positions]  # [L, K, M]
        elif target == "log_kvzip_plus":
            y = np.log(np.maximum(features["kvzip_plus"][:, :, positions], floor))
        else:
            raise ValueError(f"target must be kvzip or log_kvzip_plus, got {target!r}")
        xs.append(features["hidden"].astype(np.float32))  # [L, M, D]
        ys.append(y.transpose(0, 2, 1))  # [L, M, K]
    return np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)


def top_overlap(predicted: np.ndarray, reference: np.ndarray, keep: float = 0.3) -> float:
    """Share of the reference's top `keep` pairs (over every layer, head and column) the prediction keeps too."""
    budget = max(1, int(keep * reference.size))
    top = lambda s: set(np.argsort(-s.ravel(), kind="stable")[:budget].tolist())
    return len(top(predicted) & top(reference)) / budget
