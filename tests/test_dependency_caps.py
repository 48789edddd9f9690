"""Dependencies whose private internals stoker reads (moto's S3 backend, waitress's channel and
task classes, the shape of the wrapper Ray Train's ``prepare_data_loader`` returns) are capped in
pyproject.toml; the installed versions must be inside the caps, so that the tests that exercise
those internals (tests/storage/test_origin.py, the extender tests,
tests/loader/test_framework_adapters.py) run against a version the caps allow."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    out: dict[str, list[Requirement]] = {}
    for line in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]:
        req = Requirement(line)
        out.setdefault(req.name, []).append(req)
    return out


@pytest.mark.parametrize("name", ["moto", "waitress", "ray"])
def test_internals_read_by_stoker_are_capped_and_the_installed_version_fits(name):
    reqs = _requirements()[name]
    for req in reqs:
        assert any(spec.operator in ("<", "<=", "~=", "==") for spec in req.specifier), f"{req} has no cap"
    try:
        installed = version(name)
    except PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    for req in reqs:
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} is outside {req}"
