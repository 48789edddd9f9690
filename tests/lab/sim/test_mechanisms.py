"""The model's mechanisms for the measured runs, on tiny cases with closed-form answers: token
buckets (the namespace links' tbf), fetching's CPU on the decode cores (the demo's one machine),
the measured cluster's own block and node names and host order, and the repeats summary."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from _helpers import flow_finish_times
from stoker_lab.sim import FlowNetwork, Job, Params, simulate
from stoker_lab.sim.workload import Workload


def _flows(caps: dict, flows: list[tuple[float, dict]], buckets: dict) -> list[float]:
    """Finish times of flows ``(start_s, {link: bytes})`` on links ``caps`` with token ``buckets``."""
    return flow_finish_times(caps, flows, buckets=buckets)


RATE, BUCKET, PEAK = 100.0, 500.0, 1e6  # bytes/s, bytes, bytes/s


def test_a_transfer_that_fits_the_bucket_passes_at_the_peak():
    assert _flows({"l": RATE}, [(0.0, {"l": 300.0})], {"l": (BUCKET, PEAK)}) == [pytest.approx(300.0 / PEAK)]


def test_a_transfer_past_the_bucket_takes_the_rest_at_the_token_rate():
    # the bucket's 500 bytes pass while it drains (at PEAK - RATE), the other 1000 at RATE:
    # a token bucket passes at most BUCKET + RATE * t bytes in t seconds
    drain = BUCKET / (PEAK - RATE)
    expected = drain + (1500.0 - PEAK * drain) / RATE
    assert _flows({"l": RATE}, [(0.0, {"l": 1500.0})], {"l": (BUCKET, PEAK)}) == [pytest.approx(expected, rel=1e-9)]


def test_tokens_accrue_between_transfers():
    # after 300 bytes the bucket holds 200; 1 s later 300 (capped at 500): the next 300 pass at
    # once; 0.5 s later it holds 250: of the next 400, 150 wait for tokens (1.5 s)
    one_s = _flows({"l": RATE}, [(0.0, {"l": 300.0}), (1.0, {"l": 300.0})], {"l": (BUCKET, PEAK)})
    assert one_s == [pytest.approx(300.0 / PEAK), pytest.approx(1.0 + 300.0 / PEAK, rel=1e-6)]
    half_s = _flows({"l": RATE}, [(0.0, {"l": 300.0}), (0.5, {"l": 400.0})], {"l": (BUCKET, PEAK)})
    assert half_s[1] == pytest.approx(0.5 + 150.0 / RATE, rel=1e-4)


def test_a_busy_shaped_link_never_passes_more_than_its_bucket_plus_rate():
    # random flows on a shaped link: by each flow's end the link has carried at most
    # BUCKET + RATE * t bytes, and over the whole run it was not slower than its rate allows
    rng = np.random.default_rng(0)
    flows = [(float(rng.uniform(0, 20)), {"l": float(rng.integers(50, 400))}) for _ in range(40)]
    done = _flows({"l": RATE}, flows, {"l": (BUCKET, PEAK)})
    for t in done:
        carried = sum(f[1]["l"] for f, d in zip(flows, done, strict=True) if d <= t + 1e-12)
        assert carried <= BUCKET + RATE * t + 1e-6
    total = sum(f[1]["l"] for f in flows)
    assert max(done) <= max(f[0] for f in flows) + total / RATE  # at worst every byte at the rate


def test_bad_buckets_are_refused():
    with pytest.raises(ValueError):
        FlowNetwork(simpy.Environment(), {"l": RATE}, buckets={"l": (BUCKET, RATE / 2)})  # peak under the rate
    with pytest.raises(ValueError):
        FlowNetwork(simpy.Environment(), {"l": RATE}, buckets={"l": (0.0, PEAK)})


def _tiny(samples=64, per_block=8, size=1000) -> Workload:
    return Workload(
        np.full(samples, size, dtype=np.int64),
        np.arange(samples, dtype=np.int64) // per_block,
        np.full(samples // per_block, size * per_block, dtype=np.int64),
        "tiny",
    )


def test_fetching_takes_its_cpu_from_the_decode_cores():
    # one node, 2 decode cores at 100 samples/s each; the origin is instant; every fetched byte
    # costs 1e-6 CPU seconds on the same cores: the cores are never idle, so the epoch takes
    # (decode work + fetch work) / capacity, in samples: (64 + 64,000 B x 1e-6 s x 100) / 200
    wl = _tiny()
    base = dict(
        nodes=1,
        cache_bytes=1e9,
        origin_Bps=1e12,
        decode_cores=2,
        decode_rate=100.0,
        chunk_samples=8,
        origin_concurrency=8,
        prefetch_chunks=8,
    )
    plain = simulate(Params(**base), wl, "direct", [Job("j", 1)], 1)[0]
    costly = simulate(Params(**base, fetch_cpu_s_per_byte=1e-6), wl, "direct", [Job("j", 1)], 1)[0]
    assert plain.seconds == pytest.approx(64 / 200)
    assert costly.seconds == pytest.approx((64 + 64_000 * 1e-6 * 100) / 200)


def test_demo_fetch_cpu_comes_from_the_other_consumer_rates_runs():
    from stoker_lab.sim.calibrate import demo_fetch_cpu

    def run(rate, epoch, origin, prefetch, emulator):
        return {
            "loader": "stoker",
            "consumer_rate": rate,
            "epoch": epoch,
            "origin_bytes": origin,
            "cpu_s": {"main": 0.1, "workers": 6.0, "prefetch": prefetch, "origin_emulator": emulator},
        }

    demo = {
        "machine": {"cores": 2},
        "runs": [
            run(0.0, 0, 1000, 2.0, 1.0),
            run(0.0, 1, 0, 0.1, 0.0),
            run(800.0, 0, 1000, 5.0, 5.0),
            run(800.0, 1, 0, 0.0, 0.0),
        ],
    }
    assert demo_fetch_cpu(demo, "demo.json", 0.0).value == pytest.approx(10.0 / 1000)  # the 800 run's
    assert demo_fetch_cpu(demo, "demo.json", 800.0).value == pytest.approx((3.0 - 0.1) / 1000)  # the 0 run's
    assert demo_fetch_cpu({"machine": {"cores": 2}, "runs": []}, "demo.json", 0.0).value == 0.0


def test_the_model_places_blocks_by_the_keys_it_is_given():
    # the measured cluster's block keys and node keys: the owners are bounded_owners of exactly
    # those names, and renaming a node moves blocks
    from stoker.cluster.placement import bounded_owners
    from stoker_lab.sim.decide import ClusterState, place_job

    keys = [f"v1/000000-{b}" for b in range(40)]
    wl = Workload(
        np.full(40, 1000, dtype=np.int64), np.arange(40, dtype=np.int64), np.full(40, 1000, dtype=np.int64), "d", keys
    )
    nodes = ["node-run1-h0-0", "node-run1-h1-0", "node-run1-h2-0"]
    budgets = np.full(3, 1e9)

    def owners(names):
        st = ClusterState(3, wl, names)
        return place_job("colocated", st, wl, 3, budgets, 0, None).owner

    expected = bounded_owners(keys, nodes, [1e9] * 3, wl.block_bytes)
    assert np.array_equal(owners(nodes), expected)
    assert not np.array_equal(owners(["node-run2-h0-0", "node-run2-h1-0", "node-run2-h2-0"]), expected)
    with pytest.raises(ValueError):
        ClusterState(2, wl, nodes)


def _report(n=3):
    return {
        "hosts": n,
        "links": {f"h{i}": {"ns": f"stoknc1-h{i}", "mbit": 400.0} for i in range(n)}
        | {"origin": {"ns": "stoknc1-origin", "mbit": 200.0}},
        "config": {"jobs": 2, "ranks_per_job": n, "epochs": 3, "cache_bytes_per_node": 1 << 30},
        "runs": [],
    }


def test_node_keys_are_the_keys_the_cache_services_claim(tmp_path):
    from stoker.cluster.identity import claim_cache_dir
    from stoker_lab.sim.measured import netns_node_keys

    rep = _report()
    claim = claim_cache_dir(str(tmp_path), host="stoknc1-h1")
    try:
        assert netns_node_keys(rep)[1] == claim.key
    finally:
        claim.release()


def test_host_order_is_read_off_the_kernel_counters():
    # a report whose hosts received what the random placement sends them under a known host
    # order (and that does not record each rank's host): the order is found again
    from stoker_lab.sim.calibrate import netns_jobs
    from stoker_lab.sim.measured import _random_received, host_order, netns_node_keys

    wl = _tiny(samples=96, per_block=4)
    wl.keys = [f"v/{b}" for b in range(wl.num_blocks)]
    rep = _report()
    keys, truth = netns_node_keys(rep), [2, 0, 1]  # model node i is host truth[i]
    rows = [
        {"placement": "random", "job": j.name, "epoch": e, "stoker": {"origin_bytes": 0}}
        for e in (1, 2)
        for j in netns_jobs(rep)
    ]
    per_node = _random_received(rep, wl, [keys[h] for h in truth], rows, netns_jobs(rep))
    for row, got in zip(rows, per_node, strict=True):
        row["kernel"] = {"links": {f"h{truth[i]}": {"rx_bytes": float(got[i]) * 1.04 + 5e3} for i in range(3)}}
    rep["runs"] = rows
    order, source = host_order(rep, "r.json", wl, netns_jobs(rep))
    assert order == truth and "kernel" in source


def test_warm_epochs_say_when_no_single_time_fits_every_warm_epoch():
    from stoker_lab.sim.validate import warm_epochs

    def row(job, epoch, meas, pred):
        return {
            "config": "c",
            "placement": "random",
            "job": job,
            "epoch": epoch,
            "measured_s": meas,
            "predicted_s": pred,
            "measured_bytes": {"origin": 0, "host_to_host": 1},
        }

    rows = [
        row("job1", 1, 1.74, 1.95),
        row("job1", 2, 2.44, 1.96),
        row("job2", 1, 2.8, 3.0),
        row("job2", 2, 3.0, 3.0),
        row("job3", 1, 3.0, 3.0),
    ]
    got = {g["job"]: g for g in warm_epochs(rows)}
    assert set(got) == {"job1", "job2"}  # job3 has one warm epoch: no repeat
    assert got["job1"]["measured_spread"] == pytest.approx(2.44 / 1.74)
    assert not got["job1"]["one_prediction_fits"]  # 2.44 * 0.85 > 1.74 * 1.15
    assert got["job2"]["one_prediction_fits"]
