"""Every compression method, one registry entry each (registry.py): KVzip and the baselines of its paper
(eviction.py), the trained scorers' (trained.py), Attention Matching's variants (compaction.py).

    method = methods.get("kvzip")
    inputs = methods.Inputs(reread.prefix_len, reread.context_len, reread=reread)
    masked = jax.jit(method.compress)(params, cfg, cache, inputs, 0.3)
    print(methods.table())                                    # name, family, question-aware, paper, description
"""

from kvzip_jax.methods import compaction, eviction, trained
from kvzip_jax.methods.registry import (
    FAMILIES,
    INPUTS,
    Inputs,
    Method,
    MethodError,
    NoOptions,
    get,
    method_of,
    names,
    parse_spec,
    register,
    table,
    unregister,
)

__all__ = [
    "FAMILIES",
    "INPUTS",
    "Inputs",
    "Method",
    "MethodError",
    "NoOptions",
    "compaction",
    "eviction",
    "get",
    "method_of",
    "names",
    "parse_spec",
    "register",
    "table",
    "trained",
    "unregister",
]
