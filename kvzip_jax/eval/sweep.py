"""The sweep: contexts x methods x modes x ratios, batched over contexts, sharded over devices, resumable.

Per batch of contexts (same task, similar lengths, right-padded):
  1. one prefill of [prefix | context] per row;
  2. the full cache answers every question (greedy), then its teacher-forced logits over its own answers;
  3. per method and mode, one scoring pass; per ratio, a masked cache (no copy of the scores or prefill) answers
     the questions: greedy, plus the full answer teacher-forced for KL and top-1 flips.
Modes: "reuse" compresses once without any question and answers every question (query-agnostic, the KVzip
protocol); "first" compresses with the first question in view and reuses that cache for the rest; "oracle"
recompresses per question. Query-independent methods (kvzip, streamingllm, random) run in "reuse" only.
Results go to a JSONL file (one record per answer, see results.py); keys already there are not redone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import baselines, kvzip, prompts
from kvzip_jax import cache as kv
from kvzip_jax import generate as gen
from kvzip_jax.eval import answering, metrics, sharding
from kvzip_jax.eval.results import ResultsFile
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK, evictable_layers

MODES = ("reuse", "first", "oracle")
FULL = "full"
CAPACITY_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    methods: tuple[str, ...] = ("kvzip", "snapkv", "pyramidkv", "h2o", "streamingllm")
    ratios: tuple[float, ...] = (1.0, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1)
    modes: tuple[str, ...] = ("reuse",)
    batch_size: int = 8
    chunk_size: int = DEFAULT_CHUNK  # KVzip reread chunk
    seed: int = 0  # the random baseline's key

    def __post_init__(self):
        unknown = sorted(set(self.methods) - set(baselines.METHODS))
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(baselines.METHODS)}")
        if set(self.modes) - set(MODES) or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        for ratio in self.ratios:
            check_ratio(ratio)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def modes_of(self, method: str) -> tuple[str, ...]:
        return self.modes if method in baselines.QUERY_AWARE else ("reuse",)


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


def plan_batches(tokenizer, examples: Sequence[Example], batch_size: int, multiple: int = 1) -> list[Batch]:
    """Batches of one task each, contexts of similar length together; sizes padded to a multiple of `multiple`."""
    size = -(-batch_size // multiple) * multiple
    by_task: dict[str, list] = {}
    for ex in examples:
        context, suffixes = prompts.split_for_reuse(tokenizer, ex.context, list(ex.questions))
        by_task.setdefault(ex.task, []).append((ex, context, tuple(suffixes)))
    batches = []
    for task in sorted(by_task):
        items = sorted(by_task[task], key=lambda item: (len(item[1]), item[0].id))
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            padded = chunk + [chunk[-1]] * (size - len(chunk))
            batches.append(Batch(tuple(ex for ex, _, _ in chunk), tuple(c for _, c, _ in padded),
                                 tuple(s for _, _, s in padded)))
    return batches


def capacity_for(batches: Sequence[Batch]) -> int:
    """One cache capacity for the whole sweep (one compilation): the longest [prefix | context] plus the longest
    question and answer, rounded up."""
    need = max(max(len(c) + max(map(len, s)) for c, s in zip(b.contexts, b.suffixes))
               + max(ex.max_new_tokens for ex in b.examples) for b in batches)
    return -(-need // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@functools.partial(jax.jit, static_argnames=("method", "evictable"))
def _masked(method, scores, cache, prefix_len, context_len, ratio, evictable):
    keep = baselines.keep_for(method, scores, context_len, ratio, evictable)  # [L, B, K, n]
    in_context = jnp.arange(keep.shape[-1]) < context_len[:, None]  # [B, n]
    keeps_all = jnp.all(keep | ~in_context[None, :, None, :])
    return kv.mask_context(cache, keep, prefix_len, context_len), keeps_all


_kvzip_scores = jax.jit(kvzip.score)
_baseline_scores = jax.jit(baselines.baseline_scores, static_argnames=("method",))
_log_probs = jax.jit(metrics.log_probs)
_divergence = jax.jit(metrics.divergence_from)


class Sweep:
    """Runs batches for one model and config, appending records to a ResultsFile."""

    def __init__(self, model, config: SweepConfig, results: ResultsFile, mesh=None,
                 on_answers: Callable[[int], None] = lambda n: None):
        self.model, self.config, self.results = model, config, results
        self.mesh = mesh or sharding.data_mesh()
        self.params = sharding.replicate(model.params, self.mesh)
        self.stops = prompts.stop_token_ids(model.tokenizer)
        self.evictable = evictable_layers(model.cfg)
        self.on_answers = on_answers

    # -- what a batch must produce -----------------------------------------------------------------------------
    def configurations(self) -> list[tuple[str, str, float]]:
        """(method, mode, ratio) of every compressed cache, after the full cache's (full, full, 1.0)."""
        out = [(FULL, FULL, 1.0)]
        for method in self.config.methods:
            for mode in self.config.modes_of(method):
                out += [(method, mode, float(r)) for r in self.config.ratios]
        return out

    def pending(self, batch: Batch, method: str, mode: str, ratio: float) -> bool:
        return any((ex.task, ex.id, method, mode, ratio, i) not in self.results.done
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
        empty = sharding.split_batch(kv.init_cache(cfg, batch.size, capacity), self.mesh)
        _, cache = gen.prefill(self.params, cfg, [c.ids() for c in batch.contexts], empty)

        start = time.perf_counter()
        full = self._full_answers(batch, cache)
        self._record(batch, (FULL, FULL, 1.0), full, full, time.perf_counter() - start)

        context_rows = [c.ids()[c.context_slice] for c in batch.contexts]
        n_pad = -(-int(context_len.max()) // 64) * 64
        context_tokens = np.zeros((batch.size, n_pad), np.int32)  # [B, n] right-padded
        for b, row in enumerate(context_rows):
            context_tokens[b, :len(row)] = row
        lengths = (jnp.asarray(prefix_len), jnp.asarray(context_len))
        for method in self.config.methods:
            for mode in self.config.modes_of(method):
                if not any(self.pending(batch, method, mode, float(r)) for r in self.config.ratios):
                    continue
                question_sets = [None] if mode == "reuse" else [0] if mode == "first" else range(batch.num_questions)
                for observed in question_sets:
                    scores = self._scores(method, cache, batch, lengths, context_rows, context_tokens, observed)
                    asked = range(batch.num_questions) if mode != "oracle" else [observed]
                    for ratio in self.config.ratios:
                        key = (method, mode, float(ratio))
                        if not self.pending(batch, *key):
                            continue
                        start = time.perf_counter()
                        masked, keeps_all = _masked(method, scores, cache, *lengths, jnp.float32(ratio),
                                                    self.evictable)
                        if bool(keeps_all):  # the mask keeps every pair: this is the full cache
                            got = {i: full[i] for i in asked}
                        else:
                            got = self._compressed_answers(batch, masked, asked, full)
                        del masked
                        self._record(batch, key, got, full, time.perf_counter() - start)

    def _scores(self, method, cache, batch, lengths, context_rows, context_tokens, observed):
        """[L, B, K, n] scores of one method; observed: the question index in view (None: no question)."""
        if method == "kvzip":
            reread = kvzip.reread_inputs(self.model.tokenizer, np.asarray(lengths[0]), context_rows,
                                         self.config.chunk_size)
            return _kvzip_scores(self.params, self.model.cfg, cache, reread)
        question = None
        if observed is not None:
            block, q_len = answering.pad_rows(batch.question_rows(observed))
            question = (jnp.asarray(block), jnp.asarray(q_len))
        return _baseline_scores(method, self.params, self.model.cfg, cache, *lengths, jnp.asarray(context_tokens),
                                question=question, key=self._row_keys(batch))

    def _row_keys(self, batch: Batch) -> jax.Array:
        """One PRNG key per row from the seed and the example id: random scores independent of the batching."""
        ids = [ex.id for ex in batch.examples] + [batch.examples[-1].id] * (batch.size - len(batch.examples))
        seed = jax.random.key(self.config.seed)
        return jnp.stack([jax.random.fold_in(seed, zlib.crc32(i.encode())) for i in ids])

    def _full_answers(self, batch: Batch, cache: kv.KVCache) -> dict[int, dict]:
        """Per question: greedy answers of the full cache and its teacher-forced log-probabilities over them."""
        work = answering.copy_cache(cache)
        out = {}
        for i in range(batch.num_questions):
            rows = batch.question_rows(i)
            got, work = answering.answer(self.params, self.model.cfg, work, rows, batch.max_new_tokens, self.stops)
            forced, work = answering.answer_forced(self.params, self.model.cfg, work, rows, got.tokens, 0, self.stops)
            out[i] = dict(tokens=got.tokens, log_probs=_log_probs(forced.logits), valid=forced.valid,
                          kl=np.zeros(batch.size), flip=np.zeros(batch.size))
        return out

    def _compressed_answers(self, batch: Batch, masked: kv.KVCache, asked, full) -> dict[int, dict]:
        work = answering.copy_cache(masked)
        out = {}
        for i in asked:
            got, work = answering.answer_forced(self.params, self.model.cfg, work, batch.question_rows(i),
                                                full[i]["tokens"], batch.max_new_tokens, self.stops)
            kl, flip = _divergence(full[i]["log_probs"], got.logits, jnp.asarray(got.valid))
            out[i] = dict(tokens=got.tokens, kl=np.asarray(kl), flip=np.asarray(flip))
        return out

    def _record(self, batch: Batch, key: tuple[str, str, float], got: dict[int, dict], full: dict[int, dict],
                seconds: float) -> None:
        method, mode, ratio = key
        tok = self.model.tokenizer
        text = lambda tokens: tok.decode([t for t in tokens if t not in self.stops]).strip()
        records = []
        for b, ex in enumerate(batch.examples):
            for i in got:
                if i >= len(ex.questions) or (ex.task, ex.id, method, mode, ratio, i) in self.results.done:
                    continue
                prediction = text(got[i]["tokens"][b])
                records.append(dict(
                    model=self.model.name, task=ex.task, example=ex.id, question=i, method=method, mode=mode,
                    ratio=ratio, prediction=prediction, references=list(ex.answers[i]), metric=ex.metric,
                    score=metrics.score(ex.metric, prediction, ex.answers[i]),
                    agree=prediction == text(full[i]["tokens"][b]), kl=float(got[i]["kl"][b]),
                    flip=float(got[i]["flip"][b]), seconds=0.0))
        for r in records:
            r["seconds"] = seconds / len(records)
        self.results.append(records)
        self.on_answers(len(records))


def run_sweep(model, examples: Sequence[Example], config: SweepConfig, results_path, progress: bool = True,
              mesh=None) -> ResultsFile:
    """Runs every pending answer of the sweep, appending to results_path (resumes a partial file)."""
    results = ResultsFile(results_path)
    mesh = mesh or sharding.data_mesh()
    batches = plan_batches(model.tokenizer, examples, config.batch_size, sharding.batch_multiple(mesh))
    capacity = capacity_for(batches)
    bar = _progress_bar(progress)
    sweep = Sweep(model, config, results, mesh, on_answers=bar.update)
    bar.total = sum(sweep.answers_pending(b) for b in batches)
    bar.refresh()
    for batch in batches:
        bar.set_postfix_str(f"{batch.examples[0].task} {batch.examples[0].id}")
        sweep.run(batch, capacity)
    bar.close()
    return results


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(total=0, unit="answer", disable=not enabled, dynamic_ncols=True)
