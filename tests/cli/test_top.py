"""``stoker top``: ``--once --json`` and the live view under a pseudo-terminal (pexpect), each
against a loader running in another process whose consumer takes a fixed time a batch (so the
epoch's rate is steady, and the figures top showed are those the loader reports when it stops)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
CHILD = """
import json, os, sys, time
import stoker
packed, cache, ready, stop = sys.argv[1:5]
ds = stoker.open_dataset(packed, cache_dir=cache, cache_bytes=1 << 30)
ld = stoker.Loader(ds, 1, num_workers=1, image_size=32)
for i, _ in enumerate(ld):  # epoch 0: start the processes, fill the cache
    if i == 4:
        break
for i, _ in enumerate(ld):  # epoch 1, until told to stop
    time.sleep(0.1)  # the emulated accelerator: 10 samples/s, well below what the pipeline gives
    if i == 50:  # a snapshot now is off by at most the batch in the consumer's hands: 1/51 of the rate
        open(ready, "w").write(str(os.getpid()))
    if os.path.exists(stop):
        break
print(json.dumps([s.as_dict() for s in ld.history]))
ld.close()
"""


def _env():
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def running_loader(packed_local, tmp_path):
    """A loader in a child process, 5 s into epoch 1 when this yields; yields (cache dir, pid, a
    function that stops it and returns its EpochStats as dicts: epoch 1's are those of the part
    served until then, which runs at a steady pace)."""
    cache, ready, stop = tmp_path / "cache", tmp_path / "ready", tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, packed_local, str(cache), str(ready), str(stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the loader did not reach epoch 1: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)

    def finish():
        stop.touch()
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])
    try:
        yield cache, proc.pid, finish
    finally:
        if proc.poll() is None:
            stop.touch()
            proc.kill()
            proc.wait(30)


def test_once_json_reports_the_running_loader(running_loader):
    cache, pid, finish = running_loader
    out = subprocess.run([sys.executable, "-m", "stoker.cli", "top", str(cache), "--once", "--json"],
                         capture_output=True, text=True, env=_env(), timeout=240)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    (c,) = snap["caches"]
    (job,) = [j for j in c["jobs"] if j["pid"] == pid]
    history = finish()
    own = next(s for s in history if s["epoch"] == job["epoch"])
    assert job["epoch"] >= 1
    assert job["samples_per_s"] == pytest.approx(own["samples_per_s"], rel=0.05)
    assert job["cache_hit_ratio"] == pytest.approx(own["cache_hit_ratio"], abs=0.05)
    assert job["stall_fraction"] == pytest.approx(own["stall_fraction"], abs=0.05)
    assert c["datasets"][0]["dataset"] == job["dataset"] and c["datasets"][0]["used_bytes"] > 0
    assert c["capacity_bytes"] == 1 << 30  # the budget the loader's cache reports


def test_live_view_under_a_terminal(running_loader):
    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("rich")
    cache, pid, finish = running_loader
    child = pexpect.spawn(sys.executable, ["-m", "stoker.cli", "top", str(cache), "--interval", "0.5"],
                          env=_env(), dimensions=(50, 160), encoding="utf-8", timeout=240)
    try:
        row = re.compile(rf"│\s+{pid}\s+│\s+0\s+│\s+(\w+)\s+│\s+(\d+)\s+│\s+([\d.,]+)\s+│")
        child.expect(row)
        child.expect(row)  # a second frame: it refreshes
        dataset, epoch = child.match.group(1), int(child.match.group(2))
        rate = float(child.match.group(3).replace(",", ""))
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    history = finish()
    own = next(s for s in history if s["epoch"] == epoch)
    assert rate == pytest.approx(own["samples_per_s"], rel=0.05)
    assert len(dataset) == 12


def test_not_a_cache(tmp_path):
    out = subprocess.run([sys.executable, "-m", "stoker.cli", "top", str(tmp_path), "--once", "--json"],
                         capture_output=True, text=True, env=_env(), timeout=240)
    assert out.returncode == 2 and "not a stoker cache directory" in out.stderr


def test_with_no_live_job_the_recorded_budget_and_url_are_shown(packed_local, tmp_path):
    """A cache nobody reads right now: `top` shows the budget and dataset URL the cache recorded
    (as `stoker cache status` does), not "-"."""
    import stoker
    from stoker.cli.top import snapshot
    cache = tmp_path / "cache"
    ds = stoker.open_dataset(packed_local, cache_dir=str(cache), cache_bytes="64MiB")
    ds[0]
    ds.close() if hasattr(ds, "close") else None
    (c,) = snapshot(str(cache))["caches"]
    assert c["capacity_bytes"] == 64 << 20
    assert [d["url"] for d in c["datasets"]] == [packed_local]
