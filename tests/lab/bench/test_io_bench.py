"""``stoker bench io`` at a tiny size: the report has its shape, every figure finite (no speed asserted);
the steady-state arithmetic of its bytes-only rows on made-up marks."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from _helpers import in_child
from stoker_lab.bench.bytes_only import ROWS, BytesOnlyConfig, make_files, ragged_lengths
from stoker_lab.bench.bytes_only import run as run_bytes_only
from stoker_lab.bench.io_bench import IoConfig, run, table
from stoker_lab.bench.steady_state import boundaries, window
from stoker_lab.bench.steady_state import figures as steady_figures
from stoker_lab.bench.venvs import ready_venv

STAGES = {
    "origin->memory (obstore)",
    "origin->memory (s3fs)",
    "fill checksum pass (in memory)",
    "memory->cache (disk tier)",
    "memory->cache (memory tier)",
    "cache (disk tier)->worker",
    "cache (memory tier)->worker",
    "peer cache service->rank",
    "origin->cache (prefetcher, cold epoch)",
}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_io_bench_report(tmp_path):
    # in a child: its obstore stage starts a tokio runtime, which this process must never hold
    r = in_child(
        run,
        IoConfig(
            images=48,
            classes=3,
            reps=1,
            batch_size=16,
            shard_bytes=1 << 20,
            block_bytes=256 << 10,
            latency_ms=2,
            bandwidth_MBps=500,
            workdir=str(tmp_path / "w"),
            bytes_only_files=0,
        ),
    )
    assert {s["stage"] for s in r["stages"]} == STAGES
    assert r["machine"]["cores"] >= 1 and r["dataset"]["samples"] == 48 and r["dataset"]["bytes"] > 0
    assert r["origin"]["cold_epoch"] == {"latency_ms": 2, "bandwidth_MBps": 500}
    for s in r["stages"]:
        assert set(s) >= {"stage", "bytes", "cpu_s_per_GB", "GBps", "floor", "ratio", "exception"}
        if s["stage"] == "peer cache service->rank":
            assert s["exception"].startswith("not measured")
            continue
        assert s["bytes"] > 0 and _positive(s["cpu_s_per_GB"]) and _positive(s["GBps"]), s
        assert _positive(s["floor"]["cpu_s_per_GB"]) and _positive(s["ratio"]), s
        assert s["floor"]["what"]
    assert _positive(r["origin_to_cache_cpu_s_per_GB"])
    # the emulated origin's CPU is read in 10 ms clock ticks: 48 small images can cost it less than one
    assert r["emulated_origin_cpu_s_per_GB"] >= 0.0
    link = r["link_floor"]  # the prefetcher's floor: the same blocks over the same link, twice
    assert len(link["runs"]) == 2 and link["runs"][0]["bytes"] == link["runs"][1]["bytes"] >= r["dataset"]["bytes"]
    pf = next(s for s in r["stages"] if s["stage"] == "origin->cache (prefetcher, cold epoch)")
    assert pf["floor"]["cpu_s_per_GB"] == link["cpu_s_per_GB"] and _positive(pf["floor_direct_stages"]["cpu_s_per_GB"])
    cw = r["cold_vs_warm_worker_cpu"]
    # a tiny warm epoch can take less than one clock tick (10 ms) of worker CPU: then no ratio
    assert _positive(cw["cold_cpu_s_per_sample"]) and cw["warm_cpu_s_per_sample"] >= 0
    assert cw["ratio"] is None if cw["warm_cpu_s_per_sample"] == 0 else _positive(cw["ratio"])
    cold, warm = r["epochs"]
    assert cold["samples"] == warm["samples"] == 48 and cold["origin_bytes"] >= r["dataset"]["bytes"]
    assert warm["origin_bytes"] == 0
    assert "not measured" in r["bytes_only"]["exception"]
    json.dumps(r)  # JSON-able
    text = table(r)
    assert "origin_to_cache_cpu_s_per_GB" in text and "memory->cache (disk tier)" in text


def test_io_bench_is_a_bench_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "bench", "io", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--json" in out.stdout and "--reps" in out.stdout and "--dlio" in out.stdout


STEADY_KEYS = {"samples", "bytes", "seconds", "cpu_s", "samples_per_s", "samples_per_cpu_s", "cpu_s_per_GB"}


def test_bench_io_quick_reports_every_bytes_only_row(tmp_path):
    """``stoker bench io --quick --only-bytes``: every row, in order, with its steady-state figures,
    the first epochs apart; DLIO's rows (no environment here) skipped with how to install it."""
    out = tmp_path / "io.json"
    env = dict(os.environ, STOKER_BENCH_VENVS=str(tmp_path / "no-venvs"))
    cmd = [sys.executable, "-m", "stoker.cli", "bench", "io", "--quick", "--only-bytes"]
    cmd += ["--workdir", str(tmp_path / "w"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    bo = json.loads(out.read_text())["bytes_only"]
    rows = bo["rows"]
    assert [r["name"] for r in rows] == list(ROWS)
    files, sb = bo["files"]["count"], bo["files"]["sample_bytes"]
    assert sb == 114_660 and files == 128 and bo["config"]["workers"] == 2 and bo["config"]["batch_size"] == 64
    for r in rows:
        assert r["what"] == ROWS[r["name"]]
        if r["name"].startswith("dlio"):
            assert r["steady"] is None and "not installed" in r["skipped"] and "--make-dlio-venv" in r["skipped"]
            continue
        assert r["skipped"] is None, r
        s = r["steady"]
        assert set(s) >= STEADY_KEYS and set(s["us_per_sample"]) == {"training", "workers", "all"}
        assert s["warm_epochs"] >= 2 and s["samples"] == s["warm_epochs"] * files
        assert r["runs"]["long"]["epochs"] - r["runs"]["short"]["epochs"] == s["warm_epochs"]
        assert len(r["first_warm"]) == bo["config"]["first_warm"]
        assert r["first"]["samples"] == files and "per_cpu_s_vs_torch" in r and "per_cpu_s_vs_floor" in r
        # every sample once an epoch: the ragged set's bytes are its own lengths, the others' files * sample_bytes
        want = sum(ragged_lengths(files, sb)) if r["name"] == "stoker_ragged" else files * sb
        assert r["first"]["bytes"] == want and s["bytes"] == s["warm_epochs"] * want
    assert "stoker_fixed" in done.stdout and "dlio: skipped" in done.stdout


def test_bytes_only_files_are_exact_npy(tmp_path):
    root = make_files(str(tmp_path / "f"), 3, 1000, seed=1)
    names = sorted(os.listdir(os.path.join(root, "train")))
    assert names == ["img_00000.npy", "img_00001.npy", "img_00002.npy"]
    for n in names:
        p = os.path.join(root, "train", n)
        assert os.path.getsize(p) == 1000
        a = np.load(p)
        assert a.dtype == np.uint8 and a.shape == (1000 - 128, 1)


def test_ragged_lengths_keep_the_mean_and_vary():
    ls = ragged_lengths(128, 114_660)
    assert len(ls) == 128 and abs(sum(ls) / 128 - 114_660) <= 1
    assert min(ls) == 114_660 - 57_330 and max(ls) == 114_660 + 57_330 and ls != sorted(ls)


def _marks(epochs_cpu: list[float], per_epoch: int) -> list[dict]:
    out, cpu = [], 0.0
    for k, c in enumerate([0.0, *epochs_cpu]):
        cpu += c
        out.append(
            {
                "at": k,
                "samples": k * per_epoch,
                "bytes": k * per_epoch * 10,
                "t": float(k),
                "cpu_s": cpu,
                "training_cpu_s": cpu / 4,
            }
        )
    return out


def test_steady_state_is_the_difference_of_the_runs():
    # first epoch 5 CPU-s, 2 first warm epochs of 2, then a short run (S=2) and a long one (S + W = 5)
    # whose own fixed cost (1 CPU-s each) cancels: 1 CPU-s per warm epoch remains
    per = 100
    m = _marks([5, 2, 2], per)
    m.append(dict(m[-1], at=5, samples=5 * per, bytes=5 * per * 10, t=5.0, cpu_s=m[-1]["cpu_s"] + 2 + 1))
    m.append(dict(m[-1], at=10, samples=10 * per, bytes=10 * per * 10, t=10.0, cpu_s=m[-1]["cpu_s"] + 5 + 1))
    f = steady_figures([dict(x, kind="mark") for x in m], first_warm=2)
    assert f["first"]["cpu_s"] == 5 and [w["cpu_s"] for w in f["first_warm"]] == [2, 2]
    s = f["steady"]
    assert s["warm_epochs"] == 3 and s["samples"] == 300 and s["cpu_s"] == 3
    assert s["samples_per_cpu_s"] == 100 and s["us_per_sample"]["all"] == 1e4
    with pytest.raises(ValueError):
        steady_figures(m[:-1], first_warm=2)


def test_steady_window_covers_epochs_and_cpu():
    assert window(0.1, 10, 3.0, 400) == (8, 30)  # 3 CPU-s at 0.1 a epoch: 30 epochs, short run 30 / 4
    assert window(1.0, 10, 3.0, 400) == (3, 10)  # 10 epochs already hold 3 CPU-s
    assert window(0.0, 10, 3.0, 400) == (100, 400)  # under a clock tick an epoch: as many as allowed
    assert window(0.0, 2, 0.0, 400) == (2, 2)
    assert boundaries(2, 3, 10) == [0, 1, 2, 3, 6, 19]


@pytest.mark.skipif(
    ready_venv("dlio") is None,
    reason="DLIO's environment is not made (stoker bench io --make-dlio-venv makes it; tests do not install it)",
)
def test_bytes_only_with_dlio(tmp_path):
    r = run_bytes_only(
        BytesOnlyConfig(
            files=64,
            sample_bytes=8192,
            batch_size=16,
            workers=1,
            min_epochs=2,
            min_cpu_s=0,
            workdir=str(tmp_path / "b"),
        )
    )
    rows = {x["name"]: x for x in r["rows"]}
    for name in ("dlio", "dlio_without_debug"):
        x = rows[name]
        assert x["skipped"] is None, x["skipped"]
        assert x["dlio"]["version"] == "2.0.0" and "dlio_benchmark.main" in x["dlio"]["command"]
        assert x["first"]["samples"] == 64 and x["steady"]["samples"] == 64 * x["steady"]["warm_epochs"]
        assert x["dlio"]["debug_line"]["line"] and "global_index_map}" in x["dlio"]["debug_line"]["text"]
    assert rows["dlio_without_debug"]["dlio"]["index_map_format"]["entries"] == 64
    assert "reader_handler.py" in rows["dlio_without_debug"]["debug_cost_taken_out"]["line"]


def test_venv_marker_records_the_no_deps_packages(tmp_path):
    """An environment counts as made only for the same requirements and the same --no-deps packages."""
    from stoker_lab.bench.venvs import PEER_NO_DEPS, PEER_REQUIREMENTS

    root = tmp_path / "dlio"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("")
    reqs, nd = PEER_REQUIREMENTS["dlio"], PEER_NO_DEPS["dlio"]
    (root / ".stoker-requirements.json").write_text(json.dumps(reqs))
    assert ready_venv("dlio", path=str(root)) is None  # made without dlio-benchmark: not ready
    (root / ".stoker-requirements.json").write_text(json.dumps(reqs + ["--no-deps", *nd]))
    assert ready_venv("dlio", path=str(root)) == str(root / "bin" / "python")
    assert nd == ["dlio-benchmark==2.0.0"]
