"""Ctrl-C in ``stoker pack``: one line saying what was finished and that a rerun resumes, exit 130,
no traceback; the rerun reuses the finished shards. Also ``stoker --version`` and bandwidths in
bytes per second."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import stoker
from _helpers import make_image_folder
from stoker.cli import main
from stoker_lab.cli.bandwidth import rate_arg

SRC = os.path.dirname(os.path.dirname(stoker.__file__))  # the stoker under test, in the child too


def test_ctrl_c_in_pack_prints_one_line_and_exits_130(tmp_path):
    tree = make_image_folder(tmp_path / "src", {f"c{i % 3}/{i:04d}.jpg": os.urandom(6000) for i in range(300)})
    dst = tmp_path / "dst"
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    cmd = [
        sys.executable,
        "-m",
        "stoker.cli",
        "pack",
        str(tree),
        str(dst),
        "--shard-size",
        "8KiB",
        "--read-workers",
        "1",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        shards = dst / "shards"
        if shards.exists() and len(list(shards.glob("*.json"))) >= 2:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("pack finished before it could be interrupted")
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "interrupted: " in lines[0] and f"of {dst} finished and kept" in lines[0]
    assert "run the same command again to resume" in lines[0]
    finished = int(lines[0].split("interrupted: ")[1].split(" shard")[0])
    assert finished >= 1 and not (dst / "index.parquet").exists()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["reused_shards"] >= finished


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"stoker {stoker.__version__}"


def test_bandwidth_in_bytes_per_second():
    assert rate_arg("100") == 100.0 and rate_arg("100MB/s") == 100.0 and rate_arg("1.5GB/s") == 1500.0
    assert rate_arg("1MiB/s") == pytest.approx(1.048576)
    for bad in ("100Mbps", "100Mb/s", "100MB", "fast", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="bandwidth"):
            rate_arg(bad)
    from stoker.cli import build_parser

    p = build_parser()
    assert p.parse_args(["demo", "--bandwidth-MBps", "250MB/s"]).bandwidth_mbps == 250.0
    assert p.parse_args(["demo", "--bandwidth-mbps", "50"]).bandwidth_mbps == 50.0  # the old name still works
