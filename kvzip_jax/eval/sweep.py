"""The sweep: contexts x methods x modes x ratios, batched over contexts, sharded over devices, resumable.

Per batch of contexts (same task, similar lengths, right-padded):
  1. one prefill of [prefix | instruction | context] per row (KVzip's task instruction by default, never evicted);
  2. the full cache decodes a draft answer to every question, greedily, step by step;
  3. every cache, the full one included, answers from one computation (answering.answer_forced): the draft
     teacher-forced in one pass gives the next-token logits (KL and top-1 flips against the full cache's) and the
     greedy answer, which follows the draft while the forced argmax agrees and is decoded from there on. So
     agreement compares like with like: a compressed cache that keeps every pair answers exactly as the full one;
  4. per method (methods registry) and mode, one prepare (its scores or reference queries); per ratio, one finish
     (a masked or compacted cache; no copy of the scores or prefill). Methods reading the same inputs share them
     (runner.SharedInputs): KVzip's reread pass gives KVzip's scores and the reference queries of the compaction
     methods at once; SweepConfig.self_study adds the queries of turns the model writes about each context.
Modes: "reuse" compresses once without any question and answers every question (query-agnostic, the KVzip
protocol); "first" compresses with the first question in view and reuses that cache for the rest; "oracle"
recompresses per question. Methods that do not see the question run in "reuse" only.
Results go to a JSONL file (one record per answer, see results.py); keys already there are not redone, and a file
of other settings is refused (results.SweepMismatchError), but a sweep reading fewer of its trained scorers, each
the same, continues it (reading_fewer_scorers). A batch with answers still pending is prefilled and
answered by the full cache again (the pending answers are compared with it), and scored again only by the methods
with answers pending.

Batches (batches.py) are split over the local devices (placement.py, mesh sharding.data_mesh()). Processes share a
sweep out by batches of length-sorted contexts: process I of N takes batches[I::N] (shares.py) into its own results file
(results.results_name), and results.merge joins the files afterwards; every process plans the same batches and runs
at the whole sweep's cache capacity, so its answers are the one-process sweep's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from kvzip_jax import cache as kv
from kvzip_jax import matching, methods, prompts, sharding
from kvzip_jax.eval import host_memory
from kvzip_jax.eval.batches import capacity_for, example_hash, groups_of, padded, prepare
from kvzip_jax.eval.results import RESULTS_VERSION, ResultsFile, stored_settings
from kvzip_jax.eval.runner import Sweep
from kvzip_jax.eval.shares import check_lockstep, process_share, share_of
from kvzip_jax.eval.tasks.base import Example
from kvzip_jax.kvzip.budget import check_ratio
from kvzip_jax.kvzip.scoring import DEFAULT_CHUNK
from kvzip_jax.quant import groups as quant
from kvzip_jax.weights.identity import model_identity, params_fingerprint, tokenizer_hash

MODES = ("reuse", "first", "oracle")
KV_BITS = quant.KV_BITS
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
    kv_bits: tuple[int | str, ...] = (16,)  # every cache answers at each: 16 the model's dtype, 8 / 4 quantized kept
    # pairs, "8/4" int8 keys beside int4 values
    kv_group: int | None = None  # elements per scale of the quantized pairs (None: quant.DEFAULT_GROUP per width)
    kv_window: int = kv.WINDOW  # recent tokens at full precision in a quantized cache
    kv_center: bool = True  # quantized keys centred per channel first (cache.quantized)
    scorers: str | None = None  # a folder of trained scorers, <kind>/ each (None: scorers.scorer.scorer_dirs)

    def __post_init__(self):
        if not self.methods:
            raise methods.MethodError(f"no method given; choose from {', '.join(methods.names())}")
        for spec in self.methods:
            self._check_shared_capture(spec)  # an unknown name or option: MethodError
        if set(self.modes) - set(MODES) or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        for ratio in self.ratios:
            check_ratio(ratio)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.self_study and not any("probes" in methods.method_of(m).reads for m in self.methods):
            raise ValueError(
                "self_study adds reference queries of self-study turns: name a method that reads them "
                "(an am-* or kvzip-am method)"
            )
        if min(self.self_study_samples, self.self_study_tokens, self.query_cap) < 1:
            raise ValueError("self_study_samples, self_study_tokens and query_cap must be >= 1")
        if not self.kv_bits or set(self.kv_bits) - set(KV_BITS):
            raise ValueError(f"kv_bits must be among {KV_BITS}, got {self.kv_bits}")
        if self.kv_window < 1:
            raise ValueError(f"kv_window must be >= 1, got {self.kv_window}")
        if self.quantizes:
            self.kv_formats(8)  # a named error for a bad group

    def _check_shared_capture(self, spec: str) -> None:
        """MethodError for a spec whose query_cap or sources differ from the sweep's: the sweep captures the
        reference queries once per batch for every method (runner.SharedInputs), with query_cap and
        reference_sources, so such an option would be silently ignored."""
        method, changes = methods.parse_spec(spec)
        if "queries" not in method.reads:
            return
        shared = self.reference_sources
        if "query_cap" in changes and changes["query_cap"] != self.query_cap:
            raise methods.MethodError(
                f"{spec!r}: a sweep captures the reference queries once for every method; set their cap with "
                f"--query-cap {changes['query_cap']} (SweepConfig.query_cap), not as a method option"
            )
        sources = changes.get("sources", shared)
        sources = (sources,) if isinstance(sources, str) else tuple(sources)
        if sources not in (("repeat",), shared):
            raise methods.MethodError(
                f"{spec!r}: a sweep's reference queries come from {' and '.join(shared)} for every method "
                f"(--self-study adds self-study); other sources are not captured in a sweep"
            )

    @property
    def reference_sources(self) -> tuple[str, ...]:
        """The sources of the reference queries the sweep captures once per batch for every method."""
        return ("repeat", "self-study") if self.self_study else ("repeat",)

    @property
    def quantizes(self) -> bool:
        return any(bits != 16 for bits in self.kv_bits)

    def kv_formats(self, bits: int | str) -> tuple[quant.QuantFormat, quant.QuantFormat]:
        """(keys' format, values' format) of a quantized kv_bits entry."""
        return quant.kv_formats(bits, self.kv_group)

    def modes_of(self, method: str) -> tuple[str, ...]:
        """The modes a method runs in: every mode if it sees the question, else reuse."""
        return self.modes if methods.method_of(method).question_aware else ("reuse",)

    def settings(self, model) -> dict:
        """What changes an answer (results.py): the model's and tokenizer's identity and the options that shape prompt
        and scores."""
        return dict(
            version=RESULTS_VERSION,
            model=model.name,
            **{f"model_{k}": v for k, v in model_identity(model.cfg, model.params).items()},
            tokenizer=tokenizer_hash(model.tokenizer),
            instruction=self.instruction,
            chunk_size=self.chunk_size,
            seed=self.seed,
            **(
                {"self_study": dict(samples=self.self_study_samples, max_new_tokens=self.self_study_tokens)}
                if self.self_study
                else {}
            ),
            **({"query_cap": self.query_cap} if self.query_cap != QUERY_CAP else {}),
            **({"kv_quant": kv_quant} if (kv_quant := self._kv_settings()) else {}),
            **({"scorers": trained} if (trained := self._scorer_settings(model)) else {}),
        )

    def scorer_kinds(self) -> tuple[str, ...]:
        """The kinds of trained scorer the sweep's methods read (methods whose options name a kind)."""
        kinds = {methods.method_of(m).options.kind for m in self.methods if "scorer" in methods.method_of(m).reads}
        return tuple(sorted(kinds))

    def load_scorer(self, model, kind: str):
        """The sweep's `kind` scorer for the model (scorers.scorer.load; from `scorers`/<kind> when given)."""
        from kvzip_jax.scorers import scorer

        return scorer.load(model, kind, None if self.scorers is None else Path(self.scorers) / kind)

    def _scorer_settings(self, model) -> dict:
        """{kind: the fingerprint of its weights} of the scorers the methods read: another scorer, another sweep."""
        return {kind: params_fingerprint(self.load_scorer(model, kind).params) for kind in self.scorer_kinds()}

    def _kv_settings(self) -> dict:
        """The quantization options that differ from those of results made before keys were centred (groups of 64
        at every width, a window of 128, no centres); none where nothing is quantized. Default groups are recorded
        for every width, so that a sweep grown by a width keeps its settings."""
        if not self.quantizes:
            return {}
        groups = self.kv_group if self.kv_group is not None else {str(b): g for b, g in quant.DEFAULT_GROUP.items()}
        layout = (groups, self.kv_window) != (64, kv.WINDOW)
        return {
            **(dict(group=groups, window=self.kv_window) if layout else {}),
            **({"center": True} if self.kv_center else {}),
        }


def reading_fewer_scorers(stored: dict | None, settings: dict) -> dict:
    """The stored settings where `settings` differ from them only by reading fewer of their trained scorers, each
    the same (a sweep run for some of a grid's methods is that grid's sweep); else `settings`."""
    if stored is None:
        return settings
    ours, theirs = settings.get("scorers", {}), stored.get("scorers", {})
    rest = lambda s: {k: v for k, v in s.items() if k != "scorers"}
    same = rest(stored) == rest(settings) and all(theirs.get(kind) == weights for kind, weights in ours.items())
    return stored if same else settings


def run_sweep(
    model,
    examples: Sequence[Example],
    config: SweepConfig,
    results_path,
    progress: bool = True,
    mesh=None,
    share: tuple[int, int] = (0, 1),
    write: bool = True,
) -> ResultsFile:
    """Runs every pending answer of the sweep, appending to results_path (resumes a partial file of the same
    settings; raises results.SweepMismatchError for a file of other settings or other examples).
    mesh: default sharding.data_mesh(); every batch is padded to a multiple of its data axis. share (index, count):
    only process index of count's batches (share_of), into its own results_path (results.results_name);
    results.merge joins the shares. A mesh over several processes' devices (jax.distributed) runs one replica: every
    process runs the whole sweep in lockstep, reading the same results_path (a shared filesystem), and only the one
    given write=True writes it."""
    index, count = process_share(*share)
    settings = reading_fewer_scorers(stored_settings(results_path), config.settings(model))
    results = ResultsFile(results_path, settings, write=write)
    mesh = mesh or sharding.data_mesh()
    if len({d.process_index for d in mesh.devices.flat}) > 1:
        check_lockstep(results)
    sweep = Sweep(model, config, results, mesh, fingerprint=results.fingerprint)  # a method's misfit named here
    items = prepare(model.tokenizer, examples, config.instruction)
    capacity = capacity_for(items)  # the whole sweep's, whatever the share
    groups = share_of(groups_of(items, config.batch_size), index, count)
    for ex, _, _ in (item for group in groups for item in group):
        results.check_example(ex.task, ex.id, example_hash(ex))
    multiple = sharding.batch_multiple(mesh)
    batches = [padded(group, -(-config.batch_size // multiple) * multiple) for group in groups]
    bar = _progress_bar(progress)
    sweep.on_answers = bar.update
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


def _progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(total=0, unit="answer", disable=not enabled, dynamic_ncols=True)
