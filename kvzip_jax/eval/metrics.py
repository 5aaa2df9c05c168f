"""Answer metrics (KVzip results/metric.py, adapted from SCBench; RULER's string matches) and the full-vs-compressed
next-token divergence.

Every text metric takes one prediction and the reference strings of its question and returns a float in [0, 1];
`score` dispatches on the Example.metric names (kvzip_jax.eval.tasks.base.METRICS).
"""

from __future__ import annotations

import collections
import functools
import re
import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvzip_jax.eval.tasks.base import METRICS

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGITS = {
    w: str(i) for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"))
}
_NUMBER_WORDS = re.compile(r"\b(" + "|".join(_DIGITS) + r")\b")


def normalize(text: str) -> str:
    """Lowercase, strip punctuation, drop articles, collapse whitespace, number words zero..nine -> digits."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return _NUMBER_WORDS.sub(lambda m: _DIGITS[m.group()], " ".join(text.split()))


def _check(references: Sequence[str]) -> None:
    if isinstance(references, str) or not references:
        raise ValueError(f"references must be a non-empty sequence of strings, got {references!r}")


def inclusion(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any normalised reference is a substring of the normalised prediction."""
    _check(references)
    pred = normalize(prediction)
    return float(any(normalize(r) in pred for r in references))


def all_included(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the normalised references contained in the normalised prediction (variable tracking)."""
    _check(references)
    pred = normalize(prediction)
    return sum(normalize(r) in pred for r in references) / len(references)


def exact_match(prediction: str, references: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised reference."""
    _check(references)
    pred = normalize(prediction)
    return float(any(normalize(r) == pred for r in references))


def _f1(pred_tokens: list[str], ref_tokens: list[str]) -> float:
    same = sum((collections.Counter(pred_tokens) & collections.Counter(ref_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, references: Sequence[str]) -> float:
    """SQuAD token F1 between normalised whitespace tokens, max over references."""
    _check(references)
    pred = normalize(prediction).split()
    return max(_f1(pred, normalize(r).split()) for r in references)


@functools.cache
def _rouge_scorer():
    from rouge_score import rouge_scorer  # imported on first use: only summary-style tasks need it

    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-L F-measure (rouge_score's tokenizer: lowercase alphanumeric tokens, no stemming), max over references."""
    _check(references)
    return max(_rouge_scorer().score(r, prediction)["rougeL"].fmeasure for r in references)


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's cleaning of a prediction before scoring: stripped, every control character (\\x00-\\x1f) made a
    newline, stripped again."""
    return _CONTROL_CHARACTERS.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's string_match_all for one prediction: the fraction of references that occur, lower-cased, in the
    lower-cased RULER-cleaned prediction (no other normalisation)."""
    _check(references)
    pred = ruler_postprocess(prediction).lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's string_match_part for one prediction: 1.0 if any reference occurs, lower-cased, in the lower-cased
    RULER-cleaned prediction."""
    _check(references)
    pred = ruler_postprocess(prediction).lower()
    return max(1.0 if r.lower() in pred else 0.0 for r in references)


def ruler_task_score(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """A RULER task's reported score: 100 x the mean of the per-prediction metric ("string_match_all" or
    "string_match_part") over the task's samples, rounded to 2 decimals."""
    scorers = {"string_match_all": string_match_all, "string_match_part": string_match_part}
    if metric not in scorers:
        raise ValueError(f"metric must be one of {tuple(scorers)}, got {metric!r}")
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as reference lists (>= 1): {len(predictions)}, {len(references)}")
    return round(sum(map(scorers[metric], predictions, references)) / len(predictions) * 100, 2)


_SCORERS = {
    "inclusion": inclusion,
    "all": all_included,
    "exact": exact_match,
    "f1": token_f1,
    "rouge": rouge_l,
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """The named metric of one prediction; a blank prediction scores 0.0 whatever the metric (as in KVzip)."""
    if metric not in _SCORERS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    if not prediction.strip():
        _check(references)
        return 0.0
    return _SCORERS[metric](prediction, references)


def next_token_divergence(
    full_logits: jax.Array, compressed_logits: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per-row mean KL(softmax(full) || softmax(compressed)) and argmax-flip rate over the valid positions.

    full_logits, compressed_logits: [B, T, V] logits of the same teacher-forced tokens under the full and the
    compressed cache; valid: [B, T] bool. Returns (kl [B], flip [B]) float32; a row without a valid position gives 0.
    """
    return divergence_from(log_probs(full_logits), compressed_logits, valid)


def log_probs(logits: jax.Array) -> jax.Array:
    """float32 log-softmax over the last axis: the reference side of divergence_from, computed once per question."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def divergence_from(
    full_log_probs: jax.Array, compressed_logits: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """next_token_divergence with the full side given as log_probs(full_logits) [B, T, V]: a sweep computes it once
    per question and reuses it for every compressed cache."""
    if full_log_probs.shape != compressed_logits.shape or full_log_probs.ndim != 3:
        raise ValueError(f"logits must both be [B, T, V], got {full_log_probs.shape} and {compressed_logits.shape}")
    if valid.shape != full_log_probs.shape[:2]:
        raise ValueError(f"valid must be [B, T] = {full_log_probs.shape[:2]}, got {valid.shape}")
    logp = full_log_probs
    logq = log_probs(compressed_logits)
    p = jnp.exp(logp)
    # p == 0 terms contribute 0 (avoids 0 * (-inf - -inf) = NaN for masked vocabulary entries).
    kl = jnp.maximum(jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1), 0.0)  # [B, T]
    flip = (jnp.argmax(logp, axis=-1) != jnp.argmax(logq, axis=-1)).astype(jnp.float32)
    valid = valid.astype(bool)
    count = jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(jnp.float32)  # [B]
    return jnp.sum(jnp.where(valid, kl, 0.0), -1) / count, jnp.sum(jnp.where(valid, flip, 0.0), -1) / count
