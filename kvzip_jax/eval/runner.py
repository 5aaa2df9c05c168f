"""The runner of a sweep's batches: per batch, one prefill, the full cache's answers, then every method's
compressed caches (methods registry: one prepare per method and question in view, one finish per ratio), each
answering every question at every kv bits; records appended to the results file.

Einsum legend: L layers, B batch, K KV heads, n context columns.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax import cache as kv
from kvzip_jax import dtypes, kvzip, matching, methods, prompts, sharding
from kvzip_jax import generate as gen
from kvzip_jax.eval import answering, host_memory, metrics, placement
from kvzip_jax.eval.batches import Batch, example_hash
from kvzip_jax.eval.results import ResultsFile
from kvzip_jax.weights.identity import package_version

VERSIONS = {
    package: package_version(package)  # the packages that compute an answer (every record carries them)
    for package in ("kvzip-jax", "jax", "jaxlib", "flax", "numpy", "transformers")
}
FULL = "full"

_kvzip_scores = jax.jit(kvzip.score)
_reference_queries = jax.jit(matching.reference_queries, static_argnames=("sources", "cap", "with_scores"))
_log_probs = jax.jit(metrics.log_probs)
_divergence = jax.jit(metrics.divergence_from)


def keeps_everything(compressed: kv.KVCache, cache: kv.KVCache) -> bool:
    """Whether a compressed cache is the dense cache it came from, up to a keep mask that keeps every slot: then
    it answers exactly as that cache (tests/test_eval_sweep.py checks it)."""
    for new, old in zip(compressed.layers, cache.layers):
        if type(new) is not type(old) or (new.bias is None) != (old.bias is None) or old.keep is not None:
            return False
    return bool(_same_slots(compressed, cache))


@jax.jit
def _same_slots(compressed: kv.KVCache, cache: kv.KVCache) -> jax.Array:
    same = jnp.bool_(True)
    for new, old in zip(compressed.layers, cache.layers):
        same &= jnp.array_equal(new.k, old.k) & jnp.array_equal(new.v, old.v)
        if new.keep is not None:
            same &= jnp.all(new.keep)
        if new.bias is not None:
            same &= jnp.array_equal(new.bias, old.bias)
    return same


class SharedInputs:
    """A batch's methods.Inputs, each field computed once on first use and shared by every method that reads it.
    KVzip's reread pass gives KVzip's scores and, when a method of the sweep reads reference queries, captures those
    in the same pass (with the self-study probes' when the sweep asks for them)."""

    def __init__(self, sweep: "Sweep", batch: Batch, cache: kv.KVCache):
        self._sweep, self._batch, self._cache = sweep, batch, cache
        contexts = batch.contexts
        self.prefix_len = np.array([c.context_start for c in contexts], np.int32)  # [B]
        self.context_len = np.array([c.context_end - c.context_start for c in contexts], np.int32)  # [B]
        self._rows = [c.ids()[c.context_slice] for c in contexts]
        self._done: dict[str, object] = {}
        self._shares_pass = any("queries" in methods.method_of(m).reads for m in sweep.config.methods)

    def inputs(self, method: methods.Method, observed: int | None) -> methods.Inputs:
        """The inputs `method` reads; observed: the question index in view (None: no question)."""
        fields = {name: self._field(name) for name in method.reads if name not in ("question", "scorer")}
        if "scorer" in method.reads:  # each trained method its own kind of scorer
            fields["scorer"] = self._sweep.scorers[method.options.kind]
        if "question" in method.reads and observed is not None:
            block, q_len = answering.pad_rows(self._batch.question_rows(observed))
            fields["question"] = (jnp.asarray(block), jnp.asarray(q_len))
        return methods.Inputs(jnp.asarray(self.prefix_len), jnp.asarray(self.context_len), **fields)

    def _field(self, name: str):
        if name not in self._done:
            self._done[name] = getattr(self, "_" + name)()
        return self._done[name]

    def _reread(self) -> kvzip.RereadInputs:
        sweep = self._sweep
        return kvzip.reread_inputs(sweep.model.tokenizer, self.prefix_len, self._rows, sweep.config.chunk_size)

    def _context_tokens(self) -> jax.Array:
        n_pad = -(-int(self.context_len.max()) // 64) * 64
        tokens = np.zeros((len(self._rows), n_pad), np.int32)  # [B, n] right-padded
        for b, row in enumerate(self._rows):
            tokens[b, : len(row)] = row
        return jnp.asarray(tokens)

    def _key(self) -> jax.Array:
        """One PRNG key per row from the seed and the example id: random scores independent of the batching."""
        examples = self._batch.examples
        ids = [ex.id for ex in examples] + [examples[-1].id] * (self._batch.size - len(examples))
        seed = jax.random.key(self._sweep.config.seed)
        return jnp.stack([jax.random.fold_in(seed, zlib.crc32(i.encode())) for i in ids])

    def _probes(self) -> matching.Probes | None:
        """The self-study turns the model writes about each context (None unless the sweep asks for them)."""
        sweep, config = self._sweep, self._sweep.config
        if not config.self_study:
            return None
        return matching.self_study.probes(
            sweep.params,
            sweep.model.cfg,
            sweep.model.tokenizer,
            self._cache,
            samples=config.self_study_samples,
            max_new_tokens=config.self_study_tokens,
        )

    def _queries(self) -> matching.ReferenceQueries:
        sweep = self._sweep
        return _reference_queries(
            sweep.params,
            sweep.model.cfg,
            self._cache,
            self._field("reread"),
            sweep.config.reference_sources,
            sweep.config.query_cap,
            with_scores=True,
            probes=self._field("probes"),
        )

    def _kvzip_scores(self) -> jax.Array:
        """[L, B, K, n]: from the reference queries' pass when a method of the sweep reads them (the same pass)."""
        if self._shares_pass:
            return self._field("queries").kvzip_scores
        return _kvzip_scores(self._sweep.params, self._sweep.model.cfg, self._cache, self._field("reread"))


class Sweep:
    """Runs batches for one model and config, appending records to a ResultsFile. Each method's options are
    resolved for the model once (methods.Method.options_for: a missing budget profile fails here, before any work)."""

    def __init__(
        self,
        model,
        config,
        results: ResultsFile,
        mesh=None,
        on_answers: Callable[[int], None] = lambda n: None,
        fingerprint: str | None = None,
    ):
        self.model, self.config, self.results, self.fingerprint = model, config, results, fingerprint
        self.options = {}  # per method spec ("kvzap:threshold=-4": kvzap with that option)
        for spec in config.methods:
            method, changes = methods.parse_spec(spec)
            self.options[spec] = method.options_for(model.name, model.cfg, **changes)
        self.mesh = mesh or sharding.data_mesh()
        self.params = placement.replicate(model.params, self.mesh)
        self.stops = prompts.stop_token_ids(model.tokenizer)
        self.on_answers = on_answers
        self.scorers = {  # trained scorers' weights beside the params, loaded before any work
            kind: placement.replicate(config.load_scorer(model, kind), self.mesh) for kind in config.scorer_kinds()
        }

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
        return any(
            (ex.task, ex.id, method, mode, ratio, i, b) not in self.results.done
            for b in ((bits,) if bits is not None else self.config.kv_bits)
            for ex in batch.examples
            for i in range(len(ex.questions))
        )

    def answers_pending(self, batch: Batch) -> int:
        return sum(
            sum(len(ex.questions) for ex in batch.examples) for c in self.configurations() if self.pending(batch, *c)
        )

    # -- running ------------------------------------------------------------------------------------------------
    def run(self, batch: Batch, capacity: int) -> None:
        if not any(self.pending(batch, *c) for c in self.configurations()):
            return
        empty = placement.split_batch(
            kv.init_cache(self.model.cfg, batch.size, capacity, dtypes.of_params(self.params)), self.mesh
        )
        _, cache = gen.prefill(self.params, self.model.cfg, [c.ids() for c in batch.contexts], empty)

        start = time.perf_counter()
        full = self._full_answers(batch, cache)
        self._record(
            batch,
            (FULL, FULL, 1.0, 16),
            full,
            full,
            time.perf_counter() - start,
            kv.row_bytes(cache, placement.to_host),
        )
        for bits in self.config.kv_bits:
            if bits != 16 and self.pending(batch, FULL, FULL, 1.0, bits):  # quantization alone
                self._answer_quantized(batch, (FULL, FULL, 1.0, bits), cache, range(batch.num_questions), full)
        shared = SharedInputs(self, batch, cache)
        for name in self.config.methods:
            for mode in self.config.modes_of(name):
                if any(self.pending(batch, name, mode, float(r)) for r in self.config.ratios):
                    self._run_method(batch, cache, full, shared, name, mode)

    def _run_method(self, batch: Batch, cache: kv.KVCache, full, shared: SharedInputs, name: str, mode: str) -> None:
        """One method in one mode: per question set in view, one prepare, then per pending ratio a compressed cache
        answering its questions at every kv bits. reuse: no question; first: the first question, its cache reused
        for every question; oracle: each question's own."""
        method, options = methods.method_of(name), self.options[name]
        question_sets = [None] if mode == "reuse" else [0] if mode == "first" else range(batch.num_questions)
        for observed in question_sets:
            inputs = shared.inputs(method, observed)
            state = method.jitted_prepare(self.params, self.model.cfg, cache, inputs, options)
            asked = range(batch.num_questions) if mode != "oracle" else [observed]
            for ratio in self.config.ratios:
                key = (name, mode, float(ratio))
                if not self.pending(batch, *key):
                    continue
                start = time.perf_counter()
                compressed = method.jitted_finish(
                    self.params, self.model.cfg, cache, inputs, state, float(ratio), options
                )
                if self.pending(batch, *key, 16):
                    if keeps_everything(compressed, cache):  # the same computation gives the same answers
                        got = {i: full[i] for i in asked}
                    else:
                        got = self._compressed_answers(batch, compressed, asked, full)
                    self._record(
                        batch,
                        (*key, 16),
                        got,
                        full,
                        time.perf_counter() - start,
                        kv.row_bytes(compressed, placement.to_host),
                    )
                for bits in self.config.kv_bits:
                    if bits != 16 and self.pending(batch, *key, bits):
                        self._answer_quantized(batch, (*key, bits), compressed, asked, full)
                del compressed
                host_memory.release_freed(collect=False)  # the cache copy it answered from

    def _answer_quantized(self, batch: Batch, key: tuple, cache: kv.KVCache, asked, full) -> None:
        """Records the answers of `cache` with its kept pairs quantized to key's kv bits (cache.quantized)."""
        start = time.perf_counter()
        keys, values = self.config.kv_formats(key[-1])
        quantized = kv.quantized(cache, keys, self.config.kv_window, self.config.kv_center, value_fmt=values)
        got = self._compressed_answers(batch, quantized, asked, full)
        self._record(batch, key, got, full, time.perf_counter() - start, kv.row_bytes(quantized, placement.to_host))

    def _full_answers(self, batch: Batch, cache: kv.KVCache) -> dict[int, dict]:
        """Per question: the full cache's step-by-step greedy draft, then its answer and teacher-forced
        log-probabilities from the computation every compressed cache goes through (_compressed_answers)."""
        work = answering.copy_cache(cache)
        out = {}
        for i in range(batch.num_questions):
            rows = batch.question_rows(i)
            draft, work = answering.answer(self.params, self.model.cfg, work, rows, batch.max_new_tokens, self.stops)
            got, work = answering.answer_forced(
                self.params, self.model.cfg, work, rows, draft.tokens, batch.max_new_tokens, self.stops
            )
            out[i] = dict(
                tokens=got.tokens,
                draft=draft.tokens,
                log_probs=_log_probs(got.logits),
                valid=got.valid,
                kl=np.zeros(batch.size),
                flip=np.zeros(batch.size),
            )
        return out

    def _compressed_answers(self, batch: Batch, compressed: kv.KVCache, asked, full) -> dict[int, dict]:
        """Per question: the answer of a compressed cache and its next-token KL and flips against the full cache's,
        both teacher-forced on the full cache's draft, as the full cache's own were."""
        work = answering.copy_cache(compressed)
        out = {}
        for i in asked:
            got, work = answering.answer_forced(
                self.params,
                self.model.cfg,
                work,
                batch.question_rows(i),
                full[i]["draft"],
                batch.max_new_tokens,
                self.stops,
            )
            kl, flip = _divergence(full[i]["log_probs"], got.logits, jnp.asarray(got.valid))
            out[i] = dict(tokens=got.tokens, kl=placement.to_host(kl), flip=placement.to_host(flip))
        return out

    def _record(
        self,
        batch: Batch,
        key: tuple[str, str, float, int],
        got: dict[int, dict],
        full: dict[int, dict],
        seconds: float,
        row_bytes: np.ndarray,
    ) -> None:
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
                records.append(
                    dict(
                        config=self.fingerprint,
                        example_hash=example_hash(ex),
                        versions=VERSIONS,
                        model=self.model.name,
                        task=ex.task,
                        example=ex.id,
                        question=i,
                        method=method,
                        mode=mode,
                        ratio=ratio,
                        kv_bits=bits,
                        bytes=int(row_bytes[b]),
                        prediction=prediction,
                        references=list(ex.answers[i]),
                        metric=ex.metric,
                        score=metrics.score(ex.metric, prediction, ex.answers[i]),
                        agree=prediction == text(full[i]["tokens"][b]),
                        kl=float(got[i]["kl"][b]),
                        flip=float(got[i]["flip"][b]),
                        seconds=0.0,
                    )
                )
        for r in records:
            r["seconds"] = seconds / len(records)
        self.results.append(records)
        self.on_answers(len(records))
