"""`stoker plan --no-read-ahead` and its setups that stand for the bench's placements: closed-form
epochs of ranks that read, decode and then step, and the plan of each training-like namespace
cluster report (benchmarks/bench_cluster_netns_train_*.json) set against its measured epochs
(stoker_lab.cli.plan_check). The errors are computed and reported (docs/simulation.md), not held
to a tolerance: the runs share one 2-core machine, which plan does not model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from stoker.cli import main
from stoker_lab.cli.plan_check import BENCH_TO_PLAN, compare, plan_argv, run_plan
from stoker_lab.sim.plan import SETUP_NOTES, plan
from stoker_lab.sim.tdcs import TdcsConfig, workload

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
REPORTS = [
    "bench_cluster_netns_train_3hosts.json",
    "bench_cluster_netns_train_3hosts_slow_decode.json",
    "bench_cluster_netns_train_5hosts_decode.json",
]
MB = 10**6
#: One node, one GPU at 125 samples/s, 2,000 samples of 100 kB from a 100 Mbit/s origin with no
#: request latency: 16 s of reading (200 MB at 12.5 MB/s) and 16 s of GPU steps an epoch.
ONE = TdcsConfig(
    nodes=1,
    gpus_per_node=1,
    gpu_rate=125.0,
    samples=2000,
    mean_sample_bytes=100_000,
    store_gbit=0.1,
    store_latency_ms=0.0,
    decode_cores=0,
    epochs=1,
)


def _epoch(cfg: TdcsConfig, setup: str = "direct") -> float:
    return plan(cfg, 1, setups=(setup,))["setups"][setup]["epoch_s"][0]


def test_without_read_ahead_a_rank_adds_its_reads_to_its_steps():
    # read-ahead hides the 16 s of reading behind the 16 s of steps but its first chunk (250
    # samples, 25 MB: 2 s); without it each sample is read, then stepped: 32 s
    assert _epoch(ONE) == pytest.approx(18.0, rel=0.02)
    assert _epoch(replace(ONE, read_ahead=False)) == pytest.approx(32.0, rel=0.02)


def test_without_read_ahead_decode_and_request_latency_add_too():
    # one decode core at 250 samples/s: 8 s more; a 2 ms request for each sample (direct: no
    # cache, a range read a sample) one at a time: 4 s more
    decode = replace(ONE, read_ahead=False, decode_cores=1, decode_rate=250.0)
    assert _epoch(decode) == pytest.approx(40.0, rel=0.02)
    slow = replace(decode, store_latency_ms=2.0)
    assert _epoch(slow) - _epoch(decode) == pytest.approx(2000 * 0.002, rel=0.02)


def test_direct_cached_caches_on_each_node_and_direct_caches_nothing():
    cfg = replace(ONE, nodes=2, samples=4000, epochs=2, store_gbit=10.0, gpu_rate=1000.0, read_ahead=False)
    rep = plan(cfg, 500 * MB, setups=("direct", "direct-cached"))  # each node can hold it all
    cached, direct = rep["setups"]["direct-cached"]["bytes"], rep["setups"]["direct"]["bytes"]
    # each node fills every block its own rank reads, once (most in the cold epoch, the few its
    # rank first reads in the warm one), and asks no peer: the blocks' bytes twice over two epochs
    blocks = float(workload(cfg).block_bytes.sum())
    assert sum(cached["origin"]) == pytest.approx(2 * blocks, rel=1e-9)
    assert cached["origin"][1] < 0.01 * cached["origin"][0] and cached["host_to_host"] == [0, 0]
    assert direct["origin"] == [pytest.approx(400 * MB, rel=1e-6)] * 2 and direct["local"] == [0, 0]
    assert rep["setup_notes"]["direct-cached"]["bench_placement"] == "direct"
    assert rep["setup_notes"]["direct"]["bench_placement"] is None
    assert rep["colocated_changes_min_cache"]["changes"] is None


def test_every_bench_placement_has_a_plan_setup_that_says_how_it_differs():
    for placement, setup in BENCH_TO_PLAN.items():
        assert SETUP_NOTES[setup]["bench_placement"] == placement
        assert SETUP_NOTES[setup]["differs"] and SETUP_NOTES[setup]["model"]


def test_the_command_line_takes_no_read_ahead_peer_latency_and_setups(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--nodes", "2", "--gpus-per-node", "1", "--gpu-rate", "100", "--samples", "1000"]
    argv += ["--dataset-bytes", "100MB", "--cache-per-node", "60MB", "--decode-cores", "0", "--epochs", "2"]
    argv += ["--no-read-ahead", "--peer-latency", "15ms", "--setups", "direct-cached,colocated", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert set(rep["setups"]) == {"direct-cached", "colocated"}
    assert rep["assumptions"]["read_ahead"]["value"] is False
    assert rep["assumptions"]["read_ahead"]["source"].startswith("given (--no-read-ahead)")
    assert rep["assumptions"]["peer_latency_ms"]["value"] == pytest.approx(15.0)
    assert "direct-cached: ranks placed as direct" in printed and "the bench's direct" in printed


def test_an_unknown_setup_is_refused_in_one_line(capsys):
    argv = ["plan", "--nodes", "2", "--gpus-per-node", "1", "--gpu-rate", "100", "--samples", "1000"]
    assert main([*argv, "--dataset-bytes", "100MB", "--cache-per-node", "60MB", "--setups", "direct,cached"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stoker plan: --setups 'direct,cached': give some of direct")


@pytest.mark.parametrize("name", REPORTS)
def test_the_plan_input_is_the_reports_own_figures(name):
    report = json.loads((BENCH / name).read_text())
    argv = plan_argv(report)
    opt = {
        argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--") and argv[i + 1][:2] != "--"
    }
    cfg = report["config"]
    assert opt["--nodes"] == str(report["hosts"])
    assert int(opt["--gpus-per-node"]) * report["hosts"] == cfg["ranks_per_job"]
    assert float(opt["--gpu-rate"]) == cfg["consumer_rate"]
    assert opt["--samples"] == str(report["dataset"]["samples"])
    assert opt["--dataset-bytes"] == f"{report['dataset']['bytes']}B"
    assert opt["--cache-per-node"] == f"{cfg['cache_bytes_per_node']}B"
    assert opt["--origin-bandwidth"] == f"{report['links']['origin']['mbit']:g}Mbit"
    assert "--no-read-ahead" in argv
    if cfg["decode"]:
        rate = float(opt["--decode-rate"])
        assert rate == pytest.approx(1 / report["decode_probe"]["cpu_s_per_sample"], rel=1e-5)
        assert opt["--decode-cores"] == "1"
    else:
        assert opt["--decode-cores"] == "0"


def test_each_training_run_is_compared_epoch_by_epoch_with_its_errors():
    for name in REPORTS:
        report = json.loads((BENCH / name).read_text())
        argv = plan_argv(report)
        rep = run_plan(argv)
        res = compare(report, name, rep)
        rows = res["rows"]
        # 3 placements x 2 jobs x 2 epochs, each with the plan's time and the repeats' median
        assert {(r["placement"], r["job"], r["epoch"]) for r in rows} == {
            (p, j, e) for p in BENCH_TO_PLAN for j in ("job1", "job2") for e in (0, 1)
        }
        for r in rows:
            assert r["setup"] == BENCH_TO_PLAN[r["placement"]]
            assert len(r["measured_s"]) == report["config"]["repeats"]
            assert r["predicted_s"] == rep["setups"][r["setup"]]["epoch_s"][r["plan_epoch"]]
            assert r["error"] == pytest.approx(r["predicted_s"] / r["median_s"] - 1)
            assert math.isfinite(r["error"]) and r["predicted_s"] > 0
        # the cold epoch of each placement is the longest the plan gives it
        for s in BENCH_TO_PLAN.values():
            cold, warm = rep["setups"][s]["epoch_s"]
            assert cold > warm, (name, s)
        summary = res["summary"]["all"]
        assert summary["rows"] == 12 and 0 <= summary["within_15pct"] <= 12
        assert summary["largest_abs_error"] >= summary["median_abs_error"] >= 0
