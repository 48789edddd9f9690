"""The fill path of the prefetch process (:mod:`stoker.loader.prefetch.process`): one block (or a run
of adjacent blocks fetched with one merged GET) from the origin into the node cache or the
loader's staging area, the threads that run those fills, and the charge of their origin traffic
to the per-plan ledger (:mod:`stoker.loader.prefetch.inflight`).

A fill thread posts each outcome to the prefetch loop's one event queue as
``(FILL, token, {block: status} or None, exception or None)``; a status is what
:func:`fill_status` returns: ``"cached"``, ``"filled"``, ``"staged"``, ``"in_staging"``,
``"refused"`` or ``"busy"`` (:meth:`stoker.store.blocks.BlockReader.fill_block`).
"""

from __future__ import annotations

import queue
import threading
from bisect import bisect_right

from ...store.runs import adjacent_run, fill_run
from . import inflight as infl

#: The tag of a fill outcome on the prefetch loop's event queue.
FILL = "fill"


def fill_status(ds, b: int) -> str:
    """Fill block ``b`` of ``ds`` (a Dataset view whose reader may have a staging area) without
    waiting for another process's fill: ``"cached"`` (present already), or what
    :meth:`stoker.store.blocks.BlockReader.fill_block` returns; a block the cache refuses goes to
    the staging area when there is one (:meth:`~stoker.store.blocks.BlockReader.stage_block`)."""
    if ds.cache.contains(ds.version, ds.blocks.name(b)):
        return "cached"
    status = ds.reader.fill_block(b, blocking=False, want_data=False)
    if status == "refused" and ds.reader.staging is not None:
        return ds.reader.stage_block(b)
    return status


def timed_fill(ds, run: tuple, clock: infl.BusyClock, target: infl.InflightTarget) -> dict:
    """The fill of ``run`` (consecutive block ids; one block, or several fetched with one merged
    GET by :func:`stoker.store.runs.fill_run`) on the busy clock; ``{block: status}``, a status
    being what :func:`fill_status` returns or, in a run, the exception of that block's fetch. A fill
    that read the origin feeds the in-flight target (one request of the bytes it fetched)."""
    t0 = clock.start()
    try:
        status = {run[0]: fill_status(ds, run[0])} if len(run) == 1 else fill_run(ds, list(run))
    finally:
        t1 = clock.stop()
    fetched = [b for b, s in status.items() if s in ("filled", "staged")]
    if fetched:
        target.observe(int(sum(ds.blocks.end[b] - ds.blocks.start[b] for b in fetched)), t1 - t0, t1)
    return status


class FillThreads:
    """The threads that run the fills: one per fill in flight at most, started when the fills in
    flight outnumber them (so their number follows the in-flight target, not its ceiling). A fill
    is handed over once, through one queue, and its outcome comes back on ``events`` as
    ``(FILL, token, status or None, exception or None)``: no ``Future``, no per-fill callback."""

    def __init__(self, events: queue.SimpleQueue):
        self.events = events
        self.busy = 0  # fills handed over and not yet reported back (the main loop's count)
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def submit(self, token: int, fn, *args) -> None:
        self.busy += 1
        if len(self._threads) < self.busy:
            t = threading.Thread(target=self._serve, name=f"stoker-fill-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()
        self._tasks.put((token, fn, args))

    @property
    def started(self) -> int:
        """Threads started so far."""
        return len(self._threads)

    @property
    def alive(self) -> int:
        """Threads still running."""
        return sum(t.is_alive() for t in self._threads)

    def reported(self) -> None:
        """One fill's outcome was taken off the event queue."""
        self.busy -= 1

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None or self._stopping:
                return
            token, fn, args = task
            try:
                self.events.put((FILL, token, fn(*args), None))
            except BaseException as exc:  # noqa: BLE001 - the main loop reports it per block
                self.events.put((FILL, token, None, exc))

    def shutdown(self) -> None:
        """Fills not started are dropped; fills in flight finish (each one ranged GET, bounded by
        the request timeout); then the threads end."""
        self._stopping = True
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()


def merge_run(
    ds, job: dict, j: int, consumed: int, prefetch_bytes: int, lookahead: int, cap_bytes: int, covered: set, sizes: list
) -> tuple:
    """The run of adjacent blocks to fetch with block ``job["blocks"][j]``: its neighbours in the
    shard (:func:`stoker.store.runs.adjacent_run`, at most ``cap_bytes`` together) among the next
    ``lookahead`` blocks of the schedule that lie within ``prefetch_bytes`` of the consumer and are
    neither issued yet nor cached. A tuple of ascending block ids. ``sizes``: block -> bytes."""
    blocks, cum = job["blocks"], job["cum"]
    b = blocks[j]
    if cap_bytes <= sizes[b]:
        return (b,)
    base = cum[min(consumed, j)]
    stop = bisect_right(cum, base + prefetch_bytes)  # positions < stop qualify
    window = set(blocks[j + 1 : max(j + 1, min(j + 1 + lookahead, stop))])
    if not window:
        return (b,)

    def wanted(w: int) -> bool:  # asked only about the neighbours the run reaches: few cache looks
        return w in window and w not in covered and not ds.cache.contains(ds.version, ds.blocks.name(w))

    return tuple(adjacent_run(ds, b, wanted, cap_bytes))


def charge_origin(
    ds,
    counters,
    fetched,
    sizes_of,
    seen_bytes: int,
    seen_requests: int,
    plan_run: int,
    prev_run,
    prev_all: dict,
    prev_done,
) -> tuple[int, int]:
    """Charge the origin traffic since (``seen_bytes``, ``seen_requests``) to the ledger rows:
    each fetched block (size, one request) to the plan it serves first
    (:func:`stoker.loader.prefetch.inflight.serving_plan`), the rest (retries, partial reads) to the
    current plan. Returns the new (seen_bytes, seen_requests)."""
    now_bytes, now_requests = ds.origin.counters.bytes, ds.origin.counters.requests
    left_bytes, left_requests = now_bytes - seen_bytes, now_requests - seen_requests
    done_prev = int(prev_done.value) if prev_done is not None else 0
    for b, what in fetched:
        run = infl.serving_plan(b, plan_run, prev_run, prev_all, done_prev)
        size = min(int(sizes_of[b]), max(0, left_bytes))
        req = min(1, max(0, left_requests))
        infl.charge(counters, run, "origin_bytes", size)
        infl.charge(counters, run, "origin_requests", req)
        infl.charge(counters, run, what, 1)
        left_bytes, left_requests = left_bytes - size, left_requests - req
    infl.charge(counters, plan_run, "origin_bytes", left_bytes)
    infl.charge(counters, plan_run, "origin_requests", left_requests)
    return now_bytes, now_requests
