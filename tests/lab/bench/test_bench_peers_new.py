"""`stoker bench peers`: the SPDL and Ray Data runners on a tiny set (each peer measured for every
epoch, or skipped with its reason where its environment is absent: SPDL's virtual environment
is never made by the test, and SPDL needs the system's FFmpeg libraries), the accelerator
comparison's `--device cuda` on a machine without a GPU, and the parts they share."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker_lab.bench.harness import measure
from stoker_lab.bench.peers.bench import PeersConfig, cuda_missing, run_peers

ROOT = Path(__file__).resolve().parents[3]
PEERS = ROOT / "src" / "stoker_lab" / "bench" / "peers"


def _runner_module(name: str):
    """A runner script loaded as a module (its folder on sys.path for its `import _runner`)."""
    sys.path.insert(0, str(PEERS))
    try:
        spec = importlib.util.spec_from_file_location(f"_peer_{name}", PEERS / f"run_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(PEERS))


def test_spdl_and_ray_data_read_every_sample_each_epoch(tmp_path):
    r = run_peers(
        PeersConfig(
            images=16,
            classes=2,
            epochs=2,
            batch_size=8,
            workers=1,
            consumer_rate=4000.0,
            loaders=("spdl", "ray_data"),
            make_venvs=False,
            run_timeout_s=300,
            workdir=str(tmp_path / "work"),
        )
    )
    skipped = {s["loader"]: s["reason"] for s in r["skipped"]}
    assert "ray_data" not in skipped, skipped  # Ray Data runs in stoker's own Python
    by = {(row["loader"], row["epoch"]): row for row in r["runs"]}
    for loader in ("spdl", "ray_data"):
        if loader in skipped:
            assert skipped[loader].strip()
            continue
        for e in (0, 1):
            row = by[(loader, e)]
            assert row["samples"] == 16, row  # the whole set, every epoch
            assert 0 < row["first_batch_s"] <= row["seconds"] and row["cpu_s_per_1000"] > 0
        # the first epoch reads the origin; the next reads the local copy (SPDL) or the object store (Ray)
        assert by[(loader, 0)]["origin_bytes"] > 0 and by[(loader, 1)]["origin_bytes"] == 0
        p = r["peers"][loader]
        assert p["recipe"] and p["cache"] and p["resume"].startswith("none"), p
    assert r["peers"]["ray_data"]["versions"]["ray"] == __import__("ray").__version__
    assert not any(n.startswith("ray-") for n in os.listdir(tmp_path / "work")), "Ray's session files left behind"


def test_ray_data_over_stoker_reads_nothing_from_the_origin_after_its_first_epoch(tmp_path):
    """The ray_data+stoker row: plain Ray Data's recipe with stoker.ray_data.read as its source; no
    materialize(), and still 0 origin bytes from the second epoch on (the node cache's service)."""
    r = run_peers(
        PeersConfig(
            images=16,
            classes=2,
            epochs=2,
            batch_size=8,
            workers=1,
            consumer_rate=4000.0,
            loaders=("ray_data+stoker",),
            make_venvs=False,
            run_timeout_s=300,
            workdir=str(tmp_path / "work"),
        )
    )
    assert r["skipped"] == [], r["skipped"]
    by = {row["epoch"]: row for row in r["runs"] if row["loader"] == "ray_data+stoker"}
    assert [by[e]["samples"] for e in (0, 1)] == [16, 16]  # the whole set, every epoch
    assert by[0]["origin_bytes"] > 0 and by[1]["origin_bytes"] == 0
    check = r["checks"]["ray_data_stoker_vs_ray_data"]
    assert check["origin_bytes_warm"] == 0 and check["value"] is None  # plain Ray Data did not run here
    assert r["peers"]["ray_data+stoker"]["recipe"].startswith("stoker pack; stoker.ray_data.read")
    assert not any(n.startswith("ray-") for n in os.listdir(tmp_path / "work")), "Ray's session files left behind"


def test_device_cuda_without_a_gpu_says_so_in_one_line_and_exits_0():
    if cuda_missing() is None:
        pytest.skip("this machine has a CUDA GPU: the comparison would run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "bench", "peers", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "no CUDA GPU" in lines[0], p.stdout


def test_device_cuda_compares_stoker_and_dali_only(tmp_path):
    with pytest.raises(ValueError, match="stoker and dali"):
        run_peers(PeersConfig(device="cuda", loaders=("torch",), workdir=str(tmp_path)))
    with pytest.raises(ValueError, match="device"):
        run_peers(PeersConfig(device="tpu", workdir=str(tmp_path)))


def test_stoker_runner_decodes_on_the_device_for_cuda():
    mod = _runner_module("stoker")
    assert mod.options({"device": "cpu"}) == {}
    assert mod.options({"device": "cuda"})["image"].decode_device == "cuda"


def test_crop_box_is_a_random_resized_crop_inside_the_image():
    runner = _runner_module("spdl")._runner
    rng = random.Random(0)
    for w, h in [(500, 375), (375, 500), (64, 64), (2000, 100), (100, 2000)]:
        for _ in range(200):
            x, y, cw, ch = runner.crop_box(w, h, rng)
            assert 0 <= x and x + cw <= w and 0 <= y and y + ch <= h and cw >= 1 and ch >= 1
            if w / h in (500 / 375, 375 / 500, 1.0):  # boxes that fit: area 8-100%, ratio 3/4-4/3 (rounded)
                assert 0.07 * w * h <= cw * ch <= w * h and 0.7 <= cw / ch <= 1.4


def test_first_batch_time_counts_from_iter():
    def slow_start():
        time.sleep(0.05)  # what a loader does before its first batch
        yield [0] * 4, None
        yield [0] * 4, None

    m = measure(slow_start())
    assert m.samples == 8 and 0.05 <= m.first_batch_s <= m.seconds


def test_a_failed_run_is_run_again_and_the_failure_kept():
    from stoker_lab.bench.peers.bench import read_with_retries

    epoch = {"kind": "epoch"}
    runs = iter([([epoch], "exit status 1: UnidentifiedImageError"), ([epoch, epoch], None)])
    rows, why, failed = read_with_retries(lambda: next(runs), epochs=2, retries=1)
    assert why is None and len(rows) == 2
    assert failed == [{"attempt": 0, "reason": "ran 1 of 2 epochs; exit status 1: UnidentifiedImageError"}]
    runs = iter([([epoch], None), ([], "timed out")])  # every try fails: the last one is reported
    rows, why, failed = read_with_retries(lambda: next(runs), epochs=2, retries=1)
    assert rows == [] and why == "ran 0 of 2 epochs; timed out" and len(failed) == 1


#: A parent that lets the kernel reap its children (SIGCHLD ignored, as Ray's raylet does), with
#: a child that burns 0.5 s of CPU and then waits to be killed.
_UNREAPED = """
import os, signal, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
    print("burnt", flush=True)
    while True:
        signal.pause()
sys.stdin.readline()
"""


def test_tree_cpu_does_not_go_negative_when_a_child_ends_unreaped():
    """The tree's CPU between two snapshots, across a child that ended without a reap inside
    the tree: the plain difference of the sums lost the child's whole past (negative); the
    delta counts it as 0 and flags the epoch's figure as a lower bound."""
    runner = _runner_module("stoker")._runner
    tick = os.sysconf("SC_CLK_TCK")
    p = subprocess.Popen([sys.executable, "-c", _UNREAPED], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "burnt"
        before = runner.tree_ticks(p.pid)
        (child,) = [k for k in before if k[0] != p.pid]
        (parent,) = [k for k in before if k[0] == p.pid]
        os.kill(child[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while child in runner.tree_ticks(p.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        after = runner.tree_ticks(p.pid)
        assert parent in after and child not in after
        plain = (sum(map(sum, after.values())) - sum(map(sum, before.values()))) / tick
        seconds, unaccounted = runner.tree_cpu_delta_s(before, after)
        assert plain <= -0.4  # what the bench used to report
        assert 0 <= seconds < 0.3 and unaccounted >= 0.4
        # had the parent reaped it, its ticks would have moved into the parent's: exact, nothing flagged
        reaped = {parent: (before[parent][0], before[parent][1] + sum(before[child]))}
        assert runner.tree_cpu_delta_s(before, reaped) == (0.0, 0.0)
    finally:
        p.stdin.close()
        p.wait(30)
