"""Shared fixtures: paths of the three bundled GGUF models (skipped with the install command if absent), their
tokenizers; the markers, real_model set on every test that loads a bundled model's weights (make test-fast leaves
them out); after each test module, freed memory goes back to the system (and jax's compiled programs are dropped
before the process runs out of memory maps); at the end, each process's peak resident memory is printed and, with
--peak-rss-limit-gb (make test: 6), checked.

Qwen and Gemma ship in parts; they are assembled once into <checkpoints>/_gguf/ ($KVZIP_CHECKPOINTS, else the
repository's git-ignored checkpoints/ folder) and reused by later sessions. Before any test, each installed bundled
model not yet converted is converted there, in a subprocess (not when -m leaves out every real_model test).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import pytest

import kvzip_jax.weights.gguf
from kvzip_jax.config import ModelConfig, RopeSpec
from kvzip_jax.eval.host_memory import release_freed
from kvzip_jax.weights import registry
from kvzip_jax.weights.checkpoint import is_checkpoint
from kvzip_jax.weights.tokenizer import tokenizer_from_gguf, tokenizer_from_hf

REPO_CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
CLEAR_PROGRAMS_ABOVE = 2 * 10**9  # resident bytes after a module above which jax's compiled programs are dropped
TRIM_ABOVE = 2 * 10**9  # resident bytes after a test above which freed memory is handed back before the next test...
TRIM_GROWTH = 5 * 10**8  # ...if the process grew by this much since the last hand-back (each costs about half a second)
_AFTER_TRIM = [0]  # resident bytes after the last hand-back


def pytest_addoption(parser):
    parser.addoption(
        "--peak-rss-limit-gb",
        type=float,
        default=0.0,
        help="fail the run if a test process's peak resident memory exceeds this many GB (0: only print "
        "the peaks); make test: 6, so two workers and the tests' subprocesses fit in 24 GB",
    )


def _limit(config) -> float:
    """The peak resident bytes a test process may reach (inf: no limit)."""
    gb = config.getoption("peak_rss_limit_gb")
    return gb * 1e9 if gb > 0 else float("inf")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a 0.3-0.5B model through transformers (about a minute)")
    config.addinivalue_line(
        "markers", "quality48: the 48-question quality bar (minutes; `make test-quality`, not in `make test`)"
    )
    config.addinivalue_line(
        "markers",
        "extended: a slow check whose behaviour the default run covers through another "
        "test (`make test-all`, not in `make test`)",
    )
    config.addinivalue_line(
        "markers",
        "heavy: a tiny-model check of several seconds whose path a quicker test of `make test-fast` also walks "
        "(an end-to-end run, a subprocess mesh, a notebook, or another case of a grid); in `make test`, "
        "not in `make test-fast`",
    )
    config.addinivalue_line(
        "markers",
        "real_model: loads a bundled model's weights or reads its weight files (set "
        "by conftest on every test using a REAL_MODEL_FIXTURES fixture; `make test-fast` leaves "
        "these out)",
    )
    if not hasattr(config, "workerinput") and _may_select_real_model_tests(config.option.markexpr):
        _convert_bundled_models()  # the controller, or a run without workers: before any test process starts


# The fixtures that hand a test a bundled model's GGUF (every real checkpoint, conversion, transformers oracle and
# restored model in tests/ starts from one of them). A test that reaches real weights another way (getfixturevalue,
# a file read directly) carries @pytest.mark.real_model itself. A bundled tokenizer alone (bundled_tokenizer,
# tokenizer_folder) is no real model: it reads the GGUF's vocabulary once per checkout into <checkpoints>/_tokenizers.
REAL_MODEL_FIXTURES = frozenset({"smollm2_gguf", "qwen_gguf", "qwen_large_gguf", "gemma_gguf"})


def _may_select_real_model_tests(markexpr: str) -> bool:
    """False when the -m expression is false for every test marked real_model, whatever its other marks (make
    test-fast's "not real_model and ..."): the bundled models then need no conversion. True when unsure."""
    if not markexpr:
        return True
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(markexpr)
        names = sorted(
            set(re.findall(r"[A-Za-z_][\w.]*", markexpr)) - {"and", "or", "not", "True", "False", "None", "real_model"}
        )
        if len(names) > 12:
            return True
        for values in itertools.product((False, True), repeat=len(names)):
            marks = dict(zip(names, values), real_model=True)
            if expression.evaluate(lambda name, **kwargs: marks.get(name, False)):
                return True
        return False
    except Exception:  # another pytest's internals: convert, as without -m
        return True


# The files whose tests take a minute or more on 2 cores, slowest first: started first, so that the workers end on short
# files and finish together, and each of the heaviest starts in a fresh process (pytest-xdist --dist loadfile hands out
# files in collection order only with --no-loadscope-reorder, as the Makefile runs it; its default is most tests first).
SLOWEST_FILES = (
    "test_parity_real.py",
    "test_kvzip_quality.py",
    "test_eval_sweep.py",
    "test_bfloat16.py",
    "test_cache_io.py",
    "test_model.py",
    "test_compact.py",
    "test_cli.py",
    "test_eval_distributed.py",
    "test_weights.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(item.fixturenames):  # the fixture closure: indirect uses count
            item.add_marker(pytest.mark.real_model)
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its tests' order


def _convert_bundled_models() -> None:
    """Converts each installed bundled model that has no checkpoint yet, each in a subprocess of its own, all at once
    (on 2 cores the three took 72 s together against 102 s one after another: most of a conversion is one thread
    parsing the GGUF's vocabulary). A first conversion holds its model about twice (Qwen: 2.5 GB read, 2.5 GB being
    written by orbax), more than make test's 6 GB limit on top of what a test process already holds, so it runs here,
    before any test process starts, not inside the first test that loads the model."""
    running = {}
    for name in registry.BUNDLED:
        directory = _checkpoints_dir() / name
        if name in registry.ON_DEMAND or is_checkpoint(directory) or not registry.installed(name):
            continue
        print(f"converting the bundled model {name} into {directory} (once)", flush=True)
        running[name] = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from kvzip_jax.weights import registry; registry.converted(sys.argv[1], sys.argv[2])",
                name,
                str(_checkpoints_dir()),
            ]
        )
    failed = [name for name, process in running.items() if process.wait() != 0]
    if failed:
        raise RuntimeError(f"converting the bundled model(s) {', '.join(failed)} failed (their output is above)")


@pytest.fixture(autouse=True)
def _release_freed_after_a_large_test():
    """Hands freed memory back after a test that leaves the process holding more than TRIM_ABOVE bytes, TRIM_GROWTH
    more than after the last hand-back: glibc keeps what a test's models and buffers freed in its arenas, and the next
    test's allocations would land beside it. (Once a process holds a model's compiled programs, it stays above
    TRIM_ABOVE; a hand-back after every small test then cost a quarter of the suite's teardown time for nothing.)"""
    yield
    resident = _resident()
    if resident > TRIM_ABOVE and resident - _AFTER_TRIM[0] > TRIM_GROWTH:
        release_freed()
        _AFTER_TRIM[0] = _resident()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module():
    """Hands freed memory back after each test module, and drops every compiled program once the process holds
    CLEAR_PROGRAMS_ABOVE bytes or half the kernel's memory maps (a later compilation then reads jax's persistent
    cache on disk, where make test keeps it). XLA CPU maps each executable's code into its own memory regions; one
    process running the whole suite otherwise reaches vm.max_map_count (65,530) and LLVM segfaults inside a later
    compilation."""
    yield
    release_freed()  # what the module's fixtures freed, handed back (glibc keeps it in its arenas)
    if _memory_maps() > _map_limit() // 2 or _resident() > CLEAR_PROGRAMS_ABOVE:
        drop_compiled_and_freed()


def drop_compiled_and_freed() -> None:
    """Drops every compiled program and hands freed memory back: a test that loads a 0.5B model in float32 (2.5 GB)
    calls it first, so that its peak stacks on what the process must hold, not on earlier tests' leftovers."""
    jax.clear_caches()
    release_freed()


def _peak_rss() -> int:
    """This process's peak resident bytes (getrusage; Linux counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Notes the test (its fixtures' setup and teardown included) during which the process's peak resident memory
    last rose; it is printed at the end beside the peak."""
    before = _peak_rss()
    yield
    if _peak_rss() > before:
        _PEAK_TEST[0] = item.nodeid


def pytest_sessionstart(session):
    session.config.stash[_PEAKS] = {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller collects each xdist worker's peaks (sent from the worker's pytest_sessionfinish)."""
    if "peak_rss" in getattr(node, "workeroutput", {}):
        node.config.stash[_PEAKS][node.gateway.id] = (node.workeroutput["peak_rss"], node.workeroutput["peak_test"])


def pytest_sessionfinish(session):
    """A worker sends its peaks to the controller; the controller (or a run without workers) fails the session when a
    test process held more than --peak-rss-limit-gb."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["peak_rss"], workeroutput["peak_test"] = _peak_rss(), _PEAK_TEST[0]
        return
    peaks = session.config.stash[_PEAKS]
    if not peaks:
        peaks["main"] = (_peak_rss(), _PEAK_TEST[0])
    if max(peak for peak, _ in peaks.values()) > _limit(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each test process's peak resident memory and the test during which it was reached, after pytest's durations."""
    for name, (peak, test) in sorted(config.stash.get(_PEAKS, {}).items()):
        limit = _limit(config)
        verdict = (
            "" if limit == float("inf") else f", {'OVER the limit of' if peak > limit else 'within'} {limit / 1e9:g} GB"
        )
        terminalreporter.write_line(
            f"peak resident memory of test process {name}: {peak / 1e9:.2f} GB{verdict} "
            f"(reached in {test or 'collection'})"
        )


_PEAKS = pytest.StashKey[dict]()
_PEAK_TEST = [""]  # the test during which this process's peak resident memory last rose


def _resident() -> int:
    """This process's resident bytes now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


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


def tiny_config(num_kv_heads: int = 2, qkv_bias: bool = False, **changes) -> ModelConfig:
    """The tests' tiny random decoder: llama (qwen2 with qkv biases), 2 layers, 6 query heads of 8 dims, vocabulary 101;
    `changes` replace any other field."""
    fields = dict(
        architecture="qwen2" if qkv_bias else "llama",
        vocab_size=101,
        hidden_size=48,
        num_layers=2,
        num_heads=6,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position=1024,
        rope=RopeSpec(theta=1000.0),
        qkv_bias=qkv_bias,
    )
    return ModelConfig(**(fields | changes))


def simulated_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess on `devices` simulated CPU devices, keeping this run's own flags (make test's -O0)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def _checkpoints_dir() -> Path:
    return Path(os.environ.get("KVZIP_CHECKPOINTS") or REPO_CHECKPOINTS)


def _bundled_gguf(name: str) -> Path:
    if not registry.installed(name):
        how = "make models-large" if name in registry.ON_DEMAND else registry.install_command(name)
        pytest.skip(f"bundled model {name} not installed: {how}")
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
def qwen_large_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2 architecture; installed on demand: make models-large)."""
    return _bundled_gguf(registry.QWEN_LARGE)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M base, Q4_K_M (gemma3 architecture)."""
    return _bundled_gguf(registry.GEMMA)


@contextlib.contextmanager
def one_parse_per_gguf():
    """Within this block each GGUF file is parsed once and its reader shared. transformers parses a GGUF twice per
    model load (config, then weights) and our converter once more, each with the gguf package's GGUFReader (12 s for
    Qwen's 151,936-token vocabulary on 2 cores): the same parse on every side, so sharing it changes no value either
    side computes. A reader is a read-only view of the file."""
    readers = {}
    parse, open_gguf = gguf.GGUFReader, kvzip_jax.weights.gguf.open_gguf

    def sharing(read):
        def shared(path):
            key = os.path.realpath(path)
            if key not in readers:
                readers[key] = read(path)
            return readers[key]

        return shared

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", sharing(parse))  # transformers imports it from gguf at each load
        patch.setattr(kvzip_jax.weights.gguf, "open_gguf", sharing(open_gguf))
        yield


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


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """Qwen2.5-Coder's tokenizer (bundled_tokenizer), loaded once per worker."""
    return bundled_tokenizer(registry.QWEN)


@pytest.fixture(scope="session")
def qwen_count(qwen_tokenizer):
    """text -> its length in Qwen2.5-Coder's tokens (RULER's length rule counts without special tokens)."""
    return lambda text: len(qwen_tokenizer.tokenize(text))


def sweep_record(task, example, question, method, mode, ratio, score, **extra) -> dict:
    """One answer's record as the sweep writes it (kvzip_jax.eval.results), for report and leaderboard tests."""
    defaults = {"prediction": "p", "references": ["r"], "metric": "inclusion", "agree": True, "kl": 0.0, "flip": 0.0}
    return {
        "model": "tiny",
        "task": task,
        "example": example,
        "question": question,
        "method": method,
        "mode": mode,
        "ratio": ratio,
        "score": score,
        "seconds": 0.1,
        **defaults,
        **extra,
    }


def bench_module(name: str):
    """bench/<name>.py imported as the module bench_<name> (registered in sys.modules: its dataclasses look it up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
