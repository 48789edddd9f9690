"""``stoker bench io`` at a tiny size: the report has the issue's shape, every figure finite (no speed asserted)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from _helpers import in_child
from stoker_lab.bench.bytes_only import BytesOnlyConfig, make_files
from stoker_lab.bench.bytes_only import run as run_bytes_only
from stoker_lab.bench.bytes_only import table as bytes_table
from stoker_lab.bench.io_bench import IoConfig, run, table
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
    assert _positive(r["origin_to_cache_cpu_s_per_GB"]) and _positive(r["emulated_origin_cpu_s_per_GB"])
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


BYTES_KEYS = {
    "sample_bytes",
    "stoker_samples_per_s_per_core",
    "dlio_samples_per_s_per_core",
    "stoker_cpu_s_per_GB",
    "dlio_cpu_s_per_GB",
    "stoker_over_dlio",
}


def test_bytes_only_files_are_exact_npy(tmp_path):
    root = make_files(str(tmp_path / "f"), 3, 1000, seed=1)
    names = sorted(os.listdir(os.path.join(root, "train")))
    assert names == ["img_00000.npy", "img_00001.npy", "img_00002.npy"]
    for n in names:
        p = os.path.join(root, "train", n)
        assert os.path.getsize(p) == 1000
        a = np.load(p)
        assert a.dtype == np.uint8 and a.shape == (1000 - 128, 1)


def test_bytes_only_stoker_half(tmp_path, monkeypatch):
    """stoker's half at a tiny size; DLIO's half off: the report has its shape and says why DLIO is missing."""
    r = run_bytes_only(
        BytesOnlyConfig(files=40, sample_bytes=4096, batch_size=16, workers=1, dlio=False, workdir=str(tmp_path / "b"))
    )
    assert r["files"]["count"] == 32 and r["files"]["sample_bytes"] == 4096  # whole batches only
    assert "CPU-second" in r["per_core_definition"] and r["exception"] == "DLIO not run (--no-dlio)"
    assert r["dlio_version"] is None
    for src in ("local", "warm_cache"):
        row = r[src]
        assert set(row) >= BYTES_KEYS and row["sample_bytes"] == 4096 and row["what"]
        assert _positive(row["stoker_samples_per_s"])
        # a tiny warm epoch can take less than a clock tick of CPU: then no per-core figure
        assert row["stoker_samples_per_s_per_core"] is None or _positive(row["stoker_samples_per_s_per_core"])
        assert row["dlio_samples_per_s_per_core"] is None and row["stoker_over_dlio"] is None
    st = r["epochs"]["stoker"]
    assert [e["samples"] for e in st] == [32, 32, 32] and all(e["bytes"] == 32 * 4096 for e in st)
    assert st[0]["origin_bytes"] > 0 and st[1]["origin_bytes"] == st[2]["origin_bytes"] == 0
    assert r["local"]["stoker"]["epochs"] == 1 and r["warm_cache"]["stoker"]["epochs"] == 2
    json.dumps(r)
    assert "warm_cache" in bytes_table(r) and "--no-dlio" in bytes_table(r)


def test_bytes_only_dlio_missing_venv_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_BENCH_VENVS", str(tmp_path / "no-venvs"))
    r = run_bytes_only(
        BytesOnlyConfig(
            files=16,
            sample_bytes=2048,
            batch_size=16,
            workers=1,
            epochs=2,
            make_venv=False,
            workdir=str(tmp_path / "b"),
        )
    )
    assert "not present" in r["exception"] and str(tmp_path / "no-venvs") in r["exception"]
    assert r["local"]["dlio_samples_per_s_per_core"] is None and _positive(r["local"]["stoker_samples_per_s"])


@pytest.mark.skipif(
    ready_venv("dlio") is None,
    reason="DLIO's virtual environment is not made (stoker bench io --dlio makes it; tests do not install it)",
)
def test_bytes_only_with_dlio(tmp_path):
    r = run_bytes_only(
        BytesOnlyConfig(
            files=64,
            sample_bytes=8192,
            batch_size=16,
            workers=1,
            epochs=2,
            make_venv=False,
            workdir=str(tmp_path / "b"),
        )
    )
    assert r["exception"] is None, r["exception"]
    assert r["dlio_version"] == "2.0.0" and "dlio_benchmark.main" in r["dlio"]["command"]
    assert [e["samples"] for e in r["epochs"]["dlio"]] == [64, 64]
    assert _positive(r["local"]["dlio_samples_per_s_per_core"]) and _positive(r["local"]["dlio_cpu_s_per_GB"])
    assert r["dlio"]["index_map_format"]["entries"] == 64 and r["dlio"]["own_summary"]
    assert "DLIO's per-sample debug string" in bytes_table(r)


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
