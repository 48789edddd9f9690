"""A walk of two settings through the product's source (read with :mod:`ast`, nothing imported),
following the attribute from where it is given to where it is used: options travel whole, and a
value is stored once, under its one name.

- ``ReadOptions.prefetch_bytes``: the only place that stores it is the ``ReadOptions`` field. The
  group travels whole: the Loader keeps it (``self.read``), its ``RunConfig`` holds it (``read``),
  the pipeline hands it to the ``Prefetcher``, which hands it to the prefetch process
  (``prefetch_main``), which hands it to ``PrefetchLoop``; the loop reads ``.prefetch_bytes`` where
  it limits read-ahead. No renamed copy (``ahead_bytes``) is left anywhere.
- ``batch_size``: the only place that stores it is the ``WorkerConfig`` field: the frozen record
  the Loader keeps as ``cfg`` and every part of the pipeline (and every worker) receives.
  ``Loader.batch_size`` is a property that reads it there.

A store is an assignment to an attribute of that name (``x.batch_size = ...``, in a tuple too), a
class-body field of that name (a dataclass field), or a ``setattr``-like call naming it
(``object.__setattr__(self, "prefetch_bytes", ...)`` in a frozen dataclass's ``__post_init__``).
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "stoker"


def _tree(rel: str) -> ast.Module:
    return ast.parse((SRC / rel).read_text(), rel)


def _classes(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the name of the innermost class around it."""
    out: dict[int, str] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for n in ast.walk(cls):
            out[id(n)] = cls.name  # inner classes are walked later and win
    return out


def _stores(names: set[str]) -> set[tuple[str, str | None]]:
    """(module path under src/stoker, enclosing class or None) of every store of an attribute or
    field named in ``names``, over the whole product."""
    found = set()
    for p in sorted(SRC.rglob("*.py")):
        rel = str(p.relative_to(SRC))
        tree = ast.parse(p.read_text(), rel)
        owner = _classes(tree)
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in names:
                hit = node
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                        found.add((rel, node.name))
            elif (
                isinstance(node, ast.Call)
                and len(node.args) >= 3
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in names
            ):
                hit = node
            if hit is not None:
                found.add((rel, owner.get(id(hit))))
    return found


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name the code uses: variables, parameters, attributes, keyword arguments."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
    return out


def _function(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope: ast.AST = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def _calls(tree: ast.AST, callee: str) -> list[ast.Call]:
    """Calls of ``callee`` (``callee(...)`` or ``x.callee(...)``)."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and callee == (n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", ""))
    ]


def _hands_over(call: ast.Call, group: str) -> bool:
    """Whether ``call`` passes the group ``group`` whole: an argument (or an element of a tuple
    argument) that is ``group``, ``x.group`` or ``x._group``."""
    values = list(call.args) + [k.value for k in call.keywords]
    values += [e for v in values if isinstance(v, ast.Tuple) for e in v.elts]
    for v in values:
        if isinstance(v, ast.Name) and v.id == group:
            return True
        if isinstance(v, ast.Attribute) and v.attr in (group, f"_{group}"):
            return True
    return False


def test_prefetch_bytes_is_stored_once_in_read_options():
    assert _stores({"prefetch_bytes", "ahead_bytes"}) == {("loader/options.py", "ReadOptions")}


def test_no_renamed_copy_of_prefetch_bytes_is_left():
    uses = [
        str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "ahead_bytes" in _identifiers(ast.parse(p.read_text()))
    ]
    assert uses == []


def test_the_read_options_travel_whole_to_the_prefetch_loop():
    """Each hop of ``ReadOptions`` from the Loader to the loop that limits read-ahead."""
    loader, options = _tree("loader/loader.py"), _tree("loader/options.py")
    init = _function(loader, "__init__", "Loader")
    kept = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        and any(
            isinstance(t, (ast.Attribute, ast.Tuple))
            and "self.read" in [ast.unparse(e) for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in n.targets
        )
    ]
    assert kept, "Loader.__init__ keeps the ReadOptions as self.read"
    assert any(_hands_over(c, "read") for c in _calls(loader, "RunConfig")), "the Loader hands read to its RunConfig"
    run_config = next(n for n in ast.walk(options) if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    fields = {s.target.id: ast.unparse(s.annotation) for s in run_config.body if isinstance(s, ast.AnnAssign)}
    assert fields.get("read") == "ReadOptions", "RunConfig holds the ReadOptions whole"
    assert any(_hands_over(c, "read") for c in _calls(_tree("loader/pipeline/run.py"), "Prefetcher"))
    prefetcher = _tree("loader/prefetch/prefetcher.py")
    assert "read" in _params(_function(prefetcher, "__init__", "Prefetcher"))
    assert any(_hands_over(c, "read") for c in _calls(prefetcher, "Process")), (
        "the Prefetcher hands read to its process"
    )
    process = _tree("loader/prefetch/process.py")
    assert "read" in _params(_function(process, "prefetch_main"))
    assert any(_hands_over(c, "read") for c in _calls(process, "PrefetchLoop")), "prefetch_main hands read to the loop"
    loop = _tree("loader/prefetch/loop.py")
    assert "read" in _params(_function(loop, "__init__", "PrefetchLoop"))
    limits = [
        cmp
        for cmp in ast.walk(next(n for n in ast.walk(loop) if isinstance(n, ast.ClassDef) and n.name == "PrefetchLoop"))
        if isinstance(cmp, ast.Compare)
        and any(
            isinstance(x, ast.Attribute) and x.attr == "prefetch_bytes" and ast.unparse(x.value).endswith("read")
            for x in [cmp.left, *cmp.comparators]
        )
    ]
    assert limits, "PrefetchLoop compares the bytes ahead of the consumer with read.prefetch_bytes"


def test_batch_size_is_stored_once_in_the_worker_config():
    assert _stores({"batch_size"}) == {("loader/options.py", "WorkerConfig")}
    prop = _function(_tree("loader/loader.py"), "batch_size", "Loader")
    assert [ast.unparse(d) for d in prop.decorator_list] == ["property"]
    assert ast.unparse(prop.body[-1]) == "return self.cfg.batch_size"
