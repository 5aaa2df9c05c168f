"""The methods registry: every compression method is one Method entry, found by name.

    method = methods.get("snapkv")
    compressed = jax.jit(method.compress)(params, cfg, cache, inputs, 0.3)   # ratio static where method.static_ratio

A method runs in two steps, so that one scoring pass serves every ratio: prepare (ratio-independent: scores,
reference queries) and finish (per ratio: a masked or compacted cache). compress is the two together. What a method
reads beyond the model and the cache comes in one Inputs pytree; the method names the fields it needs (they must be
given) and the ones it uses when given (work already done elsewhere, such as scores from a shared reread pass).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvzip_jax.errors import KvzipError

FAMILIES = {
    "eviction": "context pairs scored, the lowest evicted (a masked cache)",  # family: what it does
    "compaction": "keys selected, their values and a per-key bias fitted (a compacted cache)",
}
INPUTS = ("reread", "context_tokens", "question", "key", "probes", "queries", "kvzip_scores", "scorer")


class MethodError(KvzipError, ValueError):
    """An unknown method, a name registered twice, an unknown option, or an input a method needs left out."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a method may read beside the model and the cache: rows whose caches hold [prefix | context].

    prefix_len, context_len [B] int32 always; the rest None unless given:
      reread          kvzip.RereadInputs of the contexts (KVzip's reread, Attention Matching's repeat queries)
      context_tokens  [B, n] int32 right-padded context ids (the baselines' replay)
      question        (tokens [B, Tq], lengths [B]): the observation window after the context (query-aware methods)
      key             [B] PRNG keys, one per row (random scores)
      probes          matching.Probes: self-study turns, Attention Matching's second query source
      queries         matching.ReferenceQueries already captured (a sweep shares one pass between methods)
      kvzip_scores    [L, B, K, n] KVzip's scores already computed (softmax, no KVzip+)
      scorer          scorers.Scorer: a trained scorer's weights (the methods that score without a reread)
    """

    prefix_len: jax.Array
    context_len: jax.Array
    reread: Any = None
    context_tokens: jax.Array | None = None
    question: tuple[jax.Array, jax.Array] | None = None
    key: jax.Array | None = None
    probes: Any = None
    queries: Any = None
    kvzip_scores: jax.Array | None = None
    scorer: Any = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a method that has none."""


@dataclasses.dataclass(frozen=True)
class Method:
    """One compression method.

    prepare(params, cfg, cache, inputs, options) -> state: the ratio-independent work (a pytree);
    finish(params, cfg, cache, inputs, state, ratio, options) -> the compressed cache at `ratio` (fraction of
    context pairs kept, in (0, 1]); static_ratio: the ratio sets array shapes (jit it as static);
    eager: finish runs its own jitted steps (jit the whole of it only at the cost of one large compilation);
    resolve(options, model_name, cfg) -> options: fills in what depends on the model (a budget profile) and refuses
    options the model cannot take, before any work.
    """

    name: str
    family: str
    question_aware: bool
    paper: str
    description: str
    options: Any
    prepare: Callable
    finish: Callable
    needs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    static_ratio: bool = False
    eager: bool = False
    resolve: Callable | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise MethodError(f"{self.name}: family must be one of {tuple(FAMILIES)}, got {self.family!r}")
        unknown = set(self.needs + self.uses) - set(INPUTS)
        if unknown:
            raise MethodError(f"{self.name}: unknown inputs {sorted(unknown)}; choose from {INPUTS}")

    @property
    def reads(self) -> tuple[str, ...]:
        """Every Inputs field it reads: needed, then used when given."""
        return self.needs + tuple(name for name in self.uses if name not in self.needs)

    def compress(self, params, cfg, cache, inputs: Inputs, ratio, options=None):
        """The compressed cache of `cache` at `ratio`: prepare, then finish (options: default self.options)."""
        options = self.options if options is None else options
        state = self.prepare(params, cfg, cache, self.checked(inputs), options)
        return self.finish(params, cfg, cache, inputs, state, ratio, options)

    def checked(self, inputs: Inputs) -> Inputs:
        """inputs, or MethodError naming the needed fields left out."""
        missing = [name for name in self.needs if getattr(inputs, name) is None]
        if missing:
            raise MethodError(f"{self.name} needs the input(s) {', '.join(missing)} (methods.Inputs)")
        return inputs

    def options_for(self, model_name: str | None = None, cfg=None, **changes):
        """The options with `changes` applied (MethodError for a field it does not have), completed for the model
        (resolve)."""
        names = set(self.option_defaults())
        unknown = sorted(set(changes) - names)
        if unknown:
            raise MethodError(f"{self.name} has no option(s) {unknown}; its options are {sorted(names)}")
        options = dataclasses.replace(self.options, **changes)
        return options if self.resolve is None else self.resolve(options, model_name, cfg)

    def option_defaults(self) -> dict:
        """{name: default} of its options (a ratio field is compress's argument, not an option)."""
        return {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options) if f.name != "ratio"}

    @property
    def jitted_prepare(self) -> Callable:
        """prepare, jitted, its inputs checked first (the sweep and the CLI call it, not compress)."""
        jitted = _jitted(self.prepare, ())
        return lambda params, cfg, cache, inputs, options: jitted(params, cfg, cache, self.checked(inputs), options)

    @property
    def jitted_finish(self) -> Callable:
        """finish, jitted (ratio static where it sets shapes; left as it is when eager); a traced ratio goes in as
        a float32 array, so one compilation serves every ratio."""
        if self.eager:
            return self.finish
        if self.static_ratio:
            return _jitted(self.finish, ("ratio",))
        jitted = _jitted(self.finish, ())
        return lambda params, cfg, cache, inputs, state, ratio, options: jitted(
            params, cfg, cache, inputs, state, jnp.float32(ratio), options
        )


@functools.cache
def _jitted(function: Callable, static: tuple[str, ...]) -> Callable:
    return jax.jit(function, static_argnames=static)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Adds a method (MethodError if its name is taken); returns it."""
    if method.name in _REGISTRY:
        raise MethodError(f"a method named {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Removes a method (a test's own, once it is done)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Method:
    """The method of that name; MethodError listing the names otherwise."""
    if name not in _REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose from {', '.join(names())}")
    return _REGISTRY[name]


def parse_spec(spec: str) -> tuple[Method, dict]:
    """(method, option changes) of a method spec: a name, or a name with options, "NAME:OPTION=VALUE[:...]" (e.g.
    "kvzap:threshold=-4", "kvzip:level=layer"); values read as Python literals, else as text. MethodError for an
    unknown name or option, or a malformed part."""
    import ast

    name, *parts = spec.split(":")
    method = get(name.strip())
    changes = {}
    for part in parts:
        option, sep, text = part.partition("=")
        if not sep or not option.strip():
            raise MethodError(f"{spec!r}: options go as NAME:OPTION=VALUE, got {part!r}")
        try:
            changes[option.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            changes[option.strip()] = text.strip()
    unknown = sorted(set(changes) - set(method.option_defaults()))
    if unknown:
        raise MethodError(
            f"{spec!r}: {method.name} has no option(s) {unknown}; its options are {sorted(method.option_defaults())}"
        )
    return method, changes


def method_of(spec: str) -> Method:
    """The method a spec names (parse_spec)."""
    return parse_spec(spec)[0]


def names() -> tuple[str, ...]:
    """Every registered name, family by family (FAMILIES' order), each in registration order."""
    return tuple(sorted(_REGISTRY, key=lambda name: list(FAMILIES).index(_REGISTRY[name].family)))


def table() -> str:
    """The registry as a markdown table: name, family, question-aware, paper, description."""
    rows = [("method", "family", "sees the question", "paper", "what it does"), ("---",) * 5]
    rows += [
        (f"`{m.name}`", m.family, "yes" if m.question_aware else "no", m.paper, m.description)
        for m in map(get, names())
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
