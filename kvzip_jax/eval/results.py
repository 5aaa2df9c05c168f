"""A sweep's results file: one JSON object per answer, appended atomically, so an interrupted sweep resumes, and
never into the records of another sweep.

Each batch of records goes out in one write followed by fsync. A write cut off by a kill leaves at most a partial
last line; opening the file again cuts that line off, so later appends start on a clean line and nothing finished
is lost or redone.

A sweep's settings (what changes an answer: the model's and tokenizer's identity, the prompt, scoring options,
RESULTS_VERSION)
are written beside the file (<file>.settings.json) when it is created, and every record carries their fingerprint
and a hash of its example. Opening the file with other settings, or meeting an example that changed under the same
id, raises SweepMismatchError: results of two configurations are never merged. The grid (methods, modes, ratios)
and the batching may grow or change between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from kvzip_jax.errors import KvzipError

KEY_FIELDS = ("task", "example", "method", "mode", "ratio", "question")
RESULTS_VERSION = 3  # 2: one answer path for every cache, published H2O and PyramidKV, per-head floors; 3: tokenizer


class SweepMismatchError(KvzipError):
    """A results file holds records of other sweep settings, another model or other examples."""


def record_key(record: dict) -> tuple:
    """What identifies one answer of a sweep."""
    return tuple(record[field] for field in KEY_FIELDS)


def fingerprint(settings: dict) -> str:
    """16 hex digits of a JSON-able dict (sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class ResultsFile:
    """Appends records to a JSONL file and knows which keys, and which example hashes, it already holds.

    settings: the sweep's settings (module docstring); None opens the file without any check (reports, tests)."""

    def __init__(self, path: str | Path, settings: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.settings_path = self.path.with_name(self.path.name + ".settings.json")
        self.fingerprint = None if settings is None else fingerprint(settings)
        self.done: set[tuple] = set()
        self.examples: dict[tuple[str, str], str] = {}  # (task, example id) -> example hash
        if settings is not None:
            self._check_settings(settings)
        if self.path.exists():
            self._repair_and_read()

    def _check_settings(self, settings: dict) -> None:
        if not self.settings_path.exists():
            if self.path.exists() and self.path.stat().st_size:
                raise SweepMismatchError(f"{self.path} holds records without a settings file (written by an earlier "
                                         f"kvzip-jax): write this sweep to another folder")
            _write_json_atomically(self.settings_path, settings)
            return
        try:
            stored = json.loads(self.settings_path.read_text())
        except ValueError as e:
            raise SweepMismatchError(f"{self.settings_path}: unreadable settings ({e})") from None
        if stored != settings:
            differ = sorted(k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k))
            listed = "; ".join(f"{k}: {stored.get(k)!r} there, {settings.get(k)!r} now" for k in differ)
            raise SweepMismatchError(f"{self.path} holds the results of other sweep settings ({listed}): write this "
                                     f"sweep to another folder, or remove that one")

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]  # drop a partial last line (an interrupted write)
        if len(complete) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        for number, line in enumerate(complete.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                    key = record_key(record)
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{self.path}:{number}: not a sweep record ({e})") from None
                if self.fingerprint is not None and record.get("config") != self.fingerprint:
                    raise SweepMismatchError(f"{self.path}:{number}: a record of other sweep settings (fingerprint "
                                             f"{record.get('config')}, not {self.fingerprint})")
                self.done.add(key)
                if "example_hash" in record:
                    self.examples[record["task"], record["example"]] = record["example_hash"]

    def check_example(self, task: str, example: str, example_hash: str) -> None:
        """Raises SweepMismatchError if the file holds answers to another example under the same task and id."""
        held = self.examples.get((task, example))
        if held is not None and held != example_hash:
            raise SweepMismatchError(f"{self.path} holds answers to another example {task}/{example} (its context, "
                                     f"questions or answers differ: another --seed, --context-tokens or JSONL "
                                     f"file?): write this sweep to another folder")

    def append(self, records: list[dict]) -> None:
        """Writes records in one write + fsync and marks their keys done."""
        if not records:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        for r in records:
            self.done.add(record_key(r))
            if "example_hash" in r:
                self.examples[r["task"], r["example"]] = r["example_hash"]


def _write_json_atomically(path: Path, payload) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
