"""The import direction of ``src/stoker`` and ``src/stoker_lab`` (see docs/design.md): a module
imports only from layers at or above its own, no import cycle exists between modules, and the
product (``stoker``) never imports the lab (``stoker_lab``).

Layers, top (imported by everything) to bottom (imports everything)::

    errors, _units, _procs, _torch, _atomic  ->  storage (+ _native_s3)  ->  cache  ->  store
        ->  order, decode, metrics, collate  ->  loader  ->  cluster  ->  cli
        ->  the lab: stoker_lab (errors, sample_data)  ->  stoker_lab.sim, stoker_lab.bench
        ->  stoker_lab.cli

Imports are read with :mod:`ast`, including the ones inside functions, so a cycle that
"works" only because both imports are deferred is still caught.
"""
from __future__ import annotations

import ast
import pathlib

SRC_ROOT = pathlib.Path(__file__).resolve().parents[1] / "src"
SRC = SRC_ROOT / "stoker"
LAB = SRC_ROOT / "stoker_lab"
PACKAGES = ("stoker", "stoker_lab")

LAYERS = [
    {"stoker.errors", "stoker._units", "stoker._procs", "stoker._torch", "stoker._atomic", "stoker"},
    {"stoker.storage", "stoker._native_s3"},
    {"stoker.cache"},
    {"stoker.store"},
    {"stoker.order", "stoker.decode", "stoker.metrics", "stoker.collate"},
    {"stoker.loader"},
    {"stoker.cluster"},
    {"stoker.cli"},
    {"stoker_lab", "stoker_lab.errors", "stoker_lab.sample_data"},
    {"stoker_lab.sim", "stoker_lab.bench"},
    {"stoker_lab.cli"},
]


def _layer(module: str) -> int:
    """Layer index of a dotted module name ("stoker.cache.disk" -> 2, "stoker_lab.sim.model" -> 9)."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: not in any layer of tests/test_layers.py; add it to LAYERS")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for root in (SRC, LAB):
        for p in root.rglob("*.py"):
            rel = p.relative_to(SRC_ROOT).with_suffix("")
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
            found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    if unresolved is not None:
                        unresolved.append(f"{name}: line {node.lineno} imports beyond its top-level package")
                    continue
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] not in PACKAGES:
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
        if name in PACKAGES:  # a package face re-exports from every layer
            continue
        for d in deps:
            if d in PACKAGES:
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
            if d in PACKAGES or (d.count(".") and n.startswith(d + ".")):
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


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_the_product_never_imports_the_lab():
    """``pip install stoker`` works without the lab: no module of ``stoker`` imports ``stoker_lab``,
    nor names it in a string outside docstrings (a module name given to importlib, say)."""
    bad = []
    for p in SRC.rglob("*.py"):
        tree = ast.parse(p.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                names = [node.value]
            if any("stoker_lab" in n for n in names):
                bad.append(f"{p.relative_to(SRC_ROOT)}:{node.lineno}")
    assert bad == []
