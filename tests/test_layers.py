"""The import direction of ``src/stoker`` (see docs/design.md): a module imports only from
layers at or above its own, and no import cycle exists between modules.

Layers, top (imported by everything) to bottom (imports everything)::

    errors, _units, _procs, _torch, _atomic  ->  storage (+ _native_s3)  ->  cache  ->  store
        ->  order, decode, metrics, collate  ->  loader  ->  cluster  ->  bench  ->  cli

Imports are read with :mod:`ast`, including the ones inside functions, so a cycle that
"works" only because both imports are deferred is still caught.
"""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "stoker"

LAYERS = [
    {"errors", "_units", "_procs", "_torch", "_atomic", "__init__"},
    {"storage", "_native_s3"},
    {"cache"},
    {"store"},
    {"order", "decode", "metrics", "collate"},
    {"loader"},
    {"cluster"},
    {"bench", "sample_data", "sim"},  # sample_data: the old path of bench.sample_data, a re-export
    {"cli"},
]


def _layer(module: str) -> int:
    """Layer index of a dotted module name under ``stoker`` ("stoker.cache.disk" -> 2)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not in any layer of tests/test_layers.py; add it to LAYERS")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        out[name] = p
    return out


def _imports(name: str, path: pathlib.Path, known: set[str], unresolved: list | None = None) -> set[str]:
    """Modules of stoker that ``name`` imports (absolute or relative, at any depth); a stoker
    module that does not exist is appended to ``unresolved``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "stoker")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "stoker":
                continue
            if mod not in known and unresolved is not None:
                unresolved.append(f"{name}: line {node.lineno} imports {mod}, which does not exist")
            for a in node.names:  # "from . import x" may name a submodule
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in known else mod)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_every_stoker_import_resolves():
    """Deferred imports (inside functions) of a moved module fail only when the function runs."""
    mods = _modules()
    unresolved: list[str] = []
    for n, p in mods.items():
        _imports(n, p, set(mods), unresolved)
    assert not unresolved, "\n".join(unresolved)


def test_imports_run_down_the_layers():
    bad = []
    for name, deps in _graph().items():
        if name == "stoker":  # the package face re-exports from every layer
            continue
        for d in deps:
            if d == "stoker":
                bad.append(f"{name} imports the package face 'stoker' (import the defining module instead)")
            elif _layer(d) > _layer(name):
                bad.append(f"{name} (layer {_layer(name)}) imports {d} (layer {_layer(d)})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if d == "stoker" or (d.count(".") and n.startswith(d + ".")):
                continue  # a package's own __init__ is imported on the way to its submodules
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_top_level_is_small():
    tops = sorted(p.name for p in SRC.glob("*.py"))
    assert len(tops) <= 10, f"src/stoker/ has {len(tops)} top-level modules: {tops}"
