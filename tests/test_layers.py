"""The import direction of ``src/stoker`` and ``src/stoker_lab`` (see docs/design.md): a module
imports only from layers at or above its own, no import cycle exists between modules, and the
product (``stoker``) never imports the lab (``stoker_lab``).

Layers, top (imported by everything) to bottom (imports everything)::

    errors, _units, _procs, _torch, _atomic  ->  storage (+ _native_s3)  ->  cache  ->  store
        ->  order, decode, metrics, collate  ->  loader  ->  cluster, ray_data  ->  cli
        ->  the lab: stoker_lab (errors, sample_data)  ->  stoker_lab.sim, stoker_lab.bench
        ->  stoker_lab.cli

Inside ``loader`` and ``cluster`` the subfolders keep an order of their own (``SUBLAYERS``): the
loader's base modules -> workers/ -> prefetch/ -> device/ -> pipeline/ -> the Loader; the
cluster's base modules -> service/ -> jobs/ -> train/ -> extender/.

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
    {"stoker.errors", "stoker._units", "stoker._names", "stoker._procs", "stoker._torch", "stoker._atomic", "stoker"},
    {"stoker.storage", "stoker._native_s3"},
    {"stoker.cache"},
    {"stoker.store"},
    {"stoker.order", "stoker.decode", "stoker.metrics", "stoker.collate"},
    {"stoker.loader"},
    {"stoker.cluster", "stoker.ray_data"},
    {"stoker.cli"},
    {"stoker_lab", "stoker_lab.errors", "stoker_lab.sample_data", "stoker_lab.reference", "stoker_lab.decode_rate"},
    {"stoker_lab.sim", "stoker_lab.bench"},
    {"stoker_lab.cli"},
]


#: The order inside a package whose modules sit in subfolders by role: each entry is a set of
#: third parts of a module name (a subfolder, or a module at the package's own level).
SUBLAYERS = {
    "stoker.loader": [
        {
            "options",
            "dataloader_args",
            "state",
            "epoch_stats",
            "iterator",
            "world",
            "derived",
            "shm",
            "adapters",
            "mixture",
        },
        {"workers"},
        {"prefetch"},
        {"device"},
        {"pipeline"},
        {"mixed"},
        {"loader", "live"},
    ],
    "stoker.cluster": [
        {"placement", "membership", "identity", "capacity", "schedule", "counters", "registration"}
        | {"freshness", "handoff", "settings"},
        {"service"},
        {"jobs"},
        {"train"},
        {"extender"},
    ],
}


def _sublayer(module: str) -> int | None:
    """Index of ``module`` in its package's ``SUBLAYERS`` ("stoker.loader.prefetch.loop" -> 2), or
    None for a module outside those packages or the package face itself."""
    parts = module.split(".")
    order = SUBLAYERS.get(".".join(parts[:2]))
    if order is None or len(parts) < 3:
        return None
    for i, names in enumerate(order):
        if parts[2] in names:
            return i
    raise AssertionError(f"{module}: not in SUBLAYERS of tests/test_layers.py; add it there")


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


def test_imports_run_down_the_sublayers():
    """Inside loader/ and cluster/, a module imports only from its own role folder or those above it."""
    bad = []
    for name, deps in _graph().items():
        mine = _sublayer(name)
        if mine is None:
            continue
        for d in deps:
            theirs = _sublayer(d)
            if theirs is not None and d.split(".")[:2] == name.split(".")[:2] and theirs > mine:
                bad.append(f"{name} (sublayer {mine}) imports {d} (sublayer {theirs})")
    assert not bad, "imports against the subfolders' order:\n" + "\n".join(sorted(bad))


def test_no_product_module_name_repeats():
    """Each module file name of the product is its own (one meaning to a file name)."""
    seen: dict[str, list[str]] = {}
    for p in SRC.rglob("*.py"):
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(str(p.relative_to(SRC)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


def test_every_product_subfolder_has_a_readme():
    """Each subpackage says what it owns and what it may import, in its own README.md."""
    missing = [str(d.relative_to(SRC_ROOT)) for d in SRC.rglob("*") if (d / "__init__.py").exists() and d != SRC]
    missing = [m for m in missing if not (SRC_ROOT / m / "README.md").exists()]
    assert missing == []


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
                cycles.append(stack[stack.index(d) :] + [d])
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


# Private names of other projects that stoker reaches on purpose: (module, expression) -> why.
FOREIGN_PRIVATE = {
    ("stoker/cluster/extender/server.py", "self._srv._map"): "waitress's socket map: its loop runs in our thread",
    ("stoker/loader/workers/pool.py", "q._reader"): "a multiprocessing.Queue has no public waitable handle",
    ("stoker/storage/__init__.py", "weakref.finalize._registry"): "s3fs sessions inherited over fork",
    ("stoker/store/lease.py", "self.fs._call_s3"): "s3fs's raw S3 call, for a conditional (If-Match) PUT",
    ("stoker/decode/resample.py", "torch._C._nn"): "the ATen resize op without F.interpolate's overhead",
    ("stoker/decode/resample.py", "torch._C"): "(the same)",
}
#: Objects of other projects whose privates the lab reaches (moto's key buffer, LitData's
#: obstore options, a tokenizers wrapper, DLIO's per-epoch method that bytes_only wraps to time
#: DLIO's epochs from outside, Mosaic Streaming's per-stream downloader made again before its
#: workers fork), never stoker's own.
_LAB_FOREIGN_OBJECTS = {"key", "downloader", "tok", "dlio", "mosaic_stream"}
#: Documented names that merely start with an underscore.
PUBLIC_UNDERSCORE = {"_exit", "_make", "_asdict", "_replace", "_fields"}


def _private_reads(root: pathlib.Path) -> list[str]:
    """``x._name`` attribute reads where ``x`` is not ``self``/``cls`` (dunder names allowed), outside
    the class that sets ``self._name`` or defines the method ``_name`` (a class may reach the
    privates of another of its own instances, as a copy does)."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = str(p.relative_to(SRC_ROOT))
        tree = ast.parse(p.read_text())
        owned: dict[int, set[str]] = {}  # id(node) -> private names the enclosing class sets on self
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            mine = {
                a.attr
                for a in ast.walk(cls)
                if isinstance(a, ast.Attribute)
                and isinstance(a.ctx, ast.Store)
                and isinstance(a.value, ast.Name)
                and a.value.id == "self"
            }
            mine |= {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for n in ast.walk(cls):
                owned.setdefault(id(n), set()).update(mine)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = ast.unparse(node)
            if node.attr in PUBLIC_UNDERSCORE or (rel, text) in FOREIGN_PRIVATE or node.attr in owned.get(id(node), ()):
                continue
            out.append(f"{rel}:{node.lineno}: {text}")
    return out


def test_no_module_reads_another_objects_private_names():
    """Parts own their state: an object's ``_private`` attributes are read only by its own
    methods (``self._x``), never by another object or module (torchdata, Grain and httpx keep to
    this; two stoker objects that reached into each other once broke each other's state). The lab
    may reach third-party privates for its emulators, never stoker's."""
    assert _private_reads(SRC) == []
    lab = [r for r in _private_reads(LAB) if r.split(": ", 1)[1].split(".")[0] not in _LAB_FOREIGN_OBJECTS]
    assert lab == []


def test_no_class_is_spread_over_mixins():
    """One object's state lives in one class: no ``*Mixin`` class, and no class with two or more
    bases defined in stoker (composition instead)."""
    bad = []
    ours = set()
    trees = {p: ast.parse(p.read_text()) for p in SRC.rglob("*.py")}
    for tree in trees.values():
        ours |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for p, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in n.bases]
                if n.name.endswith("Mixin") or sum(b in ours and not b.endswith("Error") for b in bases) > 1:
                    bad.append(f"{p.relative_to(SRC_ROOT)}:{n.lineno}: class {n.name}({', '.join(bases)})")
    assert bad == []
