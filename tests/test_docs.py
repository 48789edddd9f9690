"""The prose tells the truth about the tree: every file that a docstring, comment or README names
exists, no text cites an issue number, and the README's layout names every module there is."""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stoker"
LAB = ROOT / "src" / "stoker_lab"
# a file reference: a path-like token ending in one of these suffixes
REF = re.compile(r"(?<![\w/.<*{-])((?:[\w-]+/)*[\w-]+\.(?:py|md|c))\b")
ISSUE = re.compile(r"\bissues? ?#?\d+\b", re.IGNORECASE)


def _texts():
    for p in sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")):
        yield p
    for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
              *sorted((ROOT / "docs").glob("*.md")), *sorted(SRC.rglob("README.md")), *sorted(LAB.rglob("README.md"))]:
        if p.exists():
            yield p


def _prose(p: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of the prose in ``p``: a Markdown file whole; of Python, the docstrings
    and comments (string literals in code name run-time files, not the repository's)."""
    text = p.read_text()
    if p.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    out = []
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                out += [(doc.lineno + k, ln) for k, ln in enumerate(doc.value.value.splitlines())]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _exists(ref: str, near: pathlib.Path) -> bool:
    bases = [ROOT, SRC, LAB, near.parent, ROOT / "tests", ROOT / "src"]
    if any((b / ref).exists() for b in bases):
        return True
    # a bare file name ("disk.py") may name any file of that name in the tree
    return "/" not in ref and any(any(True for _ in (ROOT / d).glob(f"**/{ref}"))
                                  for d in ("src", "tests", "docs", "benchmarks", "scripts"))


# names that are not files of this repository: other projects' files, files made at run time
EXTERNAL = {"nodes/base_node.py", "nodes/loader.py", "_exceptions.py", "constants.py", "dataset.py",
            "setup.py", "pyproject.toml", "demo.json", "conftest.py"}


def test_no_text_cites_an_issue_number():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _texts() if p != pathlib.Path(__file__)
           for i, line in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not bad, "\n".join(bad)


def test_every_file_named_in_prose_exists():
    missing = []
    for p in _texts():
        if p == pathlib.Path(__file__).resolve() or p.name == "CHANGELOG.md":
            continue  # the changelog names files as they were
        for i, line in _prose(p):
            for ref in REF.findall(line):
                if ref in EXTERNAL or ref.startswith(("shared/", "cases/")) or "run_<" in line:
                    continue
                if not _exists(ref, p):
                    missing.append(f"{p.relative_to(ROOT)}:{i}: {ref}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    absent = []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC)
        if p.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a package is named by its folder
        if rel.parts[0] == "bench" and rel.parts[-2:-1] == ("peers",) and p.name.startswith("run_"):
            continue  # "one run_<loader>.py per loader"
        if p.name not in block:
            absent.append(str(rel))
    assert not absent, "modules missing from the README's layout section: " + ", ".join(absent)
