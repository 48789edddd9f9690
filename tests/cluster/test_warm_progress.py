"""``stoker warm`` draws a progress bar with rate and ETA on a terminal (driven under a
pseudo-terminal with pexpect, joining the test cluster) and none when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
SRC = str(Path(__file__).resolve().parents[2] / "src")
BLOCK = 64 << 10
#: tqdm's byte bar, e.g. "warm s3://b/ds: 100%|#####| 8.47M/8.47M [00:01<00:00, 6.12MB/s]": the
#: done/total, elapsed<ETA and the rate, as numbers (the first frame's "?" do not count)
BAR = re.compile(r"warm \S+: +\d+%.*?[\d.]+[kMG]?/[\d.]+[kMG]? \[\d+:\d+<(\d+:\d+), +([\d.]+) ?[kMG]?B/s\]")


def test_warm_progress_on_a_terminal_only(cluster, s3_dataset, tmp_path, capsys):
    pexpect = pytest.importorskip("pexpect")
    from stoker.cli import main
    from stoker.cluster.service.cache_service import stop_services

    url, opts = s3_dataset
    stop_services()  # fresh services with a budget that holds the dataset, whatever ran before
    args = [
        url,
        "--storage-options",
        json.dumps(opts),
        "--block-size",
        str(BLOCK),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--cache-bytes",
        str(64 << 20),
    ]
    capsys.readouterr()
    assert main(["warm", *args]) == 0  # stderr is pytest's capture, not a terminal
    out, err = capsys.readouterr()
    assert json.loads(out)["cached_fraction"] == 1.0
    assert "B/s" not in err and "%|" not in err, err
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "stoker.cli", "warm", *args, "--ray-address", cluster.address],
        env=env,
        dimensions=(24, 200),
        encoding="utf-8",
        timeout=240,
    )
    try:
        child.expect(BAR)
        eta, rate = child.match.group(1), float(child.match.group(2))
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before[-2000:]
    assert re.fullmatch(r"\d+:\d\d", eta) and rate > 0
