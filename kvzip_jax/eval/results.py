"""A sweep's results file: one JSON object per answer, appended atomically, so an interrupted sweep resumes, and
never into the records of another sweep.

Each batch of records goes out in one write followed by fsync. A write cut off by a kill leaves at most a partial
last line; opening the file again cuts that line off, so later appends start on a clean line and nothing finished
is lost or redone.

A sweep's settings (what changes an answer: the model's and tokenizer's identity, the prompt, scoring options,
RESULTS_VERSION) are written beside the file (<file>.settings.json) when it is created, and every record carries
their fingerprint and a hash of its example. Opening the file with other settings, or meeting an example that
changed under the same id, raises SweepMismatchError: results of two configurations are never merged. The grid
(methods, modes, ratios) and the batching may grow or change between runs.

Processes that share a sweep out (shares.share_of) write one file each into the sweep's folder, results.I-of-N.jsonl
(results_name); merge(folder) checks that every file there holds the same settings and joins them, each answer once,
into the folder's results.jsonl: what a one-process sweep writes, which eval.report then summarizes.

A finished results file may be kept compressed (compress(path): <file>.gz written atomically, the plain file
removed; the settings file stays plain, under the plain name). Every reader (read_bytes, ResultsFile, merge,
eval.report) takes a file's records from <file>.gz followed by the plain <file>, either of which may be absent. A sweep
resuming a compressed file appends its new answers to the plain file beside the .gz (the .gz is never rewritten by a
sweep); compress(path) folds them in. An answer in both (what a compress or merge cut off between writing the .gz and
removing the plain file leaves) is read once, from the .gz.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from kvzip_jax.errors import EmptyInputError, KvzipError

KEY_FIELDS = ("task", "example", "method", "mode", "ratio", "question", "kv_bits")  # kv_bits last (key_order)
KEY_DEFAULTS = {"kv_bits": 16}  # records written before the field existed: the model's dtype
RESULTS_NAME = "results.jsonl"  # a one-process sweep's, and the merged one
SHARE_NAME = re.compile(r"results\.\d+-of-\d+\.jsonl")  # process I of N's (results_name)
PACKED = ".gz"  # the suffix of a compressed results file (compress)
RESULTS_VERSION = 3  # 2: one answer path for every cache, published H2O and PyramidKV, per-head floors; 3: tokenizer


class SweepMismatchError(KvzipError):
    """A results file holds records of other sweep settings, another model or other examples."""


def record_key(record: dict) -> tuple:
    """What identifies one answer of a sweep."""
    return tuple(
        record[field] if field not in KEY_DEFAULTS else record.get(field, KEY_DEFAULTS[field]) for field in KEY_FIELDS
    )


def key_order(key: tuple) -> tuple:
    """A record_key as it sorts: kv_bits, an int or "8/4", as text."""
    return key[:-1] + (str(key[-1]),)


def record_order(record: dict) -> tuple:
    """The order of records in a merged file and a report."""
    return key_order(record_key(record))


def fingerprint(settings: dict) -> str:
    """16 hex digits of a JSON-able dict (sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def results_name(index: int = 0, count: int = 1) -> str:
    """The results file of process index of count: results.jsonl for one process, else results.I-of-N.jsonl."""
    return RESULTS_NAME if count == 1 else f"results.{index}-of-{count}.jsonl"


def plain_path(path: str | os.PathLike) -> Path:
    """A results file's plain name: path without a trailing .gz."""
    path = Path(path)
    return path.with_name(path.name[: -len(PACKED)]) if path.name.endswith(PACKED) else path


def packed_path(path: str | os.PathLike) -> Path:
    """A results file's compressed form: <file>.gz (module docstring)."""
    path = plain_path(path)
    return path.with_name(path.name + PACKED)


def settings_path(path: str | os.PathLike) -> Path:
    """Where the settings of a results file (plain or compressed) are kept: <file>.settings.json beside it."""
    path = plain_path(path)
    return path.with_name(path.name + ".settings.json")


def stored_settings(path: str | os.PathLike) -> dict | None:
    """The settings written beside a results file; None where there are none (yet)."""
    return _read_settings(plain_path(path)) if settings_path(path).exists() else None


def exists(path: str | os.PathLike) -> bool:
    """Whether a results file exists in either form (plain, .gz)."""
    return plain_path(path).exists() or packed_path(path).exists()


def read_bytes(path: str | os.PathLike) -> bytes:
    """The lines of a results file in either form, path plain or .gz (module docstring): the .gz's, then the plain
    file's as they are (a partial last line included) but for the answers the .gz already holds. Raises
    FileNotFoundError when neither form exists."""
    plain, packed = plain_path(path), packed_path(path)
    if not packed.exists():
        return plain.read_bytes()
    unpacked = gzip.decompress(packed.read_bytes())
    if unpacked and not unpacked.endswith(b"\n"):
        unpacked += b"\n"
    if not plain.exists():
        return unpacked
    held = {_key_of(line) for line in unpacked.split(b"\n")} - {None}
    lines = plain.read_bytes().split(b"\n")  # the last one empty, or a partial line: kept
    kept = [line for i, line in enumerate(lines) if i == len(lines) - 1 or _key_of(line) not in held]
    return unpacked + b"\n".join(kept)


def _key_of(line: bytes) -> tuple | None:
    """The record_key of a line, None for one that is no record."""
    try:
        return record_key(json.loads(line))
    except (ValueError, KeyError, TypeError):
        return None


def compress(path: str | os.PathLike) -> Path:
    """Folds a finished results file (path plain or .gz) into <file>.gz: its complete lines (read_bytes; a partial
    last line is left out) gzipped, written atomically (a temporary file beside it, fsynced, renamed), then the plain
    file removed; returns the .gz's path. Nothing is removed before the .gz is complete, and a file already only in
    .gz form is left as it is. Run it once no process writes to the file."""
    plain, packed = plain_path(path), packed_path(path)
    if not plain.exists():
        if packed.exists():
            return packed
        raise FileNotFoundError(f"no results file {plain} (nor {packed.name})")
    write_atomically(packed, gzip.compress(_complete(read_bytes(plain)), compresslevel=9, mtime=0))
    plain.unlink()
    return packed


def _complete(data: bytes) -> bytes:
    """data up to its last newline: without the partial last line an interrupted write leaves."""
    return data[: data.rfind(b"\n") + 1]


def _records(path: Path, complete: bytes, config: str | None) -> list[dict]:
    """The records of a file's complete lines; raises SweepMismatchError for one of another fingerprint than
    config (None: no check), ValueError for a line that is no record."""
    records = []
    for number, line in enumerate(complete.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
                record_key(record)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a sweep record ({e})") from None
            if config is not None and record.get("config") != config:
                raise SweepMismatchError(
                    f"{path}:{number}: a record of other sweep settings (fingerprint "
                    f"{record.get('config')}, not {config})"
                )
            records.append(record)
    return records


def _read_settings(path: Path) -> dict:
    where = settings_path(path)
    try:
        return json.loads(where.read_text())
    except FileNotFoundError:
        raise SweepMismatchError(f"{path} has no settings file ({where.name}): not a kvzip-jax sweep's") from None
    except ValueError as e:
        raise SweepMismatchError(f"{where}: unreadable settings ({e})") from None


def _differences(a: dict, b: dict, in_a: str, in_b: str) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return "; ".join(f"{k}: {a.get(k)!r} {in_a}, {b.get(k)!r} {in_b}" for k in keys)


def results_files(folder: str | os.PathLike) -> list[Path]:
    """A sweep folder's results files (results.jsonl and every results.I-of-N.jsonl, each plain, .gz or both) under
    their plain names, sorted by name."""
    names = {plain_path(p).name for p in Path(folder).iterdir()}
    return sorted(Path(folder) / n for n in names if n == RESULTS_NAME or SHARE_NAME.fullmatch(n))


def merged_records(folder: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(settings, records) of every results file of a sweep folder: each answer once (from the first file by name
    that holds it), sorted by record_order. Files are only read: a partial last line (a process still writing, or
    killed) is left out. Raises SweepMismatchError when the files hold other settings (other RESULTS_VERSION, model,
    prompt, ...), a record of another fingerprint, or two examples under one id; EmptyInputError without files."""
    if not Path(folder).is_dir():
        raise EmptyInputError(f"no sweep folder {folder}")
    files = results_files(folder)
    if not files:
        raise EmptyInputError(f"no results files (results.jsonl, results.I-of-N.jsonl, or their .gz) in {folder}")
    settings = _read_settings(files[0])
    config = fingerprint(settings)
    by_key: dict[tuple, dict] = {}
    examples: dict[tuple[str, str], tuple[str, Path]] = {}
    for path in files:
        other = _read_settings(path)
        if other != settings:
            differ = _differences(other, settings, "there", f"in {files[0].name}")
            raise SweepMismatchError(
                f"{path} holds the results of other sweep settings than {files[0].name} "
                f"({differ}): merge only the shares of one sweep"
            )
        for record in _records(path, _complete(read_bytes(path)), config):
            held = examples.setdefault((record["task"], record["example"]), (record.get("example_hash"), path))
            if held[0] != record.get("example_hash"):
                raise SweepMismatchError(
                    f"{path} and {held[1]} hold answers to different examples under "
                    f"{record['task']}/{record['example']}: merge only the shares of one sweep"
                )
            by_key.setdefault(record_key(record), record)
    return settings, [by_key[k] for k in sorted(by_key, key=key_order)]


def merge(folder: str | os.PathLike) -> Path:
    """Joins a sweep folder's results files (merged_records) into its results.jsonl and the settings beside it, each
    written atomically; returns that file's path (its plain name). A folder that holds results.jsonl.gz keeps its
    records compressed: the .gz is rewritten, then a plain results.jsonl removed. Run it once the processes have
    finished (a process still writing to results.jsonl itself would lose what it appends meanwhile)."""
    settings, records = merged_records(folder)
    path = Path(folder) / RESULTS_NAME
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    write_atomically(settings_path(path), json.dumps(settings, indent=1, sort_keys=True))
    if packed_path(path).exists():
        write_atomically(packed_path(path), gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
        path.unlink(missing_ok=True)
    else:
        write_atomically(path, text)
    return path


class ResultsFile:
    """Appends records to a JSONL file and knows which keys, and which example hashes, it already holds.

    settings: the sweep's settings (module docstring); None opens the file without any check (reports, tests).
    write: False for a process that follows the file another process writes (a replica spanning processes, where
    process 0 writes): the file is read and checked but never written, and appends only mark keys done."""

    def __init__(self, path: str | Path, settings: dict | None = None, write: bool = True):
        self.path, self.write = plain_path(path), write  # appends go to the plain file, beside any .gz
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.settings_path = settings_path(self.path)
        self.fingerprint = None if settings is None else fingerprint(settings)
        self.done: set[tuple] = set()
        self.examples: dict[tuple[str, str], str] = {}  # (task, example id) -> example hash
        if settings is not None:
            self._check_settings(settings)
        if exists(self.path):
            self._repair_and_read()

    def _check_settings(self, settings: dict) -> None:
        if not self.settings_path.exists():
            if any(p.exists() and p.stat().st_size for p in (self.path, packed_path(self.path))):
                raise SweepMismatchError(
                    f"{self.path} holds records without a settings file (written by an earlier "
                    f"kvzip-jax): write this sweep to another folder"
                )
            if self.write:
                write_atomically(self.settings_path, json.dumps(settings, indent=1, sort_keys=True))
            return
        try:
            stored = json.loads(self.settings_path.read_text())
        except ValueError as e:
            raise SweepMismatchError(f"{self.settings_path}: unreadable settings ({e})") from None
        if stored != settings:
            raise SweepMismatchError(
                f"{self.path} holds the results of other sweep settings "
                f"({_differences(stored, settings, 'there', 'now')}): write this sweep to "
                f"another folder, or remove that one"
            )

    def _repair_and_read(self) -> None:
        if self.path.exists() and self.write:  # cut off the partial last line of an interrupted write
            data = self.path.read_bytes()
            if len(_complete(data)) != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(len(_complete(data)))
        for record in _records(self.path, _complete(read_bytes(self.path)), self.fingerprint):
            self.done.add(record_key(record))
            if "example_hash" in record:
                self.examples[record["task"], record["example"]] = record["example_hash"]

    def check_example(self, task: str, example: str, example_hash: str) -> None:
        """Raises SweepMismatchError if the file holds answers to another example under the same task and id."""
        held = self.examples.get((task, example))
        if held is not None and held != example_hash:
            raise SweepMismatchError(
                f"{self.path} holds answers to another example {task}/{example} (its context, "
                f"questions or answers differ: another --seed, --context-tokens or JSONL "
                f"file?): write this sweep to another folder"
            )

    def append(self, records: list[dict]) -> None:
        """Writes records in one write + fsync (unless write is False) and marks their keys done."""
        if not records:
            return
        if self.write:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for r in records:
            self.done.add(record_key(r))
            if "example_hash" in r:
                self.examples[r["task"], r["example"]] = r["example_hash"]


def write_atomically(path: Path, data: str | bytes) -> None:
    """data (text, or bytes) into a temporary file beside path, fsynced, then renamed onto path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
