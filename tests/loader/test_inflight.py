"""Requests in flight from the measured bandwidth-delay product; the per-plan ledger."""

import heapq

import numpy as np

from stoker.loader.prefetch import inflight as infl


def _drive(target, latency_s, bandwidth_Bps, size_bytes, seconds):
    """Simulate an origin with per-request ``latency_s`` and a shared ``bandwidth_Bps``: a request
    started with n in flight takes (latency + n * size / bandwidth) x a jitter of +-20%; a new one
    starts whenever fewer than ``target.target`` are in flight. Returns the targets seen."""
    rng = np.random.default_rng(0)
    now, seen, flight = 0.0, [], []
    while now < seconds:
        while len(flight) < target.target:
            d = (latency_s + target.target * size_bytes / bandwidth_Bps) * rng.uniform(0.8, 1.2)
            heapq.heappush(flight, (now + d, now))
        end, start = heapq.heappop(flight)
        now = end
        seen.append(target.observe(size_bytes, end - start, now))
    return seen


def test_a_far_origin_gets_its_bandwidth_delay_product_and_a_near_one_keeps_the_floor():
    mib = 1 << 20
    far = infl.InflightTarget(8)
    seen = _drive(far, 0.100, 1000e6, mib, 10.0)
    bdp = 0.100 * 1000e6 / mib  # ~95 requests: more than the ceiling
    assert seen[-1] == infl.MAX_INFLIGHT >= min(bdp, infl.MAX_INFLIGHT)
    assert seen == sorted(seen)  # it grows, never oscillates
    near = infl.InflightTarget(8)
    _drive(near, 0.020, 100e6, mib, 10.0)
    assert near.target <= 16  # 20 ms x 100 MB/s / 1 MiB ~ 2 requests: the floor is enough
    mid = infl.InflightTarget(2)
    _drive(mid, 0.050, 400e6, mib, 10.0)
    assert 19 <= mid.target  # at least the product, ~19 requests


def test_target_is_clamped():
    t = infl.InflightTarget(4, ceiling=6)
    _drive(t, 0.2, 1e9, 1 << 20, 5.0)
    assert t.target == 6
    assert infl.InflightTarget(0).target == 1


def test_ledger_rows_by_run_and_serving_plan():
    shared = np.zeros(infl.N_SHARED, dtype=np.int64)
    infl.open_row(shared, 3)
    infl.charge(shared, 3, "origin_bytes", 100)
    infl.open_row(shared, 3)  # a replacement process continues the row
    infl.charge(shared, 3, "origin_bytes", 5)
    assert infl.ledger_row(shared, 3)["origin_bytes"] == 105
    infl.open_row(shared, 3 + infl.LEDGER_ROWS)  # the row is reused by a later plan
    assert infl.ledger_row(shared, 3)["origin_bytes"] == 0
    infl.charge(shared, 3, "origin_bytes", 7)  # a charge to a reused row is dropped
    assert infl.ledger_row(shared, 3 + infl.LEDGER_ROWS)["origin_bytes"] == 0
    # a block the draining plan still needs serves it; one it is past serves the current plan
    assert infl.serving_plan(5, 9, 8, {5: 40}, 10) == 8
    assert infl.serving_plan(5, 9, 8, {5: 4}, 10) == 9
    assert infl.serving_plan(5, 9, None, {5: 40}, 10) == 9


def test_busy_clock_counts_time_with_a_request_in_flight():
    shared = np.zeros(infl.N_SHARED, dtype=np.int64)
    clock = infl.BusyClock(shared)
    import time

    clock.start()
    clock.start()
    time.sleep(0.02)
    clock.stop()
    clock.stop()
    idle = shared[infl.BUSY_US]
    time.sleep(0.02)
    clock.flush()
    assert shared[infl.BUSY_US] == idle >= 15_000  # idle time is not busy
    assert shared[infl.REQUEST_US] >= 2 * 15_000  # two requests in flight


def test_gate_holds_threads_to_the_target_and_feeds_it():
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    gate = infl.InflightGate(infl.InflightTarget(3, ceiling=3))
    peak, lock = [0], threading.Lock()

    def request():
        with lock:
            peak[0] = max(peak[0], gate.active)
        time.sleep(0.01)
        return "filled"

    with ThreadPoolExecutor(10) as pool:
        out = list(pool.map(lambda _: gate.run(request, 1 << 20, lambda st: st == "filled"), range(30)))
    assert out == ["filled"] * 30 and peak[0] == 3 and gate.active == 0
    assert gate.target.observed == 30 and gate.target.latency_s >= 0.01
