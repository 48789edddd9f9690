"""Requests in flight sized to the origin's bandwidth-delay product, the origin's busy clock,
and the per-plan ledger of the prefetcher's origin traffic.

**In flight.** A ranged GET of ``s`` bytes from an origin with per-request latency ``L`` (seconds)
and bandwidth ``B`` (bytes/s) keeps the link busy only if about ``L * B / s`` requests are in
flight (the bandwidth-delay product in requests; Little's law). :class:`InflightTarget` finds it
online from the fills themselves, as BBR does for a TCP flow (Cardwell et al., "BBR:
Congestion-Based Congestion Control", ACM Queue 14(5), 2016): it measures the delivery rate over
intervals of at least two round trips and, while the rate still grows by 25% or more, doubles the
requests in flight (start-up); when two intervals in a row bring less, it goes back to the
number that gave the best rate, and from then on keeps at least ``ceil(max rate x min request
time / s)``. The target is clamped to ``[floor, ceiling]``; ``floor`` is the configured
``fetch_concurrency``, so a near origin behaves as before and a far one is not held to that
fixed default. The estimates (shortest request time, highest rate) are reported with it.

**Busy clock.** :class:`BusyClock` integrates, in microseconds, the time with at least one request
in flight and the request-time (requests in flight x time), from which a loader reports the
origin busy fraction and the mean requests in flight.

**Ledger.** The prefetcher works on the next epoch's plan while the current one drains, so time
boundaries charge its bytes to the wrong epoch. It keeps one ledger row per plan (keyed by the
run id sent with the plan) and charges each block it fetched to the plan whose samples it serves
first (:func:`charge`); a loader reads its epoch's row (:func:`ledger_row`).
"""

from __future__ import annotations

import math
import threading
import time

# Shared counter layout (int64 array) of the prefetch process, after the 8 totals of
# :mod:`stoker.loader.prefetch.process`: the target in flight now, the latency (us) and bandwidth (B/s)
# estimates, the busy clock (us with >= 1 request in flight; request-us), the run id of the last
# plan whose every block was fetched (or given up), the origin requests it retried (a replacement
# process continues the count), then the ledger.
TARGET, LATENCY_US, BANDWIDTH_BPS, BUSY_US, REQUEST_US, PLAN_DONE, ORIGIN_RETRIES = 8, 9, 10, 11, 12, 13, 14
LEDGER_AT = 15
#: Ledger rows (plans) kept; a loader reads its row at its epoch's end, long before 8 more plans.
LEDGER_ROWS = 8
#: Row fields: run id, origin bytes, origin requests, blocks filled (admitted), blocks staged
#: (fetched into staging), staged blocks of the draining plan used again (nothing fetched).
LEDGER_FIELDS = ("run", "origin_bytes", "origin_requests", "prefetch_fills", "prefetch_staged", "staged_reused")
N_SHARED = LEDGER_AT + LEDGER_ROWS * len(LEDGER_FIELDS)
#: Most requests in flight the target may reach (threads of one process; the origin's own limits).
MAX_INFLIGHT = 64
#: Seconds over which the aggregate rate is measured.
RATE_INTERVAL_S = 0.25


class InflightTarget:
    """Requests to keep in flight, from the measured latency and bandwidth (module docstring).

    ``floor`` / ``ceiling``: the clamp (requests). :meth:`observe` takes each finished request
    (its size in bytes and duration in seconds); :attr:`target` is the current number,
    :attr:`latency_s` the shortest request time seen, :attr:`bandwidth_Bps` the highest delivery
    rate measured (bytes/s). Thread-safe.
    """

    #: Rate growth (x) that counts as "still growing" during start-up (BBR's 25%).
    GROWTH = 1.25
    #: Intervals in a row without that growth that end start-up.
    PATIENCE = 2

    def __init__(self, floor: int, ceiling: int = MAX_INFLIGHT):
        self.floor = max(1, int(floor))
        self.ceiling = max(self.floor, int(ceiling))
        self.target = self.floor
        self.latency_s = math.inf
        self.bandwidth_Bps = 0.0
        self._mean_bytes = 0.0
        self._n = 0
        self._window_start: float | None = None  # from the start of the first request observed
        self._window_bytes = 0
        self._duration_s = 0.0  # recent request time (moving average)
        self._probing, self._best_rate, self._best_target, self._misses = True, 0.0, self.floor, 0
        self._lock = threading.Lock()

    @property
    def observed(self) -> int:
        """Requests recorded by :meth:`observe` so far."""
        return self._n

    def observe(self, size_bytes: int, duration_s: float, now: float | None = None) -> int:
        """Record one finished request; returns the new target."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._n += 1
            self._mean_bytes += (size_bytes - self._mean_bytes) / min(self._n, 64)
            if duration_s > 0:
                self.latency_s = min(self.latency_s, duration_s)
                self._duration_s += (duration_s - self._duration_s) / min(self._n, 16)
            if self._window_start is None:
                self._window_start = now - max(0.0, duration_s)
            if now <= self._window_start:  # the round after a change of target: not measured
                return self.target
            self._window_bytes += size_bytes
            span = now - self._window_start
            if span >= max(RATE_INTERVAL_S, 2 * self._duration_s):
                rate = self._window_bytes / span
                self._window_start, self._window_bytes = now, 0
                self.bandwidth_Bps = max(self.bandwidth_Bps, rate)
                before = self.target
                self._retarget(rate)
                if self.target != before:  # measure the new number from its second round on
                    self._window_start = now + self._duration_s
            return self.target

    def _retarget(self, rate: float) -> None:
        if self._probing:
            if rate >= self.GROWTH * self._best_rate:
                self._best_rate, self._best_target, self._misses = rate, self.target, 0
                self.target = min(self.ceiling, 2 * self.target)
                return
            self._misses += 1
            if self._misses < self.PATIENCE:
                return
            self._probing = False
            self.target = self._best_target
        bdp = math.ceil(self.bandwidth_Bps * self.latency_s / self._mean_bytes) if self._mean_bytes else 0
        self.target = int(min(self.ceiling, max(self.floor, self._best_target, bdp)))


class InflightGate:
    """Requests of many threads held to an :class:`InflightTarget`: :meth:`run` waits while
    ``target.target`` requests are in flight, runs the request and feeds its time to the target.
    For fills made by thread pools (the cluster cache services' warm-up). Thread-safe."""

    def __init__(self, target: InflightTarget):
        self.target = target
        self.active = 0
        self._cond = threading.Condition()

    def run(self, fn, size_bytes: int, fetched=lambda result: True):
        """``fn()`` as one request of ``size_bytes`` bytes; its time counts when ``fetched(result)``
        (it read the origin). Returns ``fn()``'s result, raises what it raises."""
        with self._cond:
            self._cond.wait_for(lambda: self.active < self.target.target)
            self.active += 1
        t0 = time.monotonic()
        try:
            result = fn()
        finally:
            with self._cond:
                self.active -= 1
                self._cond.notify_all()
        if fetched(result):
            self.target.observe(size_bytes, time.monotonic() - t0)
        return result


class BusyClock:
    """Integrates the time with at least one request in flight and the request-time, into
    ``shared[BUSY_US]`` and ``shared[REQUEST_US]`` (microseconds). Thread-safe."""

    def __init__(self, shared):
        self.shared = shared
        self.inflight = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def _advance(self, now: float) -> None:
        if self.inflight:
            dt_us = int((now - self._since) * 1e6)
            self.shared[BUSY_US] += dt_us
            self.shared[REQUEST_US] += dt_us * self.inflight
        self._since = now

    def start(self) -> float:
        """A request starts; returns its start time (time.monotonic())."""
        with self._lock:
            now = time.monotonic()
            self._advance(now)
            self.inflight += 1
            return now

    def stop(self) -> float:
        """A request ends; returns the time (time.monotonic())."""
        with self._lock:
            now = time.monotonic()
            self._advance(now)
            self.inflight -= 1
            return now

    def flush(self) -> None:
        """Bring the shared counters up to now (a loader reading them mid-request)."""
        with self._lock:
            self._advance(time.monotonic())


def _row_at(run: int) -> int:
    return LEDGER_AT + (int(run) % LEDGER_ROWS) * len(LEDGER_FIELDS)


def open_row(shared, run: int) -> None:
    """Start the ledger row of plan ``run`` (kept if it is there already: a replacement process
    receives the last plan again and continues its row)."""
    at = _row_at(run)
    if int(shared[at]) != int(run):
        shared[at] = int(run)
        for i in range(1, len(LEDGER_FIELDS)):
            shared[at + i] = 0


def charge(shared, run: int, field: str, amount: int) -> None:
    """Add ``amount`` to ``field`` of plan ``run``'s row (nothing if the row was reused)."""
    at = _row_at(run)
    if int(shared[at]) == int(run):
        shared[at + LEDGER_FIELDS.index(field)] += int(amount)


def ledger_row(shared, run: int) -> dict:
    """Plan ``run``'s row as ``{field: int}`` (zeros if it is not there: never sent, or reused)."""
    at = _row_at(run)
    if int(shared[at]) != int(run):
        return {f: 0 for f in LEDGER_FIELDS[1:]}
    return {f: int(shared[at + i]) for i, f in enumerate(LEDGER_FIELDS) if i}


def serving_plan(b: int, cur_run: int, prev_run: int | None, prev_last: dict, prev_done: int) -> int:
    """The plan a fetched block ``b`` serves first: the previous plan (``prev_run``, still
    draining) when it needs ``b`` at or after the position it has delivered (``prev_done``;
    ``prev_last``: block -> last use in it), else the current plan."""
    if prev_run is not None and prev_last.get(b, -1) >= prev_done:
        return prev_run
    return cur_run


__all__ = [
    "InflightTarget",
    "InflightGate",
    "BusyClock",
    "open_row",
    "charge",
    "ledger_row",
    "serving_plan",
    "N_SHARED",
]
