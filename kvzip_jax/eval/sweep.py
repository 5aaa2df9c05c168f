"""The sweep: contexts x methods x modes x ratios, batched over contexts, sharded over devices, resumable.

Per batch of contexts (same task, similar lengths, right-padded):
  1. one prefill of [prefix | instruction | context] per row (KVzip's task instruction by default, never evicted);
  2. the full cache decodes a draft answer to every question, greedily, step by step;
  3. every cache, the full one included, answers from one computation (answering.answer_forced): the draft
     teacher-forced in one pass gives the next-token logits (KL and top-1 flips against the full cache's) and the
     greedy answer, which follows the draft while the forced argmax agrees and is decoded from there on. So
     agreement compares like with like: a compressed cache that keeps every pair answers exactly as the full one;
  4. per method and mode, one scoring pass; per ratio, a masked cache (no copy of the scores or prefill).
     Attention Matching methods (matching.METHODS: am-hak, am-omp, kvzip-am, and the on-policy am-hak-op,
     kvzip-am-op) share one reference pass (KVzip's reread, which captures their queries and gives KVzip's scores
     at once; SweepConfig.self_study adds the queries of turns the model writes about each context); per ratio, a
     compacted cache (on-policy ones rerun the reread layer by layer, per ratio).
Modes: "reuse" compresses once without any question and answers every question (query-agnostic, the KVzip
protocol); "first" compresses with the first question in view and reuses that cache for the rest; "oracle"
recompresses per question. Query-independent methods (kvzip, streamingllm, random) run in "reuse" only.
Results go to a JSONL file (one record per answer, see results.py); keys already there are not redone, and a file
of other settings is refused (results.SweepMismatchError). A batch with answers still pending is prefilled and
answered by the full cache again (the pending answers are compared with it), and scored again only by the methods
with answers pending.

Batches are split over the local devices (placement.py, mesh sharding.data_mesh()). Processes share a sweep out by
batches of length-sorted contexts: process I of N takes batches[I::N] (share_of) into its own results file
(results.results_name), and results.merge joins the files afterwards; every process plans the same batches and runs
at the whole sweep's cache capacity, so its answers are the one-process sweep's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from kvzip_jax import baselines, dtypes, kvzip, matching, prompts, sharding
from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.errors import KvzipError
from kvzip_jax.eval import answering, host_memory, metrics, placement
from kvzip_jax.eval.results import RESULTS_VERSION, ResultsFile, SweepMismatchError
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK, evictable_layers
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights.identity import model_identity, package_version, tokenizer_hash

VERSIONS = {package: package_version(package)  # the packages that compute an answer (every record carries them)
            for package in ("kvzip-jax", "jax", "jaxlib", "flax", "numpy", "transformers")}

MODES = ("reuse", "first", "oracle")
FULL = "full"
METHODS = baselines.METHODS + tuple(matching.METHODS)
KV_BITS = (16, 8, 4)
CAPACITY_MULTIPLE = 64
QUERY_CAP = matching.MatchingConfig().query_cap  # Attention Matching's default reference rows per KV head and layer


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    methods: tuple[str, ...] = ("kvzip", "snapkv", "pyramidkv", "h2o", "streamingllm", "random")
    ratios: tuple[float, ...] = (1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1)
    modes: tuple[str, ...] = ("reuse",)
    batch_size: int = 8
    chunk_size: int = DEFAULT_CHUNK  # KVzip reread chunk
    seed: int = 0  # the random baseline's key
    instruction: str | None = prompts.KVZIP_INSTRUCTION  # opens the user message before the context (prefix)
    self_study: bool = False  # Attention Matching: self-study turns as reference queries beside the reread
    self_study_samples: int = 1  # turns per self-study prompt and context (matching.self_study.probes)
    self_study_tokens: int = 64  # most tokens of a self-study answer
    query_cap: int = QUERY_CAP  # most reference rows per KV head and layer, all sources
    kv_bits: tuple[int, ...] = (16,)  # every cache answers at each: 16 the model's dtype, 8 / 4 quantized kept pairs
    kv_group: int | None = None  # elements per scale of the quantized pairs (None: quant.DEFAULT_GROUP per width)
    kv_window: int = kv.WINDOW  # recent tokens at full precision in a quantized cache
    kv_center: bool = True  # quantized keys centred per channel first (cache.quantized)

    def __post_init__(self):
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if set(self.modes) - set(MODES) or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        for ratio in self.ratios:
            check_ratio(ratio)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.self_study and not set(self.methods) & set(matching.METHODS):
            raise ValueError("self_study adds Attention Matching reference queries: name an am-* or kvzip-am method")
        if min(self.self_study_samples, self.self_study_tokens, self.query_cap) < 1:
            raise ValueError("self_study_samples, self_study_tokens and query_cap must be >= 1")
        if not self.kv_bits or set(self.kv_bits) - set(KV_BITS):
            raise ValueError(f"kv_bits must be among {KV_BITS}, got {self.kv_bits}")
        if self.kv_window < 1:
            raise ValueError(f"kv_window must be >= 1, got {self.kv_window}")
        if self.quantizes:
            self.kv_format(8)  # a named error for a bad group

    @property
    def quantizes(self) -> bool:
        return any(bits != 16 for bits in self.kv_bits)

    def kv_format(self, bits: int) -> quant.QuantFormat:
        return quant.QuantFormat(bits=bits, group=self.kv_group)

    def modes_of(self, method: str) -> tuple[str, ...]:
        return self.modes if method in baselines.QUERY_AWARE else ("reuse",)

    def settings(self, model) -> dict:
        """What changes an answer (results.py): the model's and tokenizer's identity and the options that shape prompt
        and scores."""
        return dict(version=RESULTS_VERSION, model=model.name, **{f"model_{k}": v for k, v in
                                                                  model_identity(model.cfg, model.params).items()},
                    tokenizer=tokenizer_hash(model.tokenizer), instruction=self.instruction,
                    chunk_size=self.chunk_size, seed=self.seed,
                    **({"self_study": dict(samples=self.self_study_samples, max_new_tokens=self.self_study_tokens)}
                       if self.self_study else {}),
                    **({"query_cap": self.query_cap} if self.query_cap != QUERY_CAP else {}),
                    **({"kv_quant": kv_quant} if (kv_quant := self._kv_settings()) else {}))

    def _kv_settings(self) -> dict:
        """The quantization options that differ from those of results made before keys were centred (groups of 64
        at every width, a window of 128, no centres); none where nothing is quantized. Default groups are recorded
        for every width, so that a sweep grown by a width keeps its settings."""
        if not self.quantizes:
            return {}
        groups = self.kv_group if self.kv_group is not None else {str(b): g for b, g in quant.DEFAULT_GROUP.items()}
        layout = (groups, self.kv_window) != (64, kv.WINDOW)
        return {**(dict(group=groups, window=self.kv_window) if layout else {}),
                **({"center": True} if self.kv_center else {})}


def example_hash(ex: Example) -> str:
    """16 hex digits of what an example asks (context, questions, answers, metric, answer length)."""
    text = json.dumps([ex.context, list(ex.questions), [list(a) for a in ex.answers], ex.metric, ex.max_new_tokens])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of one batch: the real examples first, then copies of the last one up to the batch size."""

    examples: tuple[Example, ...]  # the real rows
    contexts: tuple[prompts.Prompt, ...]  # every row's [prefix | context] tokens
    suffixes: tuple[tuple[np.ndarray, ...], ...]  # per row, per question: [question | answer header] ids

    @property
    def size(self) -> int:
        return len(self.contexts)

    @property
    def max_new_tokens(self) -> int:
        return max(ex.max_new_tokens for ex in self.examples)

    @property
    def num_questions(self) -> int:
        return max(len(ex.questions) for ex in self.examples)

    def question_rows(self, i: int) -> list[np.ndarray]:
        """Suffix i of every row; rows without a question i repeat their first (answered, then ignored)."""
        return [s[i] if i < len(s) else s[0] for s in self.suffixes]


Item = tuple[Example, prompts.Prompt, tuple[np.ndarray, ...]]  # an example, its [prefix | context], its suffixes


class ProcessShareError(KvzipError, ValueError):
    """A process index or count that does not name a share of a sweep (0 <= index < count)."""


def prepare(tokenizer, examples: Sequence[Example], instruction: str | None = None) -> list[Item]:
    """Every example tokenized, sorted by (task, context tokens, id): the order batches are cut in (groups_of).
    instruction: opens every user message before the context (prompts.build_prompt)."""
    items = []
    for ex in examples:
        context, suffixes = prompts.split_for_reuse(tokenizer, ex.context, list(ex.questions),
                                                    instruction=instruction)
        items.append((ex, context, tuple(suffixes)))
    return sorted(items, key=lambda item: (item[0].task, len(item[1]), item[0].id))


def process_share(index: int | None = None, count: int | None = None, environ=os.environ) -> tuple[int, int]:
    """(index, count): which share of a sweep's batches this process runs. The given ones, else the environment's
    KVZIP_PROCESS_INDEX and KVZIP_PROCESS_COUNT, else jax.process_index() of jax.process_count() (0 of 1 unless
    jax.distributed is initialised). Raises ProcessShareError unless 0 <= index < count."""
    if (index is None) != (count is None):
        raise ProcessShareError("give the process index and the process count together")
    if index is None:
        names = ("KVZIP_PROCESS_INDEX", "KVZIP_PROCESS_COUNT")
        if (names[0] in environ) != (names[1] in environ):
            raise ProcessShareError(f"set {names[0]} and {names[1]} together")
        if names[0] in environ:
            try:
                index, count = (int(environ[name]) for name in names)
            except ValueError:
                raise ProcessShareError(f"{names[0]}={environ[names[0]]!r}, {names[1]}={environ[names[1]]!r}: "
                                        f"not integers") from None
        else:
            index, count = jax.process_index(), jax.process_count()
    if not 0 <= index < count:
        raise ProcessShareError(f"process index {index} is not in [0, {count}) (the process count)")
    return index, count


def groups_of(items: Sequence[Item], batch_size: int) -> list[tuple[Item, ...]]:
    """The sweep's batches before padding: batch_size items each (fewer for a task's last), one task each, cut in
    the items' order (prepare: similar lengths together). The cut does not depend on the devices, so every process
    plans the same batches."""
    by_task: dict[str, list] = {}
    for item in items:
        by_task.setdefault(item[0].task, []).append(item)
    return [tuple(rows[start:start + batch_size]) for task, rows in sorted(by_task.items())
            for start in range(0, len(rows), batch_size)]


def share_of(groups: Sequence[tuple[Item, ...]], index: int = 0, count: int = 1) -> list[tuple[Item, ...]]:
    """Process index of count's batches: groups[index::count], contexts of every task and length. Batches, not
    single contexts, are shared out: a row's numbers depend, in the last float bits, on the rows batched with it,
    so each share computes its contexts exactly as one process does, and the merged summary is byte for byte the
    one-process sweep's (with as many devices per process and the same batch size)."""
    return list(groups[index::count])


def padded(group: Sequence[Item], size: int) -> Batch:
    """The batch of a group's rows, padded with copies of its last row to size rows."""
    rows = list(group) + [group[-1]] * (size - len(group))
    return Batch(tuple(ex for ex, _, _ in group), tuple(c for _, c, _ in rows), tuple(s for _, _, s in rows))


def capacity_for(items: Sequence[Item]) -> int:
    """One cache capacity for the whole sweep (one compilation, the same in every process's share): the longest
    [prefix | context] plus the longest question and the longest answer, rounded up."""
    need = max(len(c) + max(map(len, s)) for _, c, s in items) + max(ex.max_new_tokens for ex, _, _ in items)
    return -(-need // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@functools.partial(jax.jit, static_argnames=("method", "evictable"))
def _masked(method, scores, cache, prefix_len, context_len, ratio, evictable):
    keep = baselines.keep_for(method, scores, context_len, ratio, evictable)  # [L, B, K, n]
    in_context = jnp.arange(keep.shape[-1]) < context_len[:, None]  # [B, n]
    keeps_all = jnp.all(keep | ~in_context[None, :, None, :])
    return kv.mask_context(cache, keep, prefix_len, context_len), keeps_all


_kvzip_scores = jax.jit(kvzip.score)
_reference_queries = jax.jit(matching.reference_queries, static_argnames=("sources", "cap", "with_scores"))
_compacted = jax.jit(matching.compact_with)
_baseline_scores = jax.jit(baselines.baseline_scores, static_argnames=("method",))
_log_probs = jax.jit(metrics.log_probs)
_divergence = jax.jit(metrics.divergence_from)


class _Shared:
    """What several methods of one batch share, computed once on first use: KVzip's reread inputs, and its reread
    pass, which gives KVzip's scores and, when an Attention Matching method runs, captures its reference queries
    (with the self-study probes' when the sweep asks for them)."""

    def __init__(self, sweep: "Sweep", cache: kv.KVCache, context_rows, prefix_len):
        self._sweep, self._cache, self._context_rows, self._prefix_len = sweep, cache, context_rows, prefix_len
        self._reread = self._queries = self._scores = self._probes = None
        self._wants_queries = any(m in matching.METHODS for m in sweep.config.methods)
        self.sources = ("repeat", "self-study") if sweep.config.self_study else ("repeat",)

    def reread(self) -> kvzip.RereadInputs:
        if self._reread is None:
            self._reread = kvzip.reread_inputs(self._sweep.model.tokenizer, self._prefix_len, self._context_rows,
                                               self._sweep.config.chunk_size)
        return self._reread

    def probes(self) -> matching.Probes | None:
        """The self-study turns the model writes about each context (None unless the sweep asks for them)."""
        config = self._sweep.config
        if self._probes is None and config.self_study:
            self._probes = matching.self_study.probes(self._sweep.params, self._sweep.model.cfg,
                                                      self._sweep.model.tokenizer, self._cache,
                                                      samples=config.self_study_samples,
                                                      max_new_tokens=config.self_study_tokens)
        return self._probes

    def queries(self) -> matching.ReferenceQueries:
        if self._queries is None:
            self._queries = _reference_queries(self._sweep.params, self._sweep.model.cfg, self._cache, self.reread(),
                                               self.sources, self._sweep.config.query_cap, with_scores=True,
                                               probes=self.probes())
        return self._queries

    def kvzip_scores(self) -> jax.Array:
        if self._wants_queries:  # the same reread pass gives both
            return self.queries().kvzip_scores
        if self._scores is None:
            self._scores = _kvzip_scores(self._sweep.params, self._sweep.model.cfg, self._cache, self.reread())
        return self._scores


class Sweep:
    """Runs batches for one model and config, appending records to a ResultsFile."""

    def __init__(self, model, config: SweepConfig, results: ResultsFile, mesh=None,
                 on_answers: Callable[[int], None] = lambda n: None, fingerprint: str | None = None):
        self.model, self.config, self.results, self.fingerprint = model, config, results, fingerprint
        self.mesh = mesh or sharding.data_mesh()
        self.params = placement.replicate(model.params, self.mesh)
        self.stops = prompts.stop_token_ids(model.tokenizer)
        self.evictable = evictable_layers(model.cfg)
        self.on_answers = on_answers

    # -- what a batch must produce -----------------------------------------------------------------------------
    def configurations(self) -> list[tuple[str, str, float, int]]:
        """(method, mode, ratio, kv bits) of every compressed cache, after the full cache's (full, full, 1.0, 16) and
        the full cache quantized (full, full, 1.0, 8 / 4: quantization alone)."""
        bits = self.config.kv_bits
        out = [(FULL, FULL, 1.0, 16)] + [(FULL, FULL, 1.0, b) for b in bits if b != 16]
        for method in self.config.methods:
            for mode in self.config.modes_of(method):
                out += [(method, mode, float(r), b) for r in self.config.ratios for b in bits]
        return out

    def pending(self, batch: Batch, method: str, mode: str, ratio: float, bits: int | None = None) -> bool:
        """Whether an answer of the configuration (at any of the sweep's kv bits when bits is None) is missing."""
        return any((ex.task, ex.id, method, mode, ratio, i, b) not in self.results.done
                   for b in ((bits,) if bits is not None else self.config.kv_bits)
                   for ex in batch.examples for i in range(len(ex.questions)))

    def answers_pending(self, batch: Batch) -> int:
        return sum(sum(len(ex.questions) for ex in batch.examples) for c in self.configurations()
                   if self.pending(batch, *c))

    # -- running ------------------------------------------------------------------------------------------------
    def run(self, batch: Batch, capacity: int) -> None:
        if not any(self.pending(batch, *c) for c in self.configurations()):
            return
        cfg = self.model.cfg
        prefix_len = np.array([c.context_start for c in batch.contexts], np.int32)  # [B]
        context_len = np.array([c.context_end - c.context_start for c in batch.contexts], np.int32)  # [B]
        empty = placement.split_batch(kv.init_cache(cfg, batch.size, capacity, dtypes.of_params(self.params)),
                                      self.mesh)
        _, cache = gen.prefill(self.params, cfg, [c.ids() for c in batch.contexts], empty)

        start = time.perf_counter()
        full = self._full_answers(batch, cache)
        self._record(batch, (FULL, FULL, 1.0, 16), full, full, time.perf_counter() - start,
                     kv.row_bytes(cache, placement.to_host))
        for bits in self.config.kv_bits:
            if bits != 16 and self.pending(batch, FULL, FULL, 1.0, bits):  # quantization alone
                self._answer_quantized(batch, (FULL, FULL, 1.0, bits), cache, range(batch.num_questions), full)

        context_rows = [c.ids()[c.context_slice] for c in batch.contexts]
        n_pad = -(-int(context_len.max()) // 64) * 64
        context_tokens = np.zeros((batch.size, n_pad), np.int32)  # [B, n] right-padded
        for b, row in enumerate(context_rows):
            context_tokens[b, :len(row)] = row
        lengths = (jnp.asarray(prefix_len), jnp.asarray(context_len))
        shared = _Shared(self, cache, context_rows, prefix_len)
        for method in self.config.methods:
            for mode in self.config.modes_of(method):
                if not any(self.pending(batch, method, mode, float(r)) for r in self.config.ratios):
                    continue
                question_sets = [None] if mode == "reuse" else [0] if mode == "first" else range(batch.num_questions)
                for observed in question_sets:
                    scores = None
                    if method not in matching.METHODS:
                        scores = self._scores(method, cache, batch, lengths, shared, context_tokens, observed)
                    asked = range(batch.num_questions) if mode != "oracle" else [observed]
                    for ratio in self.config.ratios:
                        key = (method, mode, float(ratio))
                        if not self.pending(batch, *key):
                            continue
                        start = time.perf_counter()
                        if method in matching.METHODS:
                            config = matching.method_config(method, float(ratio), self.model.name,
                                                            sources=shared.sources)
                            if config.on_policy:  # eagerly: its per-layer steps are jitted (matching.compact)
                                masked, _ = matching.compact(self.params, self.model.cfg, cache, shared.reread(),
                                                             config, shared.probes(), queries=shared.queries())
                            else:
                                masked, _ = _compacted(shared.queries(), self.model.cfg, cache, shared.reread(),
                                                       config)
                            keeps_all = ratio >= 1.0  # compact_with returns the cache itself at ratio 1
                        else:
                            masked, keeps_all = _masked(method, scores, cache, *lengths, jnp.float32(ratio),
                                                        self.evictable)
                        if self.pending(batch, *key, 16):
                            if bool(keeps_all):  # the mask keeps every pair: the same computation gives the same
                                got = {i: full[i] for i in asked}  # answers (tests/test_eval_sweep.py checks it)
                            else:
                                got = self._compressed_answers(batch, masked, asked, full)
                            self._record(batch, (*key, 16), got, full, time.perf_counter() - start,
                                         kv.row_bytes(masked, placement.to_host))
                        for bits in self.config.kv_bits:
                            if bits != 16 and self.pending(batch, *key, bits):
                                self._answer_quantized(batch, (*key, bits), masked, asked, full)
                        del masked
                        host_memory.release_freed(collect=False)  # the cache copy it answered from

    def _scores(self, method, cache, batch, lengths, shared, context_tokens, observed):
        """[L, B, K, n] scores of one method; observed: the question index in view (None: no question)."""
        if method == "kvzip":
            return shared.kvzip_scores()
        question = None
        if observed is not None:
            block, q_len = answering.pad_rows(batch.question_rows(observed))
            question = (jnp.asarray(block), jnp.asarray(q_len))
        return _baseline_scores(method, self.params, self.model.cfg, cache, *lengths, jnp.asarray(context_tokens),
                                question=question, key=self._row_keys(batch))

    def _answer_quantized(self, batch: Batch, key: tuple, cache: kv.KVCache, asked, full) -> None:
        """Records the answers of `cache` with its kept pairs quantized to key's kv bits (cache.quantized)."""
        start = time.perf_counter()
        quantized = kv.quantized(cache, self.config.kv_format(key[-1]), self.config.kv_window, self.config.kv_center)
        got = self._compressed_answers(batch, quantized, asked, full)
        self._record(batch, key, got, full, time.perf_counter() - start,
                     kv.row_bytes(quantized, placement.to_host))

    def _row_keys(self, batch: Batch) -> jax.Array:
        """One PRNG key per row from the seed and the example id: random scores independent of the batching."""
        ids = [ex.id for ex in batch.examples] + [batch.examples[-1].id] * (batch.size - len(batch.examples))
        seed = jax.random.key(self.config.seed)
        return jnp.stack([jax.random.fold_in(seed, zlib.crc32(i.encode())) for i in ids])

    def _full_answers(self, batch: Batch, cache: kv.KVCache) -> dict[int, dict]:
        """Per question: the full cache's step-by-step greedy draft, then its answer and teacher-forced
        log-probabilities from the computation every compressed cache goes through (_compressed_answers)."""
        work = answering.copy_cache(cache)
        out = {}
        for i in range(batch.num_questions):
            rows = batch.question_rows(i)
            draft, work = answering.answer(self.params, self.model.cfg, work, rows, batch.max_new_tokens, self.stops)
            got, work = answering.answer_forced(self.params, self.model.cfg, work, rows, draft.tokens,
                                                batch.max_new_tokens, self.stops)
            out[i] = dict(tokens=got.tokens, draft=draft.tokens, log_probs=_log_probs(got.logits), valid=got.valid,
                          kl=np.zeros(batch.size), flip=np.zeros(batch.size))
        return out

    def _compressed_answers(self, batch: Batch, masked: kv.KVCache, asked, full) -> dict[int, dict]:
        """Per question: the answer of a compressed cache and its next-token KL and flips against the full cache's,
        both teacher-forced on the full cache's draft, as the full cache's own were."""
        work = answering.copy_cache(masked)
        out = {}
        for i in asked:
            got, work = answering.answer_forced(self.params, self.model.cfg, work, batch.question_rows(i),
                                                full[i]["draft"], batch.max_new_tokens, self.stops)
            kl, flip = _divergence(full[i]["log_probs"], got.logits, jnp.asarray(got.valid))
            out[i] = dict(tokens=got.tokens, kl=placement.to_host(kl), flip=placement.to_host(flip))
        return out

    def _record(self, batch: Batch, key: tuple[str, str, float, int], got: dict[int, dict], full: dict[int, dict],
                seconds: float, row_bytes: np.ndarray) -> None:
        """Appends the answers `got` of configuration key; row_bytes [B]: the bytes of each row's kept pairs."""
        method, mode, ratio, bits = key
        tok = self.model.tokenizer
        text = lambda tokens: tok.decode([t for t in tokens if t not in self.stops]).strip()
        records = []
        for b, ex in enumerate(batch.examples):
            for i in got:
                if i >= len(ex.questions) or (ex.task, ex.id, method, mode, ratio, i, bits) in self.results.done:
                    continue
                prediction = text(got[i]["tokens"][b])
                records.append(dict(
                    config=self.fingerprint, example_hash=example_hash(ex), versions=VERSIONS,
                    model=self.model.name, task=ex.task, example=ex.id, question=i, method=method, mode=mode,
                    ratio=ratio, kv_bits=bits, bytes=int(row_bytes[b]), prediction=prediction,
                    references=list(ex.answers[i]), metric=ex.metric,
                    score=metrics.score(ex.metric, prediction, ex.answers[i]),
                    agree=prediction == text(full[i]["tokens"][b]), kl=float(got[i]["kl"][b]),
                    flip=float(got[i]["flip"][b]), seconds=0.0))
        for r in records:
            r["seconds"] = seconds / len(records)
        self.results.append(records)
        self.on_answers(len(records))


def run_sweep(model, examples: Sequence[Example], config: SweepConfig, results_path, progress: bool = True,
              mesh=None, share: tuple[int, int] = (0, 1), write: bool = True) -> ResultsFile:
    """Runs every pending answer of the sweep, appending to results_path (resumes a partial file of the same
    settings; raises results.SweepMismatchError for a file of other settings or other examples).
    mesh: default sharding.data_mesh(); every batch is padded to a multiple of its data axis. share (index, count):
    only process index of count's batches (share_of), into its own results_path (results.results_name);
    results.merge joins the shares. A mesh over several processes' devices (jax.distributed) runs one replica: every
    process runs the whole sweep in lockstep, reading the same results_path (a shared filesystem), and only the one
    given write=True writes it."""
    index, count = process_share(*share)
    results = ResultsFile(results_path, config.settings(model), write=write)
    mesh = mesh or sharding.data_mesh()
    if len({d.process_index for d in mesh.devices.flat}) > 1:
        _check_lockstep(results)
    for method in set(config.methods) & set(matching.METHODS):  # a missing profile or a misfit named before any work
        matching.method_config(method, 1.0, model.name, model.cfg)
    items = prepare(model.tokenizer, examples, config.instruction)
    capacity = capacity_for(items)  # the whole sweep's, whatever the share
    groups = share_of(groups_of(items, config.batch_size), index, count)
    for ex, _, _ in (item for group in groups for item in group):
        results.check_example(ex.task, ex.id, example_hash(ex))
    multiple = sharding.batch_multiple(mesh)
    batches = [padded(group, -(-config.batch_size // multiple) * multiple) for group in groups]
    bar = _progress_bar(progress)
    sweep = Sweep(model, config, results, mesh, on_answers=bar.update, fingerprint=results.fingerprint)
    bar.total = sum(sweep.answers_pending(b) for b in batches)
    bar.refresh()
    task = None
    for batch in batches:
        if task is not None and batch.examples[0].task != task:
            host_memory.drop_compiled()  # the next task's shapes differ: its programs replace the last task's
        task = batch.examples[0].task
        bar.set_postfix_str(f"{task} {batch.examples[0].id}")
        sweep.run(batch, capacity)
        host_memory.release_freed()
    bar.close()
    return results


def _check_lockstep(results: ResultsFile) -> None:
    """Raises SweepMismatchError unless every process of a replica spanning processes holds the same answers done
    (else they would run different batches, and wait on each other for ever)."""
    digest = np.frombuffer(hashlib.sha256(repr(sorted(results.done)).encode()).digest(), np.uint32)
    try:
        multihost_utils.assert_equal(digest)
    except AssertionError:
        raise SweepMismatchError(f"the processes hold different answers in {results.path}: put the sweep's folder "
                                 f"on a filesystem every process shares") from None


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(total=0, unit="answer", disable=not enabled, dynamic_ncols=True)
