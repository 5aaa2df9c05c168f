"""A sweep's results file: one JSON object per answer, appended atomically, so an interrupted sweep resumes.

Each batch of records goes out in one write followed by fsync. A write cut off by a kill leaves at most a partial
last line; opening the file again cuts that line off, so later appends start on a clean line and nothing finished
is lost or redone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

KEY_FIELDS = ("task", "example", "method", "mode", "ratio", "question")


def record_key(record: dict) -> tuple:
    """What identifies one answer of a sweep."""
    return tuple(record[field] for field in KEY_FIELDS)


class ResultsFile:
    """Appends records to a JSONL file and knows which keys it already holds."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[tuple] = set()
        if self.path.exists():
            self._repair_and_read()

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]  # drop a partial last line (an interrupted write)
        if len(complete) != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        for number, line in enumerate(complete.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    self.done.add(record_key(json.loads(line)))
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{self.path}:{number}: not a sweep record ({e})") from None

    def append(self, records: list[dict]) -> None:
        """Writes records in one write + fsync and marks their keys done."""
        if not records:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.done.update(record_key(r) for r in records)
