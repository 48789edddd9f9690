"""The demo end to end at a tiny size: the report has every field the demo's targets need, and holds true."""

import json

from stoker_lab.bench.demo import DemoConfig, run_demo


def test_demo_report(tmp_path):
    out = tmp_path / "demo.json"
    plot = tmp_path / "demo.png"
    report = run_demo(
        DemoConfig(
            images=96,
            classes=3,
            epochs=2,
            consumer_rate=3000.0,
            baseline_samples=32,
            batch_size=16,
            latency_ms=5,
            bandwidth_MBps=200,
            workdir=str(tmp_path / "w"),
            json_path=str(out),
            plot_path=str(plot),
        )
    )
    data = json.loads(out.read_text())
    assert data["dataset"]["samples"] == 96 and data["dataset"]["bytes"] > 0
    assert data["origin"] == {**data["origin"], "latency_ms": 5, "bandwidth_MBps": 200}
    assert set(data["limits"]) >= {"decode_per_core", "workers", "decode_bound", "storage_bound"}
    runs = data["runs"]
    fields = {
        "loader",
        "epoch",
        "consumer_rate",
        "samples",
        "seconds",
        "samples_per_s",
        "stall_fraction",
        "origin_bytes",
        "cache_hit_ratio",
        "exactly_once",
    }
    assert all(fields <= set(r) for r in runs)
    stoker_runs = [r for r in runs if r["loader"] == "stoker"]
    assert len(stoker_runs) == 4 and {r["consumer_rate"] for r in stoker_runs} == {0.0, 3000.0}
    assert all(r["exactly_once"] and r["samples"] == 96 for r in stoker_runs)
    for r in stoker_runs:
        if r["epoch"] == 0:
            assert r["origin_bytes"] >= data["dataset"]["bytes"]  # cold: everything from the origin
        else:
            assert r["origin_bytes"] == 0 and r["cache_hit_ratio"] == 1.0  # warm: nothing
    base = [r for r in runs if r["loader"] == "baseline"]
    assert len(base) == 2 and all(r["samples"] >= 32 and r["origin_bytes"] > 0 for r in base)
    assert report["checks"]["warm_origin_bytes"]["ok"] and report["checks"]["exactly_once"]["ok"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_command_line(tmp_path):
    """The `stoker demo` entry point (what `make demo` runs), at a tiny size, with --strict off."""
    import subprocess
    import sys

    out = tmp_path / "d.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.cli",
            "demo",
            "--images",
            "48",
            "--classes",
            "3",
            "--epochs",
            "2",
            "--baseline-samples",
            "16",
            "--batch-size",
            "16",
            "--consumer-rate",
            "0",
            "--latency-ms",
            "1",
            "--bandwidth-mbps",
            "500",
            "--workdir",
            str(tmp_path / "w"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {r["consumer_rate"] for r in data["runs"]} == {0.0}
    assert [r["epoch"] for r in data["runs"] if r["loader"] == "stoker"] == [0, 1]
    assert "exactly_once" in res.stdout and "warm_vs_baseline" in res.stdout
