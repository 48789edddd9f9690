"""The model's mechanics on tiny cases with closed-form answers, and that its decisions are
stoker's own (a change to the product changes the model's answer)."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import flow_finish_times
from stoker_lab.sim import Job, Params, max_min_rates, simulate, synthetic
from stoker_lab.sim.decide import ClusterState, epoch_plans, place_job
from stoker_lab.sim.workload import Workload


def _run_flows(caps: dict, flows: list[tuple[float, dict]], incremental: bool = True) -> list[float]:
    """Finish times of flows ``(start_s, {link: bytes})`` on links ``caps``."""
    return flow_finish_times(caps, flows, incremental=incremental)


def test_one_flow_takes_bytes_over_bandwidth():
    assert _run_flows({"l": 100.0}, [(0.0, {"l": 1000.0})]) == [pytest.approx(10.0)]


def test_two_flows_share_a_link_fairly():
    # both at 50 B/s: the 500-byte flow ends at 10 s; the other then has the link alone
    # and sends its remaining 500 bytes in 5 s
    assert _run_flows({"l": 100.0}, [(0.0, {"l": 500.0}), (0.0, {"l": 1000.0})]) == [
        pytest.approx(10.0),
        pytest.approx(15.0),
    ]


def test_a_late_flow_takes_its_share_from_then_on():
    # the first alone for 5 s (500 bytes), then 50/50: its last 500 bytes end at 15 s; the
    # second sent 500 by then and has the link alone for its last 500: 5 s more
    assert _run_flows({"l": 100.0}, [(0.0, {"l": 1000.0}), (5.0, {"l": 1000.0})]) == [
        pytest.approx(15.0),
        pytest.approx(20.0),
    ]


def test_max_min_gives_the_unbottlenecked_flow_the_rest():
    # flows A (links 1, 2), B (link 1), C (link 2); link 1 = 10, link 2 = 4:
    # A and C share link 2 at 2 each; B gets link 1's remaining 8
    rates = max_min_rates(np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0]]), np.array([10.0, 4.0]))
    assert rates == pytest.approx([2.0, 8.0, 2.0])


def test_a_flow_over_two_links_waits_for_the_slower_part():
    # 100 bytes on a 10 B/s link and 100 on a 50 B/s link, together: 10 s
    assert _run_flows({"a": 10.0, "b": 50.0}, [(0.0, {"a": 100.0, "b": 100.0})]) == [pytest.approx(10.0)]


def test_max_min_rejects_bad_shapes():
    with pytest.raises(ValueError):
        max_min_rates(np.ones((2, 3)), np.ones(2))


def _tiny(samples=64, blocks_of=8) -> Workload:
    n = samples
    return Workload(
        np.full(n, 1000, dtype=np.int64),
        np.arange(n, dtype=np.int64) // blocks_of,
        np.full(n // blocks_of, 1000 * blocks_of, dtype=np.int64),
        "tiny",
    )


def test_one_reader_on_a_cold_origin_takes_bytes_over_bandwidth():
    wl = _tiny()
    p = Params(nodes=1, cache_bytes=1e9, origin_Bps=1000.0, chunk_samples=8)
    (r,) = simulate(p, wl, "direct", [Job("j", 1)], 1)
    assert r.bytes["origin"] == wl.block_bytes.sum()
    assert r.seconds == pytest.approx(wl.block_bytes.sum() / 1000.0)


def test_latency_per_request_adds_up_for_a_serial_reader():
    wl = _tiny()
    p = Params(nodes=1, cache_bytes=1e9, origin_Bps=1e12, origin_latency_s=0.5, chunk_samples=8)
    (r,) = simulate(p, wl, "direct", [Job("j", 1)], 1)
    assert r.seconds == pytest.approx(wl.num_blocks * 0.5, rel=1e-6)  # one request per block, one at a time


@pytest.mark.parametrize("setup", ["direct", "random", "colocated"])
def test_a_cache_that_holds_everything_reads_nothing_remote_in_epoch_2(setup):
    wl = _tiny()
    p = Params(nodes=2, cache_bytes=1e9, origin_Bps=1000.0, nic_Bps=1000.0, chunk_samples=4)
    res = simulate(p, wl, setup, [Job("j", 2, seed=3)], 2)
    assert res[0].bytes["origin"] > 0
    assert res[1].bytes["origin"] == 0


def test_a_cache_that_holds_nothing_reads_every_sample_from_the_origin_each_epoch():
    wl = _tiny()
    p = Params(nodes=1, cache_bytes=0, origin_Bps=1000.0, chunk_samples=8)
    res = simulate(p, wl, "direct", [Job("j", 1)], 2)
    assert [r.bytes["origin"] for r in res] == [wl.total_bytes, wl.total_bytes]


def test_gpu_bound_epoch_takes_samples_over_rate_and_reports_full_utilization():
    wl = _tiny()
    p = Params(nodes=1, cache_bytes=1e9, origin_Bps=1e12, gpu_rate=10.0, chunk_samples=8, prefetch_chunks=2)
    res = simulate(p, wl, "direct", [Job("j", 1)], 2)
    assert res[1].seconds == pytest.approx(wl.num_samples / 10.0)
    assert res[1].gpu_utilization == pytest.approx(1.0)


def test_decode_bound_epoch_takes_samples_over_cores_times_rate():
    wl = _tiny()
    p = Params(
        nodes=1, cache_bytes=1e9, origin_Bps=1e12, decode_cores=2, decode_rate=4.0, chunk_samples=8, prefetch_chunks=4
    )
    res = simulate(p, wl, "direct", [Job("j", 1)], 2)
    assert res[1].seconds == pytest.approx(wl.num_samples / 8.0)


def test_colocated_plans_read_locally_where_random_ones_go_to_peers():
    wl = synthetic(400, 400 * 50_000, 4 << 20, 1 << 20, seed=1)
    p = Params(nodes=4, cache_bytes=1e9, origin_Bps=1e8, nic_Bps=1e8, chunk_samples=16)
    colo = simulate(p, wl, "colocated", [Job("j", 4)], 2)[1].bytes
    rand = simulate(p, wl, "random", [Job("j", 4, seed=1)], 2)[1].bytes
    assert colo["host_to_host"] < 0.2 * rand["host_to_host"]
    assert colo["local"] + colo["host_to_host"] == pytest.approx(rand["local"] + rand["host_to_host"])


def test_the_model_uses_stokers_own_plans(monkeypatch):
    """A change to the product's rank split changes the model's answer."""
    import stoker_lab.sim.decide as decide

    wl = synthetic(120, 120 * 50_000, 4 << 20, 1 << 20)
    state = ClusterState(3, wl)
    pl = place_job("random", state, wl, 3, np.full(3, 1e9), 1, None)
    before = [x.copy() for x in epoch_plans("random", wl, pl, 0)]
    monkeypatch.setattr(decide, "rank_plan", lambda perm, r, w, even="pad": np.sort(perm)[r::w])
    after = epoch_plans("random", wl, pl, 0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_synthetic_blocks_cover_every_sample_with_tar_overhead():
    wl = synthetic(900, 58_271_312, 16 << 20, 1 << 20)
    assert wl.total_bytes == 58_271_312
    assert wl.block_bytes.sum() > wl.total_bytes  # headers and padding are fetched too
    assert set(np.unique(wl.sample_block)) == set(range(wl.num_blocks))


def test_synthetic_rejects_bad_sizes():
    with pytest.raises(ValueError, match="bad workload"):
        synthetic(0, 10, 1, 1)


def test_cli_tdcs_writes_rows_for_every_setup_with_assumptions(tmp_path):
    import json

    from stoker.cli import main

    out = tmp_path / "t.json"
    assert (
        main(
            [
                "simulate",
                "tdcs",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--samples",
                "4000",
                "--epochs",
                "2",
                "--decode-rate",
                "500",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    assert {r["setup"] for r in rep["rows"]} == {"direct", "random", "presence", "colocated"}
    assert all(v["source"] for v in rep["assumptions"].values())
    row = rep["rows"][0]
    assert {"gpus", "epoch_s", "gpu_utilization", "bytes", "epoch", "nodes"} <= set(row)
    warm = {r["setup"]: r for r in rep["rows"] if r["epoch"] == 1}
    assert warm["colocated"]["bytes"]["origin"] < warm["direct"]["bytes"]["origin"]


def test_validation_summary_counts_rows_within_tolerance():
    from stoker_lab.sim.validate import summary

    def row(meas_s, pred_s, meas_b, pred_b, in_sample=False):
        return {
            "time_error": pred_s / meas_s - 1,
            "measured_s": meas_s,
            "predicted_s": pred_s,
            "measured_bytes": {"origin": meas_b, "host_to_host": 0},
            "predicted_bytes": {"origin": pred_b, "host_to_host": 0},
            "dataset_bytes": 1_000_000,
            "in_sample": in_sample,
        }

    rows = [row(10, 11, 500_000, 510_000), row(10, 13, 500_000, 600_000, True), row(10, 10, 1000, 5000)]
    s = summary(rows)
    assert s["all"] | {"tiny": None} == {
        "rows": 3,
        "time_rows": 3,
        "time_within": 2,
        "time_within_or_spread": 2,  # no repeats: the 15% alone
        "bytes_within": 2,
        "tiny": None,
    }  # 5000 vs 1000 B: under 1% of the data
    assert s["out_of_sample"]["time_within"] == 2 and s["out_of_sample"]["bytes_within"] == 2


def test_validation_judges_tiny_epochs_by_absolute_error_apart():
    from stoker_lab.sim.validate import summary

    rows = [
        {
            "time_error": 0.3 / 0.1 - 1,
            "measured_s": 0.1,
            "predicted_s": 0.3,
            "dataset_bytes": 1_000_000,
            "measured_bytes": {"origin": 0},
            "predicted_bytes": {"origin": 0},
            "in_sample": False,
        },
        {
            "time_error": 0.0,
            "measured_s": 2.0,
            "predicted_s": 2.0,
            "dataset_bytes": 1_000_000,
            "measured_bytes": {"origin": 0},
            "predicted_bytes": {"origin": 0},
            "in_sample": False,
        },
    ]
    s = summary(rows)["all"]
    assert (s["time_rows"], s["time_within"]) == (1, 1)  # the 0.1 s epoch is not a +200% miss
    assert s["tiny"]["rows"] == 1 and s["tiny"]["max_abs_error_s"] == pytest.approx(0.2)


def _per_flow_max_min(load: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Progressive filling one flow at a time (dense, every flow its own row): the reference."""
    rate = np.zeros(len(load))
    left, active = cap.astype(float).copy(), np.ones(len(load), dtype=bool)
    while active.any():
        per_link = load[active].sum(axis=0)
        used = per_link > 0
        step = np.min(left[used] / per_link[used])
        rate[active] += step
        left[used] -= step * per_link[used]
        full = used & (left <= 1e-9 * cap)
        active &= ~(load[:, full] > 0).any(axis=1)
    return rate


@pytest.mark.parametrize("seed", range(5))
def test_aggregated_classes_get_the_per_flow_max_min_rates(seed):
    # distinct paths (random loads on 6 links, some single-link), each repeated 1-4 times:
    # one row per class with its multiplicity gives every flow of it the per-flow rate
    rng = np.random.default_rng(seed)
    classes = rng.random((7, 6)) * (rng.random((7, 6)) < 0.5)
    classes[0], classes[1] = [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]
    classes[classes.sum(axis=1) == 0, 2] = 1.0
    classes /= classes.max(axis=1, keepdims=True)
    mult = rng.integers(1, 5, len(classes))
    cap = rng.uniform(1, 10, 6)
    expected = _per_flow_max_min(np.repeat(classes, mult, axis=0), cap)
    got = np.repeat(max_min_rates(classes, cap, weights=mult), mult)
    assert got == pytest.approx(expected, rel=1e-9)


def test_peer_requests_share_the_machines_cores():
    # warm epoch, links free: every peer request costs 10 ms of CPU on one core that both ranks
    # share, so the epoch takes the job's peer requests x 10 ms (work-conserving), not the share
    # of the busier rank
    wl = _tiny()
    p = Params(nodes=2, cache_bytes=1e9, origin_Bps=1e12, machine_cores=1.0, peer_cpu_s=0.01, chunk_samples=4)
    warm = simulate(p, wl, "random", [Job("j", 2, seed=3)], 2)[1]
    requests = warm.bytes["host_to_host"] / 1000
    assert requests > 0
    assert warm.seconds == pytest.approx(requests * 0.01)


def test_a_reader_of_a_block_being_filled_waits_for_the_fill():
    # two readers on one node want samples of the same 2000-byte block at once: the first
    # fills it over a 1000 B/s origin (2 s); the second reads it once it has landed, not at once
    from stoker_lab.sim.model import _Run

    wl = Workload(np.full(2, 1000, dtype=np.int64), np.zeros(2, dtype=np.int64), np.array([2000]), "one")
    run = _Run(Params(nodes=1, cache_bytes=1e9, origin_Bps=1000.0, chunk_samples=1), wl, "direct", 1)
    seconds = [0.0, 0.0]
    for s in (0, 1):
        run.env.process(run.rank(0, np.array([s]), np.full(1, -1), seconds, s))
    run.env.run()
    assert seconds == [pytest.approx(2.0), pytest.approx(2.0)]
    assert run.counts["origin"] == 2000  # fetched once


@pytest.mark.parametrize("seed", range(4))
def test_incremental_rates_equal_a_full_recomputation_every_time(seed):
    # random flows over shared links (some of them used only by single-link flows, as a node's
    # decode cores are), starting at random times: the incremental path (closed form on a solo
    # link's component; filling on the active links, checked on the rest) finishes every flow
    # when recomputing every class on every link does
    rng = np.random.default_rng(seed)
    caps = {f"l{i}": float(rng.uniform(50, 500)) for i in range(8)} | {"solo0": 100.0, "solo1": 70.0, "inf": np.inf}
    multi = [f"l{i}" for i in range(8)] + ["inf"]
    flows = []
    for _ in range(60):
        start = float(rng.choice([0.0, 0.5, 1.0, rng.uniform(0, 20)]))
        if rng.random() < 0.35:  # one limited link, and at times more bytes on an unlimited one
            parts = {str(rng.choice(["solo0", "solo1"])): float(rng.integers(10, 400))}
            if rng.random() < 0.5:
                parts["inf"] = float(rng.integers(10, 800))
        else:
            on = rng.choice(multi, size=int(rng.integers(1, 6)), replace=False)
            parts = {str(k): float(rng.integers(1, 400)) for k in on}
            if rng.random() < 0.3:  # identical flows: one class with a multiplicity
                flows.append((start, dict(parts)))
        flows.append((start, parts))
    full = _run_flows(caps, flows, incremental=False)
    fast = _run_flows(caps, flows)
    assert fast == pytest.approx(full, rel=1e-9)
    assert len(set(np.round(full, 6))) > 20  # the flows did contend (not all alone)


def test_equal_budgets_place_blocks_alike_whatever_their_value():
    # the model remembers one placement for every cache size with equal budgets on that ground
    from stoker.cluster.placement import bounded_owners

    keys = [f"d/{b}" for b in range(300)]
    nodes = [f"node{i:03d}" for i in range(5)]
    sizes = np.random.default_rng(0).integers(1, 1000, 300)
    small, large = bounded_owners(keys, nodes, [3e8] * 5, sizes), bounded_owners(keys, nodes, [7.5e9] * 5, sizes)
    assert np.array_equal(small, large)


def test_validate_uses_reports_with_fault_runs_and_leaves_out_those_without_a_cold_direct_epoch(tmp_path):
    # fault runs come after the placements and apart from their epochs: such a report is used;
    # one without a cold direct epoch (the links' rate is fitted on it) is left out, saying why
    import json
    from pathlib import Path

    from stoker_lab.cli.simulate import default_netns

    real = json.loads((Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cluster_netns.json").read_text())
    assert real["faults"] and any(r["placement"] == "direct" for r in real["runs"])

    def report(name, placements):
        rep = dict(real, runs=[r for r in real["runs"] if r["placement"] in placements])
        path = tmp_path / name
        path.write_text(json.dumps(rep))
        return str(path)

    full = report("full.json", ["direct", "random", "colocated"])
    only = report("faults.json", ["colocated"])
    used, skipped = default_netns([full, only])
    assert used == [full]
    assert len(skipped) == 1 and "faults.json" in skipped[0] and "no cold direct epoch" in skipped[0]


def test_scaling_points_count_the_bytes_of_jobs_run_together_once():
    # jobs run together share the epoch's byte counts (each job's row carries the group's): a
    # point's bytes per epoch are the group's, not the sum of its rows
    from stoker_lab.sim.scaling import _point
    from stoker_lab.sim.tdcs import TdcsConfig, run_setup, workload

    cfg = TdcsConfig(nodes=2, gpus_per_node=2, samples=3000, jobs=2, epochs=2, decode_rate=500.0)
    rows = run_setup(cfg, "random", workload(cfg))
    group = {r["epoch"]: r["bytes"] for r in rows}
    assert all(r["bytes"] == group[r["epoch"]] for r in rows)
    pt = _point(cfg, "random", {})
    assert pt["bytes_per_epoch"]["origin"] == pytest.approx((group[0]["origin"] + group[1]["origin"]) / 2)
    assert pt["warm_bytes_per_epoch"]["host_to_host"] == pytest.approx(group[1]["host_to_host"])
