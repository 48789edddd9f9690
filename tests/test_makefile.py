"""The Makefile's first two commands leave nothing that `make clean` does not remove: the demo's data
($TMPDIR/stoker-demo) and the tests' temporaries (one directory: pytest's --basetemp and the
default node cache of the tests) go with the environment; files that are not the checkout's stay.

`make clean` runs for real on a copy of the Makefile in a temporary directory (with TMPDIR there),
so nothing of this checkout is touched; `make test` is only printed (``make -n``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def copy(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copy(ROOT / "Makefile", work / "Makefile")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("TEST_TMP", None)
    return work, tmp, env


def _make(work: Path, env: dict, *args: str) -> str:
    out = subprocess.run(["make", "-s", *args], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_test_keeps_its_temporaries_in_one_directory(copy):
    work, tmp, env = copy
    test_tmp = tmp / f"stoker-tests-{os.getuid()}"
    cmd = [line for line in _make(work, env, "-n", "-o", "venv", "test").splitlines() if "-m pytest" in line]
    assert len(cmd) == 1, cmd
    assert f"--basetemp={test_tmp}/pytest" in cmd[0] and f"STOKER_CACHE_DIR={test_tmp}/cache" in cmd[0]
    # pytest makes --basetemp without its parents: on a fresh machine the parent must be made first
    lines = _make(work, env, "-n", "-o", "venv", "test").splitlines()
    made = [i for i, line in enumerate(lines) if line.strip() == f"mkdir -p {test_tmp}"]
    assert made and made[0] < next(i for i, line in enumerate(lines) if "-m pytest" in line), lines


def test_make_clean_removes_the_demo_data_and_the_test_temporaries(copy):
    work, tmp, env = copy
    made = [
        work / ".venv" / "bin",
        work / "demo-out",
        work / ".pytest_cache",
        tmp / "stoker-demo" / "data",
        tmp / f"stoker-tests-{os.getuid()}" / "pytest" / "test_x0",
        tmp / f"stoker-tests-{os.getuid()}" / "cache",
    ]
    kept = [work / "src", tmp / "someone-elses", tmp / "stoker-demo-notes.txt"]
    for d in made + kept[:2]:
        d.mkdir(parents=True)
        (d / "f").write_bytes(b"x" * 100)
    kept[2].write_text("not the demo's")
    _make(work, env, "clean")
    assert [str(p) for p in made if p.exists()] == []
    assert all(p.exists() for p in kept)
