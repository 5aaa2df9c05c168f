"""Sweeps over many processes (`kvzip-jax eval`): the shares of two processes, merged, give one process's summary
byte for byte; a share killed midway and restarted loses and repeats nothing; the merge refuses results of other
settings; a replica over two jax.distributed processes answers as one process does.

Each process is a subprocess with two simulated CPU devices running the CLI on test_eval_sweep's tiny random model
(SmolLM2's tokenizer). The processes share one persistent compilation cache, so only the first compiles.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvzip_jax import cli
from kvzip_jax.errors import EmptyInputError
from kvzip_jax.eval import results, shares
from kvzip_jax.eval.results import RESULTS_VERSION, ResultsFile, SweepMismatchError, record_key
from kvzip_jax.weights import registry
from tests.conftest import simulated_devices_flags, tokenizer_folder

TESTS = Path(__file__).resolve().parent
TIMEOUT = 240  # seconds, per process
SWEEP = ("--methods", "kvzip", "--ratios", "1,0.5", "--batch-size", "2", "--no-progress")
WORKER = textwrap.dedent("""
    import sys
    folder, argv = sys.argv[1], sys.argv[2:]
    sys.path[:0] = [{tests!r}, {root!r}]  # test_eval_sweep, and the tests package it imports from
    from kvzip_jax import cli
    from kvzip_jax.weights import registry, tokenizer

    def tiny(name, dtype="auto"):  # imported late: the test module computes at import, and --distributed must
        from test_eval_sweep import tiny_model  # initialise jax.distributed before the backend starts
        return tiny_model(tokenizer.tokenizer_from_hf(folder))

    registry.load = tiny
    sys.exit(cli.main(argv))
""").format(tests=str(TESTS), root=str(TESTS.parent))


def write_tasks(path) -> None:
    """Four contexts of one length bucket, two of them with two questions."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i, n in enumerate((40, 46, 43, 49)):
            record = {
                "context": " ".join(rng.choice(words, n)) + f". The code is {1000 + i}.",
                "queries": ["What is the code?", "Which word comes first?"][: 1 + i % 2],
                "answers": [["100"], ["alpha"]][: 1 + i % 2],
                "max_new_tokens": 4,
            }
            f.write(json.dumps(record) + "\n")


class Sweeps:
    """Starts `kvzip-jax eval` processes (two CPU devices each) over one task file."""

    def __init__(self, root, tokenizer: str):
        self.root, self.tokenizer, self.tasks = root, tokenizer, root / "toy.jsonl"
        write_tasks(self.tasks)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVZIP_PROCESS_")}
        self.env = {
            **clean,
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(root / "compiled"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }

    def start(self, out: str, *flags: str, devices: int = 2) -> subprocess.Popen:
        argv = ["eval", "--model", "tiny", "--jsonl", str(self.tasks), *SWEEP, "--out", str(self.root / out), *flags]
        env = {**self.env, "XLA_FLAGS": simulated_devices_flags(devices)}
        return subprocess.Popen(
            [sys.executable, "-c", WORKER, self.tokenizer, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def finish(process: subprocess.Popen) -> str:
    """The process's output once it has exited 0 within TIMEOUT (else it is killed and the test fails)."""
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"a sweep process ran past {TIMEOUT} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    return output


def by_key(path) -> dict:
    records = [json.loads(line) for line in open(path)]
    keyed = {record_key(r): r for r in records}
    assert len(keyed) == len(records), f"{path}: an answer written twice"
    return keyed


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """One process sweeps everything (into one/, compiling into the shared cache); then two processes take a share
    each (into two/), the second killed by SIGKILL as soon as it has written records, and restarted.
    -> (the Sweeps, the killed share's file as the kill left it)."""
    runs = Sweeps(tmp_path_factory.mktemp("processes"), str(tokenizer_folder(registry.SMOLLM2)))
    finish(runs.start("one"))
    first = runs.start("two", "--process-index", "0", "--process-count", "2")
    second = runs.start("two", "--process-index", "1", "--process-count", "2")
    share = runs.root / "two" / "results.1-of-2.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not (share.exists() and b"\n" in share.read_bytes()):
        assert second.poll() is None and time.monotonic() < deadline, "the share ended before it could be killed"
        time.sleep(0.02)
    second.send_signal(signal.SIGKILL)
    second.communicate()
    killed = share.read_bytes()
    restarted = runs.start("two", "--process-index", "1", "--process-count", "2")
    finish(first)
    finish(restarted)
    return runs, killed


@pytest.mark.heavy
def test_two_processes_merged_give_the_one_process_summary(sweeps, capsys):
    """The shares split the batches (each context in one share), write no summary, and `--merge` writes one equal
    to one process's byte for byte (the killed and restarted share included)."""
    runs, _ = sweeps
    one, two = runs.root / "one", runs.root / "two"
    shares = [by_key(two / f"results.{i}-of-2.jsonl") for i in range(2)]
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    assert not (two / "summary.md").exists()
    assert cli.main(["eval", "--merge", "--out", str(two)]) == 0
    assert "merged: " in capsys.readouterr().out
    for name in ("summary.md", "summary.csv", "results.jsonl.settings.json"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    merged, alone = by_key(two / "results.jsonl"), by_key(one / "results.jsonl")
    assert set(merged) == set(alone) == set(shares[0]) | set(shares[1])
    for key, record in alone.items():
        assert {k: merged[key][k] for k in ("prediction", "kl", "flip", "config")} == {
            k: record[k] for k in ("prediction", "kl", "flip", "config")
        }, key


@pytest.mark.heavy
def test_a_killed_share_resumes_without_losing_or_repeating_answers(sweeps):
    runs, killed = sweeps
    complete = killed[: killed.rfind(b"\n") + 1]
    final = (runs.root / "two" / "results.1-of-2.jsonl").read_bytes()
    assert final.startswith(complete)  # every answer written before the kill kept, in place
    written_then, written = complete.count(b"\n"), final.count(b"\n")
    assert 0 < written_then < written  # killed midway
    assert len(by_key(runs.root / "two" / "results.1-of-2.jsonl")) == written  # none repeated


@pytest.mark.heavy
def test_a_replica_over_two_distributed_processes_answers_as_one_process(sweeps):
    """--distributed: two processes, one mesh over their four devices, every batch run in lockstep; process 0 alone
    writes the results and the summary, whose answers equal those of the fixture's one process on two devices (KL to
    1e-5: the last float bits move with how the rows are spread over devices; no third process with four devices)."""
    runs, _ = sweeps
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    processes = [
        runs.start(
            "dist",
            "--distributed",
            "--coordinator",
            f"localhost:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
        )
        for i in range(2)
    ]
    outputs = []
    for process in processes:
        try:
            outputs.append(process.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            process.kill()
            outputs.append(process.communicate()[0])
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    dist = runs.root / "dist"
    assert sorted(p.name for p in dist.iterdir()) == [
        "results.jsonl",
        "results.jsonl.settings.json",
        "scores.png",
        "summary.csv",
        "summary.md",
    ]
    replica, alone = by_key(dist / "results.jsonl"), by_key(runs.root / "one" / "results.jsonl")
    assert set(replica) == set(alone)
    for key, record in alone.items():
        assert replica[key]["prediction"] == record["prediction"], key
        assert replica[key]["kl"] == pytest.approx(record["kl"], abs=1e-5), key


def _records(settings: dict, examples=("toy-0", "toy-1"), example_hash="h") -> list[dict]:
    """Full-cache records of a sweep of these settings, one per example."""
    return [
        dict(
            config=results.fingerprint(settings),
            example_hash=example_hash,
            model="tiny",
            task="toy",
            example=example,
            question=0,
            method="full",
            mode="full",
            ratio=1.0,
            prediction="100",
            references=["100"],
            metric="contains",
            score=1.0,
            agree=True,
            kl=0.0,
            flip=0.0,
            seconds=0.1,
        )
        for example in examples
    ]


def test_the_merge_refuses_results_of_other_settings(tmp_path, capsys):
    settings = dict(version=RESULTS_VERSION, model="tiny", instruction=None, chunk_size=64, seed=0)
    for i, examples in enumerate((("toy-0", "toy-1"), ("toy-1", "toy-2"))):  # toy-1 answered by both
        ResultsFile(tmp_path / "sweep" / results.results_name(i, 2), settings).append(_records(settings, examples))
    written = results.merge(tmp_path / "sweep")
    assert [r["example"] for r in map(json.loads, written.read_text().splitlines())] == ["toy-0", "toy-1", "toy-2"]

    newer = {**settings, "version": RESULTS_VERSION + 1}
    ResultsFile(tmp_path / "mixed" / results.results_name(0, 2), settings).append(_records(settings))
    ResultsFile(tmp_path / "mixed" / results.results_name(1, 2), newer).append(_records(newer))
    with pytest.raises(
        SweepMismatchError,
        match=r"results\.1-of-2\.jsonl holds the results of other sweep settings"
        r".*version",
    ):
        results.merge(tmp_path / "mixed")
    assert cli.main(["eval", "--merge", "--out", str(tmp_path / "mixed")]) == cli.EXIT_USER_ERROR
    assert "other sweep settings" in capsys.readouterr().err
    assert not (tmp_path / "mixed" / "results.jsonl").exists() and not (tmp_path / "mixed" / "summary.md").exists()

    ResultsFile(tmp_path / "other" / results.results_name(0, 2), settings).append(_records(settings))
    ResultsFile(tmp_path / "other" / results.results_name(1, 2), settings).append(_records(settings, example_hash="g"))
    with pytest.raises(SweepMismatchError, match="different examples under toy/toy-0"):
        results.merge(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyInputError, match="no results files"):
        results.merge(tmp_path / "empty")


def test_the_process_share_comes_from_the_flags_then_the_environment(monkeypatch, capsys):
    assert shares.process_share(1, 3, environ={}) == (1, 3)
    assert shares.process_share(environ={"KVZIP_PROCESS_INDEX": "2", "KVZIP_PROCESS_COUNT": "4"}) == (2, 4)
    assert shares.process_share(environ={}) == (0, 1)  # jax.distributed not initialised: one process
    assert shares.share_of(list(range(7)), 1, 3) == [1, 4]
    for index, count, environ in [
        (2, 2, {}),
        (-1, 2, {}),
        (1, None, {}),
        (None, None, {"KVZIP_PROCESS_INDEX": "1"}),
        (None, None, {"KVZIP_PROCESS_INDEX": "a", "KVZIP_PROCESS_COUNT": "2"}),
    ]:
        with pytest.raises(shares.ProcessShareError):
            shares.process_share(index, count, environ)
    monkeypatch.setattr(registry, "load", lambda name, dtype="auto": pytest.fail("the model was loaded"))
    for flags, fragment in [
        (["--process-index", "2", "--process-count", "2"], "not in [0, 2)"),
        (["--distributed", "--process-count", "2"], "no --process-index"),
        (["--coordinator", "localhost:1234"], "go together"),
        ([], "--model is required"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["eval", *([] if not flags else ["--model", "tiny"]), "--tasks", "passkey", *flags])
        assert exit_info.value.code == cli.EXIT_USER_ERROR
        assert fragment in capsys.readouterr().err


def test_importing_kvzip_jax_starts_no_backend():
    """--distributed must call jax.distributed.initialize before the XLA backend starts: no module computes at
    import (the CPU device count can still be changed afterwards, which jax refuses once a backend is up)."""
    code = (
        "import kvzip_jax, kvzip_jax.cli, kvzip_jax.eval.sweep, kvzip_jax.demo, jax\n"
        "jax.config.update('jax_num_cpu_devices', 3)\n"
        "assert jax.device_count() == 3, jax.devices()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
