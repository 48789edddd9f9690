"""A run's own peer probe and control job in the model (``stoker_lab.sim.calibrate``): explicit plans
read exactly their samples, the control job (the placement's first) settles the dataset's
members, and the peer CPU a probe was made with is found again from the probe alone."""

from __future__ import annotations

import numpy as np
import pytest

from stoker_lab.sim import Job, Params, simulate
from stoker_lab.sim.workload import Workload

BYTES = 1000


def _samples(n=36, per_block=3) -> Workload:
    return Workload(
        np.full(n, BYTES, dtype=np.int64),
        np.arange(n, dtype=np.int64) // per_block,
        np.full(n // per_block, BYTES * per_block, dtype=np.int64),
        "probe",
    )


def _report(n=3, control_hosts=None, probe=None) -> dict:
    rep = {
        "hosts": n,
        "machine": {"cores": 1},
        "links": {f"h{i}": {"ns": f"stoknc1-h{i}", "mbit": 400.0} for i in range(n)}
        | {"origin": {"ns": "stoknc1-origin", "mbit": 200.0}},
        "origin": {"latency_ms": 0.0},
        "config": {"jobs": 2, "ranks_per_job": 3, "epochs": 3, "cache_bytes_per_node": 1 << 30},
        "runs": [],
    }
    if control_hosts is not None:
        rep["control"] = {"random": {"rank_hosts": control_hosts}, "direct": {"rank_hosts": [0, 1, 2]}}
    if probe is not None:
        rep["peer_probe"] = probe
    return rep


def _setup(ranks):
    from stoker_lab.sim.calibrate import NetnsSetup

    return NetnsSetup(_samples(), ["node-h0-0", "node-h1-0", "node-h2-0"], {}, 0.0, ranks, {}, [0, 1, 2])


def test_a_job_with_explicit_plans_reads_exactly_them():
    p = Params(nodes=2, cache_bytes=1e9, origin_Bps=1000.0, chunk_samples=1)
    plans = [np.array([0, 5, 7]), np.array([], dtype=np.int64)]
    (r,) = simulate(p, _samples(), "direct", [Job("j", 2, plans=plans)], 1)
    assert r.samples == 2 * 3 and r.bytes["origin"] == 3 * 3 * BYTES  # whole blocks of samples 0, 5, 7
    assert r.rank_seconds[1] == 0.0  # nothing to read
    with pytest.raises(ValueError, match="1 plans for 2 ranks"):
        simulate(p, _samples(), "direct", [Job("j", 2, plans=plans[:1])], 1)


def test_the_control_job_settles_the_members_as_it_did_in_the_run():
    from stoker_lab.sim.calibrate import netns_params

    ranks = {("random", "job1"): [2, 2, 2], ("random", "job2"): [2, 2, 2]}
    p = netns_params(_report(), 1e-5)
    wl = _samples()
    # without the control job, job1's node (2) is the only member: every read is local
    alone = _setup(ranks).jobs(_report(), "random")
    assert [j.name for j in alone] == ["job1", "job2"]
    r = simulate(p, wl, "random", alone, 2, together=False)
    assert r[2].bytes["host_to_host"] == 0
    # the control job ran first on nodes 0 and 1: they hold the dataset, job1 on node 2 reads it all from them
    jobs = _setup(ranks).jobs(_report(control_hosts=[0, 0, 1]), "random")
    assert [j.name for j in jobs] == ["control", "job1", "job2"] and jobs[0].rank_nodes == [0, 0, 1]
    r = {(x.job, x.epoch): x for x in simulate(p, wl, "random", jobs, 2, together=False)}
    assert r[("job1", 1)].bytes["host_to_host"] == wl.total_bytes
    assert r[("control", 0)].samples == 0
    assert [j.name for j in _setup(ranks).jobs(_report(control_hosts=[0, 0, 1]), "direct")] == ["job1", "job2"]


def test_the_peer_cpu_a_probe_was_made_with_is_found_from_the_probe_alone():
    from stoker_lab.sim.calibrate import fit_probe_cpu, netns_params, probe_job

    ranks = {("random", "job1"): [0, 1, 2], ("random", "job2"): [0, 1, 2]}
    setup = _setup(ranks)
    wl = _samples()
    ids = [[3, 4, 5, 6, 7, 8], [0, 1, 2, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    probe = {"rank_hosts": [0, 1, 2], "rank_start_s": [0.0, 0.0, 0.0], "ids": ids}
    rep = _report(probe=dict(probe, seconds=1.0))
    made = simulate(
        netns_params(rep, 1e-5, 0.004, 1.0, setup.node_keys),
        wl,
        "random",
        setup.jobs(rep, "random") + [probe_job(rep, "r.json", setup.order)],
        1,
        together=False,
    )
    rep["peer_probe"]["seconds"] = made[-1].seconds
    assert made[-1].bytes["host_to_host"] > 0
    got = fit_probe_cpu(rep, "r.json", 1e-5, 1.0, setup)
    assert got.value == pytest.approx(0.004, rel=1e-3)
    assert "no epoch of the run is in it" in got.source
    with pytest.raises(ValueError, match="no peer_probe"):
        probe_job(_report(), "r.json")
    with pytest.raises(ValueError, match="no recorded host"):
        probe_job(_report(probe=dict(probe, rank_hosts=[0, -1, 2], seconds=1.0)), "r.json")


def test_epoch_cpu_splits_the_machine_seconds_among_ranks_services_and_the_rest():
    from stoker_lab.bench.netcluster import epoch_cpu

    def mark(machine, proc, at):
        return {"machine_cpu_s": machine, "process_cpu_s": proc, "at": at}

    marks = [(mark(100.0, 1.0, 10.0), mark(103.0, 2.0, 12.0)), (mark(100.5, 5.0, 10.5), mark(104.0, 5.5, 11.0))]
    got = epoch_cpu(marks, services_cpu_s=1.0, cores=2)
    assert got["window_s"] == pytest.approx(2.0) and got["machine_s"] == pytest.approx(4.0)
    assert got["ranks_s"] == pytest.approx(1.5) and got["other_s"] == pytest.approx(1.5)
    assert got["other_cores"] == pytest.approx(0.75)
    assert epoch_cpu(marks, services_cpu_s=10.0, cores=2)["other_cores"] == 0.0  # never negative


def test_a_lone_rank_requests_on_one_core_at_a_time():
    # 36 peer requests of 10 ms CPU each by one rank, on a 2-core machine: one request at a time
    # runs on one core (0.36 s), not on both (0.18 s); two ranks together use both cores
    from stoker_lab.sim.calibrate import netns_params

    ranks = {("random", "job1"): [2, 2, 2], ("random", "job2"): [2, 2, 2]}
    rep = _report(control_hosts=[0, 0, 1])
    rep["machine"]["cores"] = 2
    plans = [np.arange(36), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)]
    two = [np.arange(18), np.arange(18, 36), np.zeros(0, dtype=np.int64)]
    secs = {}
    for cores in (0.0, 1.0):
        p = netns_params(rep, 1e-6, peer_cpu_s=0.01)
        p.request_cores = cores
        for name, pl in (("one", plans), ("two", two)):
            jobs = _setup(ranks).jobs(rep, "random")[:2] + [Job(name, 3, rank_nodes=[2, 2, 2], plans=pl)]
            secs[(cores, name)] = simulate(p, _samples(), "random", jobs, 1, together=False)[-1].seconds
    assert secs[(1.0, "one")] == pytest.approx(0.36, rel=0.05)
    assert secs[(0.0, "one")] == pytest.approx(0.18, rel=0.05)
    assert secs[(1.0, "two")] == pytest.approx(0.18, rel=0.05) == secs[(0.0, "two")]


def test_the_local_read_cpu_a_local_probe_was_made_with_is_found_from_it():
    # every rank reads 6 samples its own node holds; the model made the probe with 2 ms of CPU per
    # cluster-mode local read, and the fit finds 2 ms again from the probe's seconds alone
    from stoker_lab.sim.calibrate import fit_probe_cpu, netns_params, probe_job
    from stoker_lab.sim.decide import ClusterState, place_job

    ranks = {("random", "job1"): [0, 1, 2], ("random", "job2"): [0, 1, 2]}
    setup = _setup(ranks)
    wl = _samples()
    placed = place_job("random", ClusterState(3, wl, setup.node_keys), wl, 3, np.full(3, 1e9), 1, None, [0, 1, 2])
    on = placed.owner[wl.sample_block]
    ids = [np.flatnonzero(on == r)[:6].tolist() for r in range(3)]
    assert all(len(x) == 6 for x in ids)
    probe = {"rank_hosts": [0, 1, 2], "rank_start_s": [0.0, 0.0, 0.0], "ids": ids, "seconds": 1.0}
    rep = _report(probe=probe)
    rep["local_probe"] = dict(probe)
    jobs = setup.jobs(rep, "random") + [probe_job(rep, "r.json", setup.order, kind="local")]
    made = simulate(
        netns_params(rep, 1e-6, 0.004, 1.0, setup.node_keys, local_cpu_s=0.002), wl, "random", jobs, 1, together=False
    )
    assert made[-1].bytes["host_to_host"] == 0 and made[-1].bytes["local"] == 18 * BYTES
    rep["local_probe"]["seconds"] = made[-1].seconds
    got = fit_probe_cpu(rep, "r.json", 1e-6, 1.0, setup, kind="local", peer_cpu_s=0.004)
    assert got.value == pytest.approx(0.002, rel=1e-3)
    assert "local probe" in got.source
