"""bench cold's rows: the CPU ceiling of a cold epoch and the row of a demo report."""

import pytest

from stoker_lab.bench.cold_bench import cpu_ceiling, run, summarize


def _report(cpu_s, samples=1000, decode_bound=500.0, storage_bound=2000.0, cores=2):
    cold = {
        "loader": "stoker",
        "epoch": 0,
        "consumer_rate": 0,
        "samples": samples,
        "samples_per_s": 400.0,
        "vs_bound": 0.8,
        "first_batch_s": 0.2,
        "overlap_efficiency": 0.8,
        "origin_busy_fraction": 0.5,
        "inflight_requests": 4.0,
        "inflight_target": 8,
        "origin_bytes": 10,
        "cpu_s": cpu_s,
    }
    warm = dict(cold, epoch=1, samples_per_s=450.0, origin_bytes=0, first_batch_s=0.05)
    return {
        "limits": {"decode_bound": decode_bound, "storage_bound": storage_bound},
        "origin": {"latency_ms": 20.0, "bandwidth_MBps": 100.0},
        "machine": {"cores": cores},
        "dataset": {"samples": samples, "bytes": 10},
        "runs": [cold, warm],
    }


def test_the_cpu_ceiling_is_what_the_cores_allow_over_the_smaller_bound():
    # 6 CPU-s on 2 cores: at least 3 s for 1000 samples = 333/s, over the decode bound of 500/s
    got = cpu_ceiling(
        {"samples": 1000, "cpu_s": {"workers": 4.5, "prefetch": 1.0, "origin_emulator": 0.5}},
        {"decode_bound": 500.0, "storage_bound": 2000.0},
        cores=2,
    )
    assert got["cpu_s"] == pytest.approx(6.0) and got["cpu_floor_s"] == pytest.approx(3.0)
    assert got["cpu_ceiling_vs_bound"] == pytest.approx(1000 / 3.0 / 500.0)
    # the storage bound is the smaller one: the ceiling is over it
    got = cpu_ceiling({"samples": 1000, "cpu_s": {"workers": 1.0}}, {"decode_bound": 5000.0, "storage_bound": 250.0}, 4)
    assert got["cpu_ceiling_vs_bound"] == pytest.approx(1000 / 0.25 / 250.0)
    assert (
        cpu_ceiling({"samples": 10, "cpu_s": {}}, {"decode_bound": 1.0, "storage_bound": 1.0}, 2)[
            "cpu_ceiling_vs_bound"
        ]
        == 0.0
    )


def test_a_row_holds_the_cold_and_warm_figures_and_the_ceiling():
    row = summarize("near", _report({"workers": 3.0, "prefetch": 0.5, "main": 0.5}))
    assert row["origin"] == "near" and row["cold_vs_bound"] == 0.8 and row["warm_origin_bytes"] == 0
    assert row["warm_vs_decode_bound"] == pytest.approx(450.0 / 500.0)
    assert row["cpu_floor_s"] == pytest.approx(2.0) and row["cpu_ceiling_vs_bound"] == pytest.approx(1.0)


def test_unknown_origins_and_too_few_epochs_are_refused():
    with pytest.raises(ValueError, match="epochs"):
        run(epochs=1)
    with pytest.raises(ValueError, match="unknown origin preset 'mars'"):
        run(origins=("mars",))
