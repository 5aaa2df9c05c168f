"""A trained scorer as one pytree: its kind, its static configuration and its per-layer weights, with the score of
one layer's attention input.

Kinds: "gate" (Fast KVzip's low-rank sink-attention gate: scores in (0, 1), trained on KVzip's scores) and "linear"
(KVzap's ridge regressor: log-space scores, fitted to log KVzip+ scores).

Einsum legend: L layers, B batch, T tokens, K KV heads, D model width.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kvzip_jax.errors import KvzipError
from kvzip_jax.scorers import gate, linear

KINDS = ("gate", "linear")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scorer:
    """kind (static), config (static: gate.GateConfig for a gate, None for linear) and params (every leaf stacked
    over the model's L layers)."""

    params: Any
    kind: str = dataclasses.field(metadata=dict(static=True))
    config: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scorer kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def num_layers(self) -> int:
        return jax.tree.leaves(self.params)[0].shape[0]

    def layer_scores(self, layer: int, hidden: jax.Array) -> jax.Array:
        """[B, K, T] float32 scores of hidden [B, T, D] (the layer's normed attention input)."""
        params = jax.tree.map(lambda x: x[layer], self.params)
        hidden = hidden.astype(jnp.float32)
        if self.kind == "gate":
            return gate.gate_scores(params, self.config, hidden)
        return linear.linear_scores(params, hidden)


class ScorerMissingError(KvzipError, FileNotFoundError):
    """No trained scorer of the kind a method reads for this model, where one is looked for."""


BUNDLED = Path(__file__).resolve().parents[1] / "data" / "scorers"  # kvzip_jax/data/scorers/<model>/<kind>


def scorer_dirs(model_name: str, kind: str, checkpoints: str | os.PathLike) -> list[Path]:
    """Where a scorer is looked for, in order: <checkpoints>/<model>/scorers/<kind> (train-scorer's default), then
    the package's bundled kvzip_jax/data/scorers/<model>/<kind>."""
    return [Path(checkpoints) / model_name / "scorers" / kind, BUNDLED / model_name / kind]


def load(model, kind: str, directory: str | os.PathLike | None = None, checkpoints=None) -> Scorer:
    """The `kind` scorer of a loaded model (weights.LoadedModel): from `directory`, else the first of scorer_dirs.
    ScorerMissingError when there is none; store.ScorerMismatchError when it was trained for another model (name,
    config hash or weights)."""
    from kvzip_jax.scorers import store
    from kvzip_jax.weights.identity import model_identity
    from kvzip_jax.weights.registry import default_checkpoints_dir

    if directory is None:
        tried = scorer_dirs(model.name, kind, checkpoints or default_checkpoints_dir())
        directory = next((d for d in tried if (d / store.MANIFEST).is_file()), None)
        if directory is None:
            raise ScorerMissingError(
                f"no {kind} scorer for {model.name} (looked in {', '.join(map(str, tried))}); train one with "
                f"`kvzip-jax train-scorer --model {model.name} --kind {kind}`"
            )
    identity = model_identity(model.cfg, model.params)
    found, params, manifest = store.load_scorer(directory, model=model.name, model_config=identity["config"])
    if manifest.get("model_params") not in (None, identity["params"]):
        raise store.ScorerMismatchError(
            f"the scorer at {directory} was trained on other weights of {model.name} (fingerprint "
            f"{manifest['model_params']}, these are {identity['params']})"
        )
    if found != kind:
        raise store.ScorerMismatchError(f"the scorer at {directory} is a {found} scorer, not a {kind} one")
    config = gate.GateConfig(**manifest["config"]) if kind == "gate" else None
    return Scorer(params, kind, config)
