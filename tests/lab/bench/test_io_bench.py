"""``stoker bench io`` at a tiny size: the report has the issue's shape, every figure finite (no speed asserted)."""
import json
import math
import subprocess
import sys

from stoker_lab.bench.io_bench import IoConfig, run, table

STAGES = {"origin->memory (obstore)", "origin->memory (s3fs)", "fill checksum pass (in memory)",
          "memory->cache (disk tier)", "memory->cache (memory tier)", "cache (disk tier)->worker",
          "cache (memory tier)->worker", "peer cache service->rank", "origin->cache (prefetcher, cold epoch)"}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_io_bench_report(tmp_path):
    r = run(IoConfig(images=48, classes=3, reps=1, batch_size=16, shard_bytes=1 << 20, block_bytes=256 << 10,
                     latency_ms=2, bandwidth_MBps=500, workdir=str(tmp_path / "w")))
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
    out = subprocess.run([sys.executable, "-m", "stoker.cli", "bench", "io", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--json" in out.stdout and "--reps" in out.stdout
