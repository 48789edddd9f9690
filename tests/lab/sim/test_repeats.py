"""Validation runs that look like training: repeats, the spread criterion, decode and an
accelerator in the namespace model (``stoker simulate --validate``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from stoker_lab.sim.reports import load_netns, netns_repeats, run_repeat
from stoker_lab.sim.validate import repeats, summary, within

REPO = Path(__file__).resolve().parents[3]
NETNS = REPO / "benchmarks" / "bench_cluster_netns.json"


def old_report() -> dict:
    return json.loads(NETNS.read_text())


def repeated(n: int = 2) -> dict:
    """The repository's report made into one of ``n`` repeats (each repeat the same rows and
    probes, the later ones' peer probe a little slower so they can be told apart)."""
    rep = old_report()
    rows = []
    probes = []
    for k in range(n):
        rows += [dict(copy.deepcopy(r), repeat=k) for r in rep["runs"]]
        probe = copy.deepcopy(rep["peer_probe"])
        probe["seconds"] += k
        probes.append(
            {
                "repeat": k,
                "control": copy.deepcopy(rep["control"]),
                "idle_busy_cores": rep.get("idle_busy_cores"),
                "peer_probe": probe,
                "local_probe": copy.deepcopy(rep.get("local_probe")),
            }
        )
    rep["runs"], rep["repeat_probes"] = rows, probes
    rep["config"] |= {"repeats": n, "consumer_rate": 100.0, "decode": True}
    rep["decode_probe"] = {"samples": 200, "cpu_s": 0.3, "seconds": 0.31, "cpu_s_per_sample": 0.0015}
    return rep


def write(tmp_path: Path, rep: dict, name: str = "r.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(rep))
    return str(path)


# 1. reports with and without repeats ------------------------------------------------------------


def test_reports_made_before_repeats_load_as_one_repeat_unchanged():
    old = ["bench_cluster_netns.json", "bench_cluster_netns_5hosts.json", "bench_cluster_netns_slow.json"]
    for name in old + ["bench_cluster_netns_faults.json"]:
        rep = load_netns(str(REPO / "benchmarks" / name))
        cut = netns_repeats(rep)
        assert [k for k, _ in cut] == [0] and cut[0][1] is rep
        assert {run_repeat(r) for r in rep["runs"]} == {0}


def test_the_training_runs_in_the_repository_hold_three_repeats_each():
    for path in sorted((REPO / "benchmarks").glob("bench_cluster_netns_train_*.json")):
        rep = load_netns(str(path))
        assert [k for k, _ in netns_repeats(rep)] == [0, 1, 2]
        assert rep["dataset"]["bytes"] >= 300e6 and min(r["seconds"] for r in rep["runs"]) >= 5.0


def test_a_report_of_repeats_is_cut_into_one_report_per_repeat_with_its_own_probes(tmp_path):
    rep = load_netns(write(tmp_path, repeated(3)))
    cut = netns_repeats(rep)
    assert [k for k, _ in cut] == [0, 1, 2]
    n = len(old_report()["runs"])
    for k, sub in cut:
        assert len(sub["runs"]) == n and {r["repeat"] for r in sub["runs"]} == {k}
        assert sub["peer_probe"]["seconds"] == pytest.approx(old_report()["peer_probe"]["seconds"] + k)
        assert sub["control"] == rep["repeat_probes"][k]["control"]
    assert len(rep["runs"]) == 3 * n  # the report itself is left whole


@pytest.mark.parametrize(
    "change,what",
    [
        (lambda r: r["runs"][0].update(repeat=2), "runs[0].repeat must be < 2, got 2"),
        (lambda r: r["runs"][0].update(repeat=-1), "runs[0].repeat must be >= 0, got -1"),
        (lambda r: r["config"].update(repeats=0), "config.repeats must be >= 1, got 0"),
        (lambda r: r["config"].update(consumer_rate=-5), "config.consumer_rate must be >= 0, got -5"),
        (lambda r: r["repeat_probes"][1].update(repeat=0), "repeat_probes[1] is not the probes of repeat 1"),
        (lambda r: r["repeat_probes"][1]["peer_probe"].update(seconds=0), "repeat_probes[1]: peer_probe: seconds"),
        (lambda r: r["decode_probe"].update(cpu_s_per_sample=0), "decode_probe.cpu_s_per_sample must be > 0"),
    ],
)
def test_bad_repeat_fields_are_refused_naming_them(tmp_path, change, what):
    rep = repeated(2)
    change(rep)
    path = write(tmp_path, rep)
    with pytest.raises(ValueError) as err:
        load_netns(path)
    assert str(err.value).startswith(f"{path}: ") and what in str(err.value)


# 2. the spread criterion ------------------------------------------------------------------------


def _row(config, repeat, meas, pred, job="job1", epoch=1):
    return {
        "config": config,
        "repeat": repeat,
        "placement": "random",
        "job": job,
        "epoch": epoch,
        "measured_s": meas,
        "predicted_s": pred,
        "time_error": pred / meas - 1,
        "measured_bytes": {"origin": 0, "host_to_host": 100},
        "predicted_bytes": {"origin": 0, "host_to_host": 100},
        "dataset_bytes": 1000,
        "in_sample": False,
    }


def test_within_says_which_criterion_an_epoch_meets():
    assert within(0.10, None) == "15%"
    assert within(-0.15, 0.5) == "15%"  # the 15% first, wherever it holds
    assert within(0.30, 0.40) == "spread"  # wider repeats: the error is inside their spread
    assert within(-0.30, 0.40) == "spread"
    assert within(0.30, 0.20) is None  # outside both
    assert within(0.30, None) is None  # no repeats
    assert within(0.14, 0.10) == "15%"
    assert within(0.16, 0.10) is None  # a spread narrower than 15% never widens it
    assert within(None, 1.0) is None


def test_summary_gives_each_configurations_spread_over_its_repeats():
    rows = [
        _row("a", 0, 10.0, 10.5),
        _row("a", 1, 12.0, 10.5),
        _row("a", 2, 14.0, 10.5),  # -25%: outside 15%, inside the spread of 40%
        _row("a", 0, 5.0, 7.0, epoch=0),  # +40%: its repeats 5.0 and 6.0 spread 20%: a miss
        _row("a", 1, 6.0, 7.0, epoch=0),  # +17%: inside that spread
        _row("b", 0, 8.0, 12.0),  # one repeat: no spread, a miss
    ]
    s = summary(rows)
    groups = {(g["config"], g["epoch"]): g for g in s["repeats"]}
    assert set(groups) == {("a", 1), ("a", 0)}  # "b" has one repeat
    g = groups[("a", 1)]
    assert g["repeats"] == [0, 1, 2] and g["measured_s"] == [10.0, 12.0, 14.0]
    assert (g["min_s"], g["max_s"], g["median_s"]) == (10.0, 14.0, 12.0)
    assert g["spread"] == pytest.approx(0.4)
    assert groups[("a", 0)]["median_s"] == pytest.approx(5.5)
    assert [r["within"] for r in rows] == ["15%", "15%", "spread", None, "spread", None]
    assert rows[2]["repeat_spread"] == pytest.approx(0.4) and rows[5]["repeat_spread"] is None
    assert s["all"]["time_within"] == 2 and s["all"]["time_within_or_spread"] == 4
    assert s["configs"]["a"]["rows"] == 5 and s["configs"]["b"]["time_within_or_spread"] == 0


def test_rows_of_two_reports_of_one_configuration_are_its_repeats():
    rows = [_row("a", 0, 10.0, 10.0), _row("a", 0, 11.0, 10.0)]  # each report's repeat 0
    (g,) = repeats(rows)
    assert g["repeats"] == [0, 0] and g["spread"] == pytest.approx(0.1)


# 3. the model's accelerator and decode ----------------------------------------------------------


@pytest.fixture
def small_workload():
    """100 samples of 100 kB in 16 MiB shards of 1 MiB blocks (the model tests' dataset)."""
    from stoker_lab.sim.workload import synthetic

    return synthetic(100, 100 * 100_000, 16 << 20, 1 << 20)


def test_decode_on_the_shared_cores_adds_its_cpu_per_sample(small_workload):
    from stoker_lab.sim.model import Job, Params, simulate

    wl = small_workload
    base = dict(
        nodes=1,
        cache_bytes=1e12,
        origin_Bps=1e12,
        local_latency_s=0.001,
        machine_cores=2.0,
        request_cores=1.0,
        chunk_samples=1,
        prefetch_chunks=1,
    )

    def warm_s(**extra) -> float:
        res = simulate(Params(**base, **extra), wl, "direct", [Job("j", 1)], 2)
        return res[-1].seconds

    plain = warm_s()
    # one rank decodes on one core at a time: 100 samples x 4 ms more
    assert warm_s(decode_cpu_s=0.004) - plain == pytest.approx(100 * 0.004, rel=1e-6)
    # an accelerator at 50 samples/s, one sample in flight: 100 x 20 ms more
    assert warm_s(gpu_rate=50.0) - plain == pytest.approx(100 / 50.0, rel=1e-6)


def test_two_decoding_ranks_on_one_core_share_it(small_workload):
    from stoker_lab.sim.model import Job, Params, simulate

    wl = small_workload
    p = Params(
        nodes=2,
        cache_bytes=1e12,
        origin_Bps=1e12,
        machine_cores=1.0,
        request_cores=1.0,
        chunk_samples=1,
        decode_cpu_s=0.01,
    )
    res = simulate(p, wl, "direct", [Job("j", 2)], 2)
    # warm: 50 samples per rank, 100 decodes of 10 ms on one core shared by both ranks
    assert res[-1].seconds == pytest.approx(100 * 0.01, rel=1e-3)


def test_netns_params_take_the_runs_accelerator_and_decode_but_not_for_a_probe():
    from stoker_lab.sim.calibrate import netns_params

    rep = repeated(1)
    p = netns_params(rep, 0.001, 0.002, decode_cpu_s=0.0015)
    assert p.gpu_rate == 100.0 and p.decode_cpu_s == 0.0015 and p.machine_cores == 2
    probe = netns_params(rep, 0.001, 0.002, decode_cpu_s=0.0015, training=False)
    assert probe.gpu_rate == 0 and probe.decode_cpu_s == 0
    rep["config"]["decode"] = False
    assert netns_params(rep, 0.001, 0.0, decode_cpu_s=0.0015).decode_cpu_s == 0
    old = netns_params(old_report(), 0.001, 0.0)  # a report made before the options
    assert old.gpu_rate == 0 and old.decode_cpu_s == 0 and old.machine_cores == 0


def test_the_local_read_time_leaves_out_the_accelerator_and_decode():
    from stoker_lab.sim.calibrate import decode_cpu, local_latency

    rep = repeated(2)
    rep["runs"] = [r for r in rep["runs"] if r["repeat"] == 0 or r["placement"] != "direct"]
    warm = [r for r in rep["runs"] if r["placement"] == "direct" and r["stoker"]["origin_bytes"] == 0]
    for r in warm:
        r["seconds"] = r["samples"] / r["ranks"] * (0.01 + 0.0015 + 0.0005)  # step + decode + read
    dec = decode_cpu(rep, "r.json")
    assert dec is not None and dec.value == 0.0015 and "decode_probe" in dec.source
    got = local_latency(rep, "r.json", dec.value)
    assert got.value == pytest.approx(0.0005) and "less" in got.source
    assert decode_cpu(old_report(), "old.json") is None


def test_every_repeat_is_modelled_on_its_own_with_its_repeat_on_each_row(tmp_path, monkeypatch):
    """The validation runs the model once per repeat (a stand-in model: only the plumbing)."""
    import stoker_lab.sim.validate as validate
    from stoker_lab.sim.calibrate import Calibrated
    from stoker_lab.sim.model import EpochResult

    rep = repeated(2)
    path = write(tmp_path, rep)
    seen = []

    def fake_simulate(p, wl, placement, jobs, epochs, together=True):
        seen.append((placement, p.gpu_rate, p.decode_cpu_s))
        return [
            EpochResult(j.name, e, 1.0, None, {"origin": 0, "host_to_host": 0, "local": 0}, 1)
            for e in range(epochs)
            for j in jobs
        ]

    monkeypatch.setattr(validate, "simulate", fake_simulate)
    monkeypatch.setattr(validate, "fit_link_factor", lambda *a, **k: Calibrated(1.0, "stand-in"))
    monkeypatch.setattr(validate, "fit_probe_cpu", lambda *a, **k: Calibrated(0.002, "stand-in"))
    monkeypatch.setattr(validate, "measure_cache_read_Bps", lambda: Calibrated(1e9, "stand-in"))
    out = validate.validate([path], None, None, measured=False)
    rows = out["rows"]
    assert len(rows) == len(rep["runs"]) and sorted({r["repeat"] for r in rows}) == [0, 1]
    assert len(seen) == 2 * 3 and all(g == 100.0 and d == 0.0015 for _, g, d in seen)
    assert out["parameters"]["decode_cpu_s"]["value"] == 0.0015
    assert f"link delivered fraction of {path} repeat 1" in out["parameters"]
    assert all(r["within"] in ("15%", "spread", None) for r in rows)
    assert {g["epoch"] for g in out["summary"]["repeats"]} == {0, 1, 2}
    assert all(len(g["repeats"]) == 2 for g in out["summary"]["repeats"])
    assert np.isfinite([g["spread"] for g in out["summary"]["repeats"]]).all()


def test_a_jobs_own_chunk_size_moves_the_same_bytes():
    from stoker_lab.sim.model import Job, Params, simulate
    from stoker_lab.sim.workload import synthetic

    wl = synthetic(600, 600 * 100_000, 16 << 20, 1 << 20)
    p = Params(nodes=3, cache_bytes=1e12, origin_Bps=1e8, nic_Bps=5e7, chunk_samples=1)
    fine = simulate(p, wl, "random", [Job("j", 3, 1)], 2)
    coarse = simulate(p, wl, "random", [Job("j", 3, 1, chunk_samples=64)], 2)
    assert [r.bytes for r in fine] == [r.bytes for r in coarse]
    assert coarse[0].seconds != fine[0].seconds  # the chunk size is used


def test_the_model_reads_a_big_rank_plan_in_coarser_chunks_and_old_runs_one_sample_a_chunk():
    from stoker_lab.sim.calibrate import model_chunk, netns_params

    assert model_chunk(old_report()) == 1  # 300 samples a rank: one a chunk, as before
    big = old_report()
    big["dataset"]["samples"] = 3300
    assert model_chunk(big) == 4
    assert netns_params(big, 0.001, 0.002).chunk_samples == 4
    assert netns_params(big, 0.001, 0.002, training=False).chunk_samples == 1  # a probe: one a chunk


def test_a_training_run_reads_its_node_cache_as_fast_as_its_own_local_probe():
    from stoker_lab.sim.calibrate import probe_local_latency

    rep = repeated(1)
    probe = rep["repeat_probes"][0]["local_probe"]
    rep["local_probe"] = probe
    most = max(len(ids) for ids in probe["ids"])
    got = probe_local_latency(rep, "r.json")
    assert got is not None and got.value == pytest.approx(probe["seconds"] / most) and "local probe" in got.source
    assert probe_local_latency(old_report(), "old.json") is None  # its warm epochs are the reads themselves
    rep.pop("local_probe")
    assert probe_local_latency(rep, "r.json") is None
