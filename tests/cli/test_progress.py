"""Progress bars: the library's long calls (pack, verify, warm) print none unless asked
(``progress=True``); ``stoker verify`` draws one with rate and ETA on a terminal and none when
its output is not a terminal (``stoker warm``, which needs a Ray cluster: tests/cluster/test_warm_progress.py)."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env():
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_library_calls_print_no_bar(packed_local, sample_tree, tmp_path, capfd):
    from stoker.cluster.service.warmup import warm
    from stoker.store.pack import pack
    from stoker.store.verify import verify

    capfd.readouterr()
    assert verify(packed_local).ok
    pack(str(sample_tree / "train"), str(tmp_path / "packed"), shard_bytes=1 << 20)
    out = capfd.readouterr()
    assert out.err == "" and out.out == ""
    assert inspect.signature(warm).parameters["progress"].default is False  # (warm needs a Ray cluster)
    verify(packed_local, progress=True)  # asked for: drawn
    assert "shard" in capfd.readouterr().err


def test_verify_cli_is_quiet_without_a_terminal(packed_local):
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "verify", packed_local],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "OK" in out.stdout


def test_verify_cli_shows_rate_and_eta_on_a_terminal(packed_local):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "stoker.cli", "verify", packed_local],
        env=_env(),
        dimensions=(24, 160),
        encoding="utf-8",
        timeout=240,
    )
    try:
        # tqdm's bar: "verify: 100%|####| 8/8 [00:00<00:00, 25.1shard/s]": done/total, elapsed<ETA and
        # the rate as numbers (the first frame's "?" do not count; under 1 shard/s tqdm says s/shard)
        child.expect(re.compile(r"verify: +\d+%.*?(\d+)/(\d+) \[\d+:\d+<(\d+:\d+), +([\d.]+) ?(shard/s|s/shard)\]"))
        total, rate = int(child.match.group(2)), float(child.match.group(4))
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert "OK" in child.before
    assert total >= 2 and rate > 0  # one step per shard of a dataset of several
