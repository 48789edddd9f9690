"""Ranks that start apart (a measured run's start-up skew) on tiny cases with closed-form answers:
each rank's seconds run from its own start, the epoch's are the largest of them, a rank that has
not started yet neither loads a link nor, unless its start-up is modelled, the shared cores; and
the measured rank hosts and starts are read from a report and fitted on as it recorded them."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from stoker_lab.sim import FlowNetwork, Job, Params, simulate
from stoker_lab.sim.workload import Workload

BYTES, RATE = 1000, 1000.0  # bytes per sample, origin bytes/s


def _samples(n=64, per_block=1) -> Workload:
    return Workload(
        np.full(n, BYTES, dtype=np.int64),
        np.arange(n, dtype=np.int64) // per_block,
        np.full(n // per_block, BYTES * per_block, dtype=np.int64),
        "skew",
    )


def _origin_epoch(starts: list[float] | None):
    # two nodes reading from the origin for themselves (direct): each rank fetches its 32 samples
    # (32,000 bytes) over the one origin link of 1000 B/s
    p = Params(nodes=2, cache_bytes=1e9, origin_Bps=RATE, chunk_samples=8)
    job = Job("j", 2, start_s={0: starts} if starts is not None else {})
    (r,) = simulate(p, _samples(), "direct", [job], 1)
    return r


def test_ranks_starting_together_share_the_link():
    r = _origin_epoch(None)
    assert r.rank_seconds == [pytest.approx(64.0), pytest.approx(64.0)]  # 500 B/s each
    assert r.seconds == pytest.approx(64.0)


def test_a_rank_starting_after_the_other_finished_takes_bytes_over_bandwidth_alone():
    r = _origin_epoch([0.0, 100.0])
    assert r.rank_seconds == [pytest.approx(32.0), pytest.approx(32.0)]
    assert r.seconds == pytest.approx(32.0)  # each rank's own seconds, not the 132 s from first start to last end
    assert r.bytes["origin"] == 64 * BYTES


def test_overlapping_ranks_share_the_link_only_while_both_run():
    # rank 1 starts at 16 s: rank 0 alone moves 16,000 bytes, then both at 500 B/s until rank 0's
    # last 16,000 are through (48 s); rank 1 has 16,000 by then and the link alone for the rest
    r = _origin_epoch([0.0, 16.0])
    assert r.rank_seconds == [pytest.approx(48.0), pytest.approx(48.0)]
    assert _origin_epoch([16.0, 0.0]).rank_seconds == [pytest.approx(48.0), pytest.approx(48.0)]


def test_start_offsets_must_be_one_per_rank_and_not_negative():
    with pytest.raises(ValueError, match="job 'j' epoch 0"):
        _origin_epoch([0.0])
    with pytest.raises(ValueError):
        _origin_epoch([0.0, -1.0])


def test_a_stopped_flow_ends_now_and_keeps_only_what_it_moved():
    # flows A (1000 bytes) and B (no end of its own) share a 100 B/s link; B is stopped at 4 s
    # after 200 bytes: A has 800 left, alone at 100 B/s, and ends at 12 s
    env = simpy.Environment()
    net = FlowNetwork(env, {"l": 100.0})
    done: dict[str, float] = {}

    def a():
        yield net.transfer({"l": 1000.0})
        done["a"] = env.now

    def b():
        flow = net.transfer({"l": 1e6})
        yield env.timeout(4.0)
        net.stop(flow)
        assert flow.triggered
        with pytest.raises(ValueError):
            net.stop(flow)  # no longer in progress

    env.process(a())
    env.process(b())
    env.run()
    assert done["a"] == pytest.approx(12.0)
    assert net.bytes_on["l"] == pytest.approx(1200.0)


def _peer_epoch(starting_processes: int, peer_cpu_s=0.01, late_s=10.0):
    """Epoch 1 (warm) of two ranks on nodes 0 and 1 reading each other's blocks, every peer request
    costing ``peer_cpu_s`` on one shared core and nothing else taking time; rank 1 starts ``late_s``
    after rank 0. Returns the result and each rank's peer samples (from stoker's own decisions)."""
    from stoker_lab.sim.decide import ClusterState, dataset_budget, epoch_plans, place_job

    wl = _samples(64, per_block=8)
    p = Params(
        nodes=2,
        cache_bytes=1e9,
        origin_Bps=1e12,
        chunk_samples=1,
        machine_cores=1.0,
        peer_cpu_s=peer_cpu_s,
        starting_processes=starting_processes,
    )
    job = Job("j", 2, seed=1, rank_nodes=[0, 1], start_s={1: [0.0, late_s]})
    res = simulate(p, wl, "random", [job], 2)
    pl = place_job("random", ClusterState(2, wl), wl, 2, np.full(2, float(dataset_budget(1e9, wl, 1))), 1, None, [0, 1])
    plans = epoch_plans("random", wl, pl, 1)
    peers = [int((pl.owner[wl.sample_block[plan]] != node).sum()) for node, plan in enumerate([*plans])]
    return res[1], peers


def test_a_late_rank_takes_nothing_from_the_running_one_unless_its_start_up_is_modelled():
    # rank 0 alone: its peer requests have the core to themselves (n0 x 10 ms); with k processes
    # starting rank 1 meanwhile, they get 1 / (k + 1) of it; rank 1 then runs alone (n1 x 10 ms)
    for k in (0, 1, 2):
        r, (n0, n1) = _peer_epoch(k)
        assert n0 > 0 and n1 > 0
        assert r.rank_seconds == [pytest.approx((k + 1) * n0 * 0.01), pytest.approx(n1 * 0.01)]
        assert r.seconds == pytest.approx(max(r.rank_seconds))


def test_a_start_up_ends_at_the_rank_start_however_much_cpu_it_had():
    # rank 1 starts 0.05 s in: until then two starting processes and rank 0's requests share the
    # core (rank 0 gets a third: 0.05 / 3 s of CPU); then the two ranks share it, half each,
    # until one is done, and the other has it alone
    r, (n0, n1) = _peer_epoch(2, late_s=0.05)
    left0, need1 = n0 * 0.01 - 0.05 / 3, n1 * 0.01
    end0 = 0.05 + 2 * min(left0, need1) + max(0.0, left0 - need1)
    end1 = 0.05 + 2 * min(left0, need1) + max(0.0, need1 - left0)
    assert r.rank_seconds == [pytest.approx(end0, rel=1e-6), pytest.approx(end1 - 0.05, rel=1e-6)]


def test_place_job_puts_ranks_on_the_recorded_nodes():
    from stoker_lab.sim.decide import ClusterState, epoch_plans, place_job

    wl = _samples(64, per_block=8)
    budgets = np.full(3, 1e9)
    for setup in ("direct", "random", "colocated"):
        pl = place_job(setup, ClusterState(3, wl), wl, 3, budgets, 0, None, [2, 2, 0])
        assert pl.rank_node.tolist() == [2, 2, 0]
    colo = place_job("colocated", ClusterState(3, wl), wl, 3, budgets, 0, None, [2, 2, 0])
    plans = epoch_plans("colocated", wl, colo, 0)
    on_node = [(colo.owner[wl.sample_block[plan]] == node).mean() for node, plan in zip([2, 2, 0], plans, strict=True)]
    assert min(on_node) > 0  # co-located plans follow the recorded nodes: each rank has local samples
    with pytest.raises(ValueError):
        place_job("random", ClusterState(3, wl), wl, 3, budgets, 0, None, [0, 1])
    with pytest.raises(ValueError):
        place_job("random", ClusterState(3, wl), wl, 3, budgets, 0, None, [0, 1, 3])


def _report(rows: list[dict], n=3) -> dict:
    return {
        "hosts": n,
        "machine": {"cores": 1},
        "links": {f"h{i}": {"ns": f"stoknc1-h{i}", "mbit": 400.0} for i in range(n)}
        | {"origin": {"ns": "stoknc1-origin", "mbit": 200.0}},
        "origin": {"latency_ms": 0.0},
        "config": {"jobs": 2, "ranks_per_job": 3, "epochs": 3, "cache_bytes_per_node": 1 << 30},
        "runs": rows,
    }


def test_rank_hosts_and_starts_are_read_as_recorded():
    from stoker_lab.sim.calibrate import NetnsSetup
    from stoker_lab.sim.measured import recorded_ranks, recorded_starts

    def row(job, epoch, hosts, starts):
        return {
            "placement": "random",
            "job": job,
            "epoch": epoch,
            "ranks": 3,
            "rank_hosts": hosts,
            "rank_start_s": starts,
        }

    rep = _report(
        [
            row("job1", 0, [1, 1, 0], [0.0, 0.1, 0.0]),
            row("job1", 1, [1, 1, 0], [2.15, 0.42, 0.0]),
            row("job2", 0, [0, 2, 2], [0.0, 0.65, 2.31]),
        ]
    )
    ranks, starts = recorded_ranks(rep, "r.json"), recorded_starts(rep, "r.json")
    assert ranks == {("random", "job1"): [1, 1, 0], ("random", "job2"): [0, 2, 2]}
    assert starts[("random", "job1")] == {0: [0.0, 0.1, 0.0], 1: [2.15, 0.42, 0.0]}
    setup = NetnsSetup(_samples(), None, {}, 0.0, ranks or {}, starts)
    job1, job2 = setup.jobs(rep, "random")
    assert (job1.rank_nodes, job1.starts(1), job1.starts(2)) == ([1, 1, 0], [2.15, 0.42, 0.0], [0.0] * 3)
    assert (job2.rank_nodes, job2.seed) == ([0, 2, 2], 2)
    assert setup.jobs(rep, "colocated")[0].rank_nodes is None  # nothing recorded for it

    bad = _report([row("job1", 0, [1, 1, 0], [0.0, 0.0, 0.0]), row("job1", 1, [1, 0, 0], [0.0, 0.0, 0.0])])
    with pytest.raises(ValueError, match="r.json: random job1 epoch 1"):
        recorded_ranks(bad, "r.json")
    with pytest.raises(ValueError, match="r.json: random job1 epoch 0"):
        recorded_starts(_report([row("job1", 0, [1, 1, 0], [0.0, -0.5, 0.0])]), "r.json")
    assert recorded_ranks(_report([{"placement": "random", "job": "job1", "epoch": 0}]), "r.json") is None


def test_fit_starting_finds_the_start_up_cost_and_peer_cpu_a_run_was_made_with():
    # a report whose warm random epochs the model itself produced with 2 starting processes and
    # 3 ms per peer request, its ranks starting apart: both are found again
    from stoker_lab.sim.calibrate import NetnsSetup, fit_starting, netns_params

    wl = _samples(36, per_block=3)
    starts = {
        ("random", "job1"): {1: [0.3, 0.0, 0.05], 2: [0.0, 0.0, 0.0]},
        ("random", "job2"): {1: [0.0, 0.0, 0.0], 2: [0.0, 0.25, 0.0]},
    }
    ranks = {("random", "job1"): [1, 1, 0], ("random", "job2"): [0, 2, 2]}
    setup = NetnsSetup(wl, None, {}, 0.0, ranks, starts)
    rep = _report([])
    made = simulate(
        netns_params(rep, 1e-5, 0.003, 1.0, starting_processes=2),
        wl,
        "random",
        setup.jobs(rep, "random"),
        3,
        together=False,
    )
    rep["runs"] = [{"placement": "random", "job": r.job, "epoch": r.epoch, "seconds": r.seconds} for r in made]
    k, cpu = fit_starting(rep, "r.json", 1e-5, 1.0, setup)
    assert k.value == 2
    assert cpu.value == pytest.approx(0.003, rel=1e-3)
    no_starts = NetnsSetup(wl, None, {}, 0.0, ranks, {})
    assert fit_starting(rep, "r.json", 1e-5, 1.0, no_starts)[0].value == 0
