"""The wheel a user builds from a clone (`python -m build`) installs into a clean virtual
environment and works there, away from the source tree: the C extension is inside it, the
lab (stoker_lab) is not inside the product (no ``stoker.bench``, no ``stoker.sim``), ``import stoker``
needs no extra, the `stoker` command runs, and a dataset packs and loads.

This is the install path the README gives (its "Install" section); the test is slow-ish (a
minute: a wheel build and a dependency install from the package registry or pip's cache), so
it runs once, in one test, under CI (or with ``STOKER_WHEEL_TEST=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SMOKE = r"""
import sys
import stoker
from stoker.decode import image
assert stoker.__file__.startswith(sys.prefix), stoker.__file__   # not the source tree
src, dst = sys.argv[1], sys.argv[2]
stoker.pack(src, dst, shard_bytes="256KiB")
ds = stoker.open_dataset(dst, cache_dir=sys.argv[3], cache_bytes="64MiB")
loader = stoker.Loader(ds, batch_size=4, num_workers=0, seed=0, transform="eval")
n = sum(len(labels) for _, labels in loader)
assert n == len(ds), (n, len(ds))
assert loader.stats.exactly_once
print("SMOKE-OK", n, image.REGION_DECODE)
"""

IMPORT_CHECK = r"""
import importlib.util
import sys
import stoker
assert stoker.__file__.startswith(sys.prefix), stoker.__file__
for name in ("stoker.bench", "stoker.sim"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable from the wheel"
print("IMPORT-OK")
"""


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.timeout(1800)
def test_wheel_installs_into_a_clean_venv_and_runs(tmp_path):
    if not (os.environ.get("CI") or os.environ.get("STOKER_WHEEL_TEST")):
        pytest.skip("installs every dependency into a new venv (minutes): runs under CI, or with STOKER_WHEEL_TEST=1")
    try:
        import build  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the 'build' package is not installed (it is in the dev extra)")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)], cwd=tmp_path)
    wheels = list(dist.glob("stoker-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "stoker/py.typed" in names
    assert "stoker/decode/_jpegroi.pyi" in names  # the C extension's types
    assert any(n.startswith("stoker/decode/_jpegroi") and n.endswith(".so") for n in names), (
        "the region-decode C extension is not in the wheel"
    )
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    # the lab moved beside the product (src/stoker_lab): no stale copy of it inside the product
    stale = [n for n in names if n.startswith(("stoker/bench/", "stoker/sim/", "stoker/bench.", "stoker/sim."))]
    assert not stale, f"the wheel still ships the lab inside the product: {stale[:5]}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    # constraints-dev.txt pins the CPU build of torch (a bare requirement pulls a CUDA build).
    _run(
        [str(py), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints-dev.txt"), str(wheels[0])],
        cwd=tmp_path,
        timeout=1200,
    )
    # `import stoker` works with no extra installed, and no lab module is left under the product's name
    out = _run([str(py), "-c", IMPORT_CHECK], cwd=tmp_path)
    assert "IMPORT-OK" in out, out

    # The embedded photos come from this (dev) environment: `stoker sample-data` needs the demo
    # extra, which a plain install does not have.
    from stoker_lab.sample_data import make_sample_data

    make_sample_data(str(tmp_path / "data"), images=12, classes=3, seed=0)
    out = _run([str(venv / "bin" / "stoker"), "--help"], cwd=tmp_path)
    assert "pack" in out
    smoke = tmp_path / "smoke.py"
    smoke.write_text(SMOKE)
    out = _run(
        [str(py), str(smoke), str(tmp_path / "data" / "train"), str(tmp_path / "packed"), str(tmp_path / "cache")],
        cwd=tmp_path,
    )
    assert "SMOKE-OK 12 True" in out, out
