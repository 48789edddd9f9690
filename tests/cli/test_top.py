"""``stoker top``: ``--once --json`` and the live view under a pseudo-terminal (pexpect), each
against a loader running in another process, compared with the EpochStats that loader reports
for the same epoch.

Top shows the epoch so far (figures written up to a second before it reads them) and the
loader's stats cover the whole epoch (it ends soon after top has read it), so like is compared
with like only where the epoch runs at a steady pace from its start: the dataset is cached before
the loader starts (every read a hit: hit ratio 1), the one decode worker takes 80 ms a sample
(12.5 samples/s, the bottleneck) and the consumer 20 ms a batch, so the data stall is about 75%
of the epoch all along. Then samples/s, stall and hit ratio agree within 5% (relative) whenever
they are read; the first batch's seconds is one number, known from the first batch on.
"""

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
import numpy as np
import stoker
packed, cache, ready, stop = sys.argv[1:5]

def decode(fields, rng):  # the bottleneck: 80 ms a sample in the one worker
    time.sleep(0.08)
    return np.array([sum(len(v) for k, v in fields.items() if not k.startswith("__"))])

ds = stoker.open_dataset(packed, cache_dir=cache, cache_bytes=1 << 30)
for b in range(len(ds.blocks)):  # cached before the epoch: every read of it a hit
    ds.reader.fill_block(b, want_data=False)
ld = stoker.Loader(ds, 1, num_workers=1, decode=decode)
for i, _ in enumerate(ld):
    time.sleep(0.02)  # the emulated accelerator, faster than the pipeline: it waits ~60 ms a batch
    if i == 40:  # 3 s into the epoch: the pace is steady
        open(ready, "w").write(str(os.getpid()))
    if os.path.exists(stop):
        break
while not os.path.exists(stop):  # the epoch may end before top has looked: its figures stay shown
    time.sleep(0.05)
print(json.dumps([s.as_dict() for s in ld.history]))
ld.close()
"""


#: How far top's samples/s and stall may be from the loader's own (the epoch so far against the
#: epoch at its stop; a wrong field or unit is off by far more).
RATE_REL = 0.15

_PACKED: list[str] = []  # the dataset URL the running loader opened


def _env():
    # without COLUMNS/LINES (pytest-xdist's workers have them set): the live view sizes its table
    # to the terminal it is given, as it does for a user
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return {**env, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture
def running_loader(packed_local, tmp_path):
    """A loader in a child process, 3 s into its epoch 0 when this yields; yields (cache dir, pid,
    a function that stops it and returns its EpochStats as dicts: epoch 0's are those of the part
    served until then, or of the whole epoch)."""
    cache, ready, stop = tmp_path / "cache", tmp_path / "ready", tmp_path / "stop"
    _PACKED[:] = [packed_local]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, packed_local, str(cache), str(ready), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the loader did not get going: {proc.communicate()[1][-2000:]}")
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
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "top", str(cache), "--once", "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    (c,) = snap["caches"]
    (job,) = [j for j in c["jobs"] if j["pid"] == pid]
    (own,) = [s for s in finish() if s["epoch"] == job["epoch"]]
    assert own["samples"] >= 41 and own["cache_misses"] == 0
    # top shows the epoch so far, the loader's own figures are of the epoch at its stop a moment
    # later: the pace between the two moves with the machine's load (the other test worker)
    assert job["samples_per_s"] == pytest.approx(own["samples_per_s"], rel=RATE_REL)
    assert job["stall_fraction"] == pytest.approx(own["stall_fraction"], rel=RATE_REL)
    assert own["stall_fraction"] > 0.5  # the pace the test set: a stall worth comparing
    assert job["cache_hit_ratio"] == pytest.approx(own["cache_hit_ratio"], rel=0.05)
    assert job["first_batch_s"] == pytest.approx(own["first_batch_s"], rel=0.05)
    assert c["datasets"][0]["dataset"] == job["dataset"] and c["datasets"][0]["used_bytes"] > 0
    # one name for the dataset, the URL it was opened from (as the metrics and cache status name
    # it), with the version beside it
    assert job["dataset"] == job["url"] == _PACKED[0] and job["version"] == c["datasets"][0]["version"]
    assert len(job["version"]) > 12 and job["version"] not in job["dataset"]
    assert c["capacity_bytes"] == 1 << 30  # the budget the loader's cache reports


def test_live_view_under_a_terminal(running_loader):
    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("rich")
    cache, pid, finish = running_loader
    child = pexpect.spawn(
        sys.executable,
        ["-m", "stoker.cli", "top", str(cache), "--interval", "0.5"],
        env=_env(),
        dimensions=(50, 160),
        encoding="utf-8",
        codec_errors="replace",  # a frame cut by Ctrl-C may end inside a character
        timeout=240,
    )
    try:  # pid, rank, dataset, epoch, samples/s, stall, first batch s, origin MB/s, hit ratio
        row = re.compile(
            rf"│\s+{pid}\s+│\s+0\s+│\s+(\S+)\s+│\s+(\d+)\s+│\s+([\d.,]+)\s+│\s+([\d.]+)%\s+│"
            rf"\s+[\d.]+\s+│\s+[\d.,]+\s+│\s+([\d.]+)%\s+│"
        )
        child.expect(row)
        child.expect(row)  # a second frame: it refreshes
        dataset, epoch = child.match.group(1), int(child.match.group(2))
        rate, stall, hits = (float(child.match.group(i).replace(",", "")) for i in (3, 4, 5))
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    (own,) = [s for s in finish() if s["epoch"] == epoch]
    assert rate == pytest.approx(own["samples_per_s"], rel=RATE_REL)
    assert stall / 100 == pytest.approx(own["stall_fraction"], rel=RATE_REL)
    assert hits / 100 == pytest.approx(own["cache_hit_ratio"], rel=0.05) and hits == 100.0
    assert dataset == _PACKED[0]  # the URL, as the metrics and `stoker cache status` name it


def test_not_a_cache(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "top", str(tmp_path), "--once", "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
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


def test_a_piped_frame_is_not_cut_to_80_columns(packed_local, tmp_path):
    """`stoker top --once` into a pipe prints whole figures and headers (rich would squeeze a
    table to 80 columns when output is not a terminal)."""
    import os

    import stoker

    cache = tmp_path / "cache"
    ds = stoker.open_dataset(packed_local, cache_dir=str(cache), cache_bytes="64MiB")
    ds[0]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "top", str(cache), "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "..." not in out.stdout, out.stdout  # a cut cell or line
    assert f"cache {cache}:" in out.stdout and "hit ratio" in out.stdout and "first batch s" in out.stdout
