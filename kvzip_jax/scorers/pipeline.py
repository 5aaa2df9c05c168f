"""Training a scorer end to end, each stage resumable in one data folder (data.py's layout): the model writes texts,
each text's features are extracted, the scorer is fitted on all but the last texts and measured on those.

Einsum legend: L layers, N tokens, n context columns, K KV heads, D model width.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvzip_jax.scorers import data, extract, gate, linear, train
from kvzip_jax.scorers.features import context_scores
from kvzip_jax.scorers.scorer import Scorer

Progress = Callable[[int, int], None]
TARGETS = {"gate": "kvzip", "linear": "log_kvzip_plus"}  # what each kind learns


def ensure_texts(
    model, folder, count: int, batch: int, max_new_tokens: int, seed: int, progress: Progress, prompt_set: str = "prose"
) -> None:
    """texts.jsonl holds at least `count` texts answering prompt_set's prompts (data.writing_prompts): the missing
    ones written `batch` at a time, each batch seeded by how many texts were written before it; a blank answer is
    not kept (its prompt comes again, newly sampled)."""
    data.check_prompt_set(folder, prompt_set)
    prompts = data.writing_prompts(count, prompt_set)
    done = len(data.read_texts(folder))
    for attempt in range(3 * count):  # a model that keeps answering nothing fails below
        progress(min(done, count), count)
        if done >= count:
            return
        writing = prompts[done : done + batch]
        for prompt, text in zip(writing, extract.write_texts(model, writing, max_new_tokens, seed + done + attempt)):
            if text:
                data.append_text(folder, prompt, text)
        done = len(data.read_texts(folder))
    raise data.ScorerDataError(f"the model wrote {done} non-blank texts of {count} in {3 * count} batches")


def adopt_texts(folder, source, count: int) -> None:
    """Seeds texts.jsonl with the first `count` texts of another data folder (or its texts.jsonl), such as another
    model's, so that this model reads them instead of writing its own; a folder already seeded must hold the same."""
    source_folder = data.folder_of(source)
    theirs = data.read_texts(source_folder)[:count]
    if len(theirs) < count:
        raise data.ScorerDataError(f"{source} holds {len(theirs)} texts, fewer than the {count} asked for")
    ours = data.read_texts(folder)
    held = min(len(ours), count)
    if ours[:held] != theirs[:held]:
        raise data.ScorerDataError(f"{folder} holds other texts than {source}: give another --data folder")
    data.check_prompt_set(folder, data.prompt_set_of(source_folder))
    for record in theirs[held:]:
        data.append_text(folder, record["prompt"], record["text"])


def ensure_features(model, folder, count: int, tokens_per_text: int, seed: int, progress: Progress) -> None:
    """features/NNNNN.npz for the first `count` texts (the missing ones computed)."""
    texts = data.read_texts(folder)[:count]
    for index, record in enumerate(texts):
        path = data.feature_path(folder, index)
        if not path.exists():
            data.save_features(path, **extract.text_features(model, record["text"], tokens_per_text, seed + index))
        progress(index + 1, len(texts))


def fit(model, folder, kind: str, train_indices, steps: int, batch: int, seed: int, progress: Progress):
    """(Scorer, report) fitted on the sampled tokens of the texts at train_indices: a gate by train.train_gates on
    KVzip's scores, a linear scorer by ridge on log KVzip+ scores."""
    start = time.perf_counter()
    x, y = data.training_arrays(folder, train_indices, TARGETS[kind])  # [L, N, D], [L, N, K]
    report = {"train_tokens": int(x.shape[1])}
    if kind == "linear":
        params = linear.fit_linear_scorers(x, y)
        scorer = Scorer(params, "linear")
        report["train_loss"] = float(linear.linear_loss(params, jnp.asarray(x), jnp.asarray(y)))
    else:
        cfg = model.cfg
        config = gate.GateConfig(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads)
        watch = np.zeros(x.shape[1], bool)  # every 100th token watches the training (the paper's split)
        watch[::100] = True
        params, history = train.train_gates(
            config, x[:, ~watch], y[:, ~watch], x[:, watch], y[:, watch], steps, batch, seed, progress
        )
        scorer = Scorer(params, "gate", config)
        report["history"] = history
        report["train_loss"] = history[-1]["train_loss"]
    report["fit_seconds"] = time.perf_counter() - start
    return scorer, report


def held_out(model, folder, scorer: Scorer, indices) -> dict:
    """The scorer on held-out texts: its loss on their sampled tokens, and the share of KVzip's top 30% pairs of
    each whole text that the scorer's top 30% keeps too (averaged over the texts)."""
    x, y = data.training_arrays(folder, indices, TARGETS[scorer.kind])
    if scorer.kind == "linear":
        loss = float(linear.linear_loss(scorer.params, jnp.asarray(x), jnp.asarray(y)))
    else:
        loss, _ = train.evaluate_gates(scorer.params, scorer.config, x, y)
    overlaps = []
    score = jax.jit(context_scores)
    for index in indices:
        ids, prefix_len, context = extract.context_of(model, data.read_texts(folder)[index]["text"])
        cache = extract.prefilled(model, ids)
        predicted = score(
            model.params,
            model.cfg,
            cache,
            jnp.array([prefix_len]),
            jnp.array([len(context)]),
            jnp.asarray(context[None], jnp.int32),
            scorer,
        )  # [L, 1, K, n]
        reference = data.load_features(data.feature_path(folder, index))["kvzip"]  # [L, K, n]
        overlaps.append(data.top_overlap(np.asarray(predicted)[:, 0], reference))
    return {
        "held_out_texts": len(indices),
        "held_out_tokens": int(x.shape[1]),
        "held_out_loss": float(loss),
        "top30_overlap": float(np.mean(overlaps)),
    }
