"""The product's shape, kept by a test so it does not grow back (docs/design.md, "The layout"):
no class with more than 25 methods, and no function over 80 lines (from ``def`` to its last line,
docstring included) but the few named in ``LONG_FUNCTIONS``, each with why it stays whole.
Signatures of the public entry points stay short: their settings travel in option groups."""

from __future__ import annotations

import ast
import inspect
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "stoker"

MAX_METHODS = 25
MAX_FUNCTION_LINES = 80

#: "path:qualified name" -> why it is left whole. At most 5.
LONG_FUNCTIONS: dict[str, str] = {}


def _defs():
    for p in sorted(SRC.rglob("*.py")):
        tree = ast.parse(p.read_text())
        rel = str(p.relative_to(SRC))

        yield from ((rel, name, node) for name, node in _walk(tree, ""))


def _walk(node, prefix):
    """(qualified name, node) of every function and class below ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            yield name, child
            yield from _walk(child, name + ".")
        else:
            yield from _walk(child, prefix)


def test_no_class_has_more_than_25_methods():
    big = {
        f"{rel}:{name}": n
        for rel, name, node in _defs()
        if isinstance(node, ast.ClassDef)
        and (n := sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)) > MAX_METHODS
    }
    assert big == {}


def test_long_functions_are_few_and_named_with_their_reason():
    long = {
        f"{rel}:{name}"
        for rel, name, node in _defs()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert len(LONG_FUNCTIONS) <= 5
    assert long == set(LONG_FUNCTIONS), "a function over 80 lines: split it, or name it here with why"


def test_entry_points_take_few_parameters():
    """Settings travel in option groups: ``Loader`` takes at most 14 parameters (its common
    arguments and three groups), ``open_dataset``, ``pack``, ``cluster.run`` and ``warm`` at most 10
    (``**deprecated``, the old keywords' door, not counted)."""
    import stoker
    from stoker.cluster.jobs.job import run
    from stoker.cluster.service.warmup import warm

    def count(fn):
        ps = inspect.signature(fn).parameters.values()
        return sum(p.kind is not inspect.Parameter.VAR_KEYWORD for p in ps)

    assert count(stoker.Loader.__init__) - 1 <= 14  # less self
    for fn in (stoker.open_dataset, stoker.pack, run, warm):
        assert count(fn) <= 10, fn.__qualname__
