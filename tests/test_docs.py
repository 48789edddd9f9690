"""The prose tells the truth about the tree: every file that a docstring, comment or README names
exists, no text cites an issue number, every relative link of the README and the docs pages leads
to a file (and heading) that exists, the README stays short, and the layout in docs/design.md
names every module there is."""

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
    for p in [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(SRC.rglob("README.md")),
        *sorted(LAB.rglob("README.md")),
    ]:
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
    # a bare file name ("disk.py") or a path's tail within a package ("prefetch/loop.py") may name
    # any file of that name in the tree
    return any(
        any(True for _ in (ROOT / d).glob(f"**/{ref}")) for d in ("src", "tests", "docs", "benchmarks", "scripts")
    )


# names that are not files of this repository: other projects' files, files made at run time
EXTERNAL = {
    "nodes/base_node.py",
    "nodes/loader.py",
    "_exceptions.py",
    "constants.py",
    "dataset.py",
    "setup.py",
    "pyproject.toml",
    "demo.json",
    "conftest.py",
}


def test_no_text_cites_an_issue_number():
    bad = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _texts()
        if p != pathlib.Path(__file__)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
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


README_MAX_LINES = 200  # a front door: the costs, the results and the worked examples live in docs/
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _linked_pages() -> list[pathlib.Path]:
    """The pages whose links are checked: the README, the docs pages and the other READMEs."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md",
        ROOT / "deploy" / "kubernetes" / "README.md",
        *sorted(SRC.rglob("README.md")),
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(page.read_text()):
        if re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_every_relative_link_reaches_a_file_and_heading():
    bad = []
    for page in _linked_pages():
        for line in _outside_code(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][\w+.-]*:", target):  # http:, https:, mailto: ...
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}: {target}"
                if not file.exists():
                    bad.append(f"{where} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                    bad.append(f"{where} (no such heading)")
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_design_layout_names_every_module():
    design = (ROOT / "docs" / "design.md").read_text()
    block = design.split("## Layout", 1)[1].split("```", 2)[1]
    absent = []
    for root in (SRC, LAB):
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if p.name == "__init__.py" and len(rel.parts) > 1:
                continue  # a package is named by its folder
            if rel.parts[0] == "bench" and rel.parts[-2:-1] == ("peers",) and p.name.startswith("run_"):
                continue  # "one run_<loader>.py per loader"
            if p.name not in block:
                absent.append(str(p.relative_to(ROOT)))
    assert not absent, "modules missing from the layout in docs/design.md: " + ", ".join(absent)
