"""The package layering stays clean, read from the source with ast (no jax, nothing imported): every unit of
kvzip_jax/ (a top-level module or a subpackage) and pallas_kernels/ has a layer (design.md's Layout, as the code
stands), and imports only from units of lower layers; no module-level import cycle between modules; no module over
400 lines.

Which imports count: for the layers, every import, module-level or inside a function (deferring an import keeps the
dependency; it must not be a way around the layering). For cycles, module-level imports only (`if TYPE_CHECKING:`
blocks excepted, which never run): those run at import time, where a cycle breaks or depends on import order; a
function-level import runs once everything is loaded. Within one unit, modules may import each other in any
direction, acyclically.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvzip_jax", "pallas_kernels")
MAX_LINES = 400

# Lower imports nothing above it, nor anything beside it in its own layer: each layer uses only those below.
LAYERS = (
    ("pallas_kernels", "kvzip_jax.errors", "kvzip_jax.kv_bits"),  # pallas_kernels imports nothing from kvzip_jax
    ("kvzip_jax.dtypes", "kvzip_jax.config", "kvzip_jax.quant", "kvzip_jax.prompts"),
    ("kvzip_jax.cache",),
    ("kvzip_jax.sharding",),  # mesh and partition rules: nothing from models/
    ("kvzip_jax.models",),
    ("kvzip_jax.weights", "kvzip_jax.generate", "kvzip_jax.memory_plan"),
    ("kvzip_jax.kvzip", "kvzip_jax.cache_io"),
    ("kvzip_jax.serving",),  # a cache in an engine's pages, decoded there, saved under cache_io's rules
    ("kvzip_jax.baselines",),  # they reuse kvzip's observation and budgets
    ("kvzip_jax.matching",),
    ("kvzip_jax.scorers",),  # trained scorers: their models, features (the forward's observer) and training data
    ("kvzip_jax.methods",),  # the registry of every method: kvzip, baselines, matching
    ("kvzip_jax.eval",),
    ("kvzip_jax.cli", "kvzip_jax.demo", "kvzip_jax"),  # kvzip_jax: the package's own __init__, its public face
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    """Every module of the two packages by dotted name (a package by its __init__'s)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _unit(module: str) -> str:
    """The unit a module belongs to: pallas_kernels as a whole; in kvzip_jax, the top-level module or subpackage."""
    parts = module.split(".")
    return parts[0] if parts[0] == "pallas_kernels" else ".".join(parts[:2])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported module of the two packages, whether the import runs when the module loads, line) for each import;
    `from a.b import c` names a.b.c when that is a module, else a.b; relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, at_load, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                for alias in child.names:
                    name = f"{source}.{alias.name}"
                    found.append((name if name in MODULES else source, at_load, child.lineno))
            inside = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and _is_type_checking(child)
            )
            visit(child, at_load and not inside)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return [(name, at_load, line) for name, at_load, line in found if name.split(".")[0] in PACKAGES]


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_unit_has_a_layer():
    missing = sorted({_unit(module) for module in MODULES} - set(RANK))
    assert not missing, f"give each new module or subpackage a layer in tests/test_layering.py's LAYERS: {missing}"


def test_imports_go_only_to_lower_layers():
    upward = []
    for module, imports in IMPORTS.items():
        here = _unit(module)
        for name, _, line in imports:
            there = _unit(name)
            if there != here and here in RANK and there in RANK and RANK[there] >= RANK[here]:
                upward.append(
                    f"{_where(module, line)}: {here} (layer {RANK[here]}) imports {name} (layer {RANK[there]})"
                )
    assert not upward, "imports at or above the importer's layer:\n" + "\n".join(upward)


def test_pallas_kernels_imports_nothing_from_kvzip_jax_and_sharding_nothing_from_models():
    offenders = [
        f"{_where(module, line)}: {name}"
        for module, imports in IMPORTS.items()
        for name, _, line in imports
        if (module.startswith("pallas_kernels") and name.startswith("kvzip_jax"))
        or (_unit(module) == "kvzip_jax.sharding" and _unit(name) == "kvzip_jax.models")
    ]
    assert not offenders, "\n".join(offenders)


def test_no_module_level_import_cycle():
    graph = {
        module: sorted({name for name, at_load, _ in imports if at_load and name != module and name in MODULES})
        for module, imports in IMPORTS.items()
    }
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for name in graph[module]:
            if state.get(name) == 1:
                cycles.append(" -> ".join(path[path.index(name) :] + [name]))
            elif name not in state:
                walk(name, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    assert not cycles, "module-level import cycles:\n" + "\n".join(cycles)


def test_no_module_is_over_400_lines():
    long = {
        str(path.relative_to(ROOT)): count
        for path in MODULES.values()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_the_checks_see_the_packages():
    """A guard on the checks themselves: the parser finds the modules and the imports the layers are about."""
    assert {"kvzip_jax.config", "kvzip_jax.models.attention", "pallas_kernels.dispatch"} <= set(MODULES)
    assert ("kvzip_jax.errors", True) in {(name, at_load) for name, at_load, _ in IMPORTS["kvzip_jax.config"]}
    assert any(_unit(name) == "kvzip_jax.eval" and not at_load for name, at_load, _ in IMPORTS["kvzip_jax.cli.eval"])
