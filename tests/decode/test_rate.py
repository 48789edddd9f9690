"""The decode calibration: several short rounds, the recipes taking turns, each timed on the wall
clock and on the thread's CPU clock, summarised by the median, so one moment of a busy machine
moves the figure by one round and not the whole of it, and the share of a core other processes
left the calibration does not move the CPU rate."""

from __future__ import annotations

import os
import time

import pytest

from stoker_lab import decode_rate as rate
from stoker_lab.decode_rate import DecodeRound


@pytest.fixture(scope="module")
def photos(sample_tree):
    return [f.read_bytes() for f in sorted((sample_tree / "train").rglob("*.JPEG"))[:6]]


def test_rounds_take_turns_after_an_untimed_warm_up(monkeypatch):
    calls = []
    script = iter([100.0, 50.0, 900.0, 40.0, 110.0, 60.0])  # timed rounds: s p s p s p

    def fake(payloads, mode, min_seconds, recipe, *, size, seed):
        calls.append((recipe, len(payloads), min_seconds))
        if min_seconds == 0.0:  # the warm-up
            return DecodeRound(len(payloads), 1.0, 1.0)
        return DecodeRound(100, 1.0, 100 / next(script))

    monkeypatch.setattr(rate, "time_decode_round", fake)
    got = rate.measure_decode_rounds([b"x"] * 20, rounds=3, round_seconds=0.25)
    assert [c[0] for c in calls] == ["stoker", "pillow"] + ["stoker", "pillow"] * 3
    assert calls[0][1:] == (8, 0.0) and calls[1][1:] == (8, 0.0)  # the warm-up: a few payloads, untimed
    assert all(c[1:] == (20, 0.25) for c in calls[2:])
    cpu = {k: [round(r.cpu_rate, 6) for r in v] for k, v in got.items()}
    assert cpu == {"stoker": [100.0, 900.0, 110.0], "pillow": [50.0, 40.0, 60.0]}
    assert rate.median_rate(cpu["stoker"]) == 110.0  # the fast moment (900/s) is one round of three


def test_median_rate():
    assert rate.median_rate([100.0, 1000.0, 1010.0, 990.0, 1005.0]) == 1000.0
    assert rate.median_rate([3.0, 1.0]) == 2.0
    with pytest.raises(ValueError, match="no decode rate"):
        rate.median_rate([])
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        rate.measure_decode_rounds([b"x"], rounds=0)


def test_rounds_on_real_photos(photos):
    got = rate.measure_decode_rounds(photos, rounds=2, round_seconds=0.01)
    assert set(got) == {"stoker", "pillow"}
    for rounds in got.values():
        assert len(rounds) == 2
        for r in rounds:
            assert r.samples >= len(photos) and r.wall_rate > 0 and r.cpu_rate > 0
            assert r.cpu_s <= r.wall_s * 1.05 + 0.01  # one thread: no more CPU than wall time


def _spin(stop_at: float) -> None:
    while time.perf_counter() < stop_at:
        pass


def test_the_cpu_clock_leaves_out_time_spent_waiting_for_a_core(photos):
    """A round that shares its core with a busy process: its wall rate drops, its CPU rate does
    not count the time the other process held the core."""
    core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child spins on the same core, then exits
        try:
            os.sched_setaffinity(0, {core})
            _spin(time.perf_counter() + 3.0)
        finally:
            os._exit(0)
    try:
        os.sched_setaffinity(0, {core})
        shared = rate.time_decode_round(photos, min_seconds=0.5)
    finally:
        os.sched_setaffinity(0, before)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert shared.cpu_s < 0.8 * shared.wall_s  # the spinner held the core part of the time
    assert shared.cpu_rate > 1.2 * shared.wall_rate
