"""Block prefetch that follows the epoch's order, in its own process.

The order of an epoch is known in advance, so the blocks it needs are known too:
block b is first needed at position ``first_need[b]`` of the rank's sample plan.
The prefetcher fills blocks in first-need order (the order that makes the
longest prefix of the epoch servable soonest), with ``concurrency`` ranged GETs
in flight, staying at most ``ahead_bytes`` ahead of the position the loader has
dispatched to its workers. A block whose neighbours in its shard are among the next blocks
to fetch is fetched with them in one merged ranged GET (:mod:`stoker.store.runs`), capped at the
measured bandwidth-delay product (until it is measured, that of an assumed 20 ms, 200 MB/s origin:
merged GETs start with the first fills). A block the cache does not admit is fetched into the
loader's staging area instead (bounded by ``staging_bytes``); without a staging area such a
block ends prefetching for the epoch (under the no-eviction policy nothing later would be
admitted either) and the workers read those samples on demand.

Each block is fetched once per plan: a block found in staging already (a worker fetched it
first, :meth:`stoker.store.blocks.BlockReader.block_for_read`) is taken over, not fetched again.
A staged block is deleted once its last use in its plan is delivered, and when a plan arrives
that does not drain the previous one (the previous epoch is over), every block staged for the
previous one goes at once: staging never serves a later epoch. The one exception: when the next
plan is sent while this one drains (``prefetch_next_epoch``), a block still staged for this
plan's last batches that the next plan reaches is used for it too (the ledger's
``staged_reused``), never fetched a second time while it is there.

While the origin throttles (:class:`stoker.storage.retry.SharedBackoff` of the dataset's origin, shared
by the fill threads), the prefetcher backs off as a whole: it starts no new fill, so one probe
request tests the origin instead of ``concurrency`` of them, and resumes when a request succeeds.

The process's main thread sleeps on one queue: commands (posted by a thread that blocks on the
command queue, and that posts a stop when the parent is gone) and fill outcomes (posted by the fill
threads, one thread per fill in flight at most). It does its work only when woken, keeps running
totals of what is in flight and staged, and accounts a block found cached without waking a fill
thread. The loader tells its progress through plain shared integers, not a message, so the loop
looks at them on a timer only while something waits on them: ``ahead_bytes`` or the staging
budget reached (:data:`CONSUMER_POLL_S`), staged blocks waiting for their last use to be delivered
(:data:`STAGED_POLL_S`); besides, a busy block's retry time and the origin's back-off.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from bisect import bisect_left, bisect_right

import numpy as np

from ..store.runs import adjacent_run, fill_run, merge_cap_bytes
from . import inflight as infl

log = logging.getLogger(__name__)

# Shared counters: [origin bytes, origin requests, blocks filled, blocks already cached, errors,
#                   blocks staged (not admitted to the cache), prefetch depth samples (bytes
#                   completed ahead of the consumer, summed), number of depth samples], then the
#                   requests in flight, the busy clock, the origin retries and the per-plan
#                   ledger (:mod:`.inflight`)
N_COUNTERS = infl.N_SHARED
#: Consecutive failed fills after which prefetching stops for the epoch.
MAX_FAILURES = 3
#: Times a block whose fetch lock was held elsewhere is tried again while it is still needed.
MAX_BUSY_RETRIES = 50
#: Wait before the k-th such retry: BUSY_BACKOFF_S * 2**k seconds, at most BUSY_BACKOFF_MAX_S.
#: A fill holds its lock for one block GET (tens of ms), so retries spread over about 4 s;
#: retrying at once spent all 50 tries in 10 ms and the block was then read sample by sample.
BUSY_BACKOFF_S = 0.005
BUSY_BACKOFF_MAX_S = 0.1
#: Seconds between looks at the consumer's position while the prefetcher waits on it (``ahead_bytes``
#: reached, or the staging budget full until staged blocks are delivered). The loader sends no
#: notification of its progress (plain shared integers), so this is the one timer of a busy loop.
CONSUMER_POLL_S = 0.01
#: Seconds between looks at the delivered position while staged blocks wait for their last use.
STAGED_POLL_S = 0.05
#: Seconds between looks at the origin's back-off while the fills in flight wait for it.
THROTTLE_POLL_S = 0.05
#: Seconds between checks that the parent process is alive while no command comes (the kernel
#: kills this process with its parent where it has ``PR_SET_PDEATHSIG``; this is the fallback).
PARENT_POLL_S = 0.25
#: Until the origin's latency and bandwidth are measured, merged GETs are capped as for an
#: origin of 20 ms and 200 MB/s (4 MB): one GET moves several blocks from the first fills on.
ASSUMED_LATENCY_S = 0.02
ASSUMED_BANDWIDTH_BPS = 200e6
#: Kinds of the events the loop sleeps on: a command (or None: stop), a fill's outcome.
_CMD, _FILL = "cmd", "fill"


def _end_plan(ds, staged: dict, needed: dict) -> None:
    """The previous plan is over (delivered, cut short or given up): delete the blocks staged
    for it (``staged``, emptied) and every other staged file that the new plan (``needed``:
    block -> last use) does not need. A file the new plan needs that the prefetcher did not
    stage is a worker's fetch for this plan (:meth:`stoker.store.blocks.BlockReader.block_for_read`)
    and stays, to be taken over when the prefetcher reaches it (rarely, a worker's fetch for the
    previous plan that the prefetcher never reached, having stopped: it is kept too)."""
    for name in ds.reader.staging.names(ds.version):
        b = ds.block_of_name(name)
        if b is None or b in staged or b not in needed:
            ds.reader.staging.remove(ds.version, name)
    staged.clear()


def _drop_staged(ds, staged: dict, last_use: dict, done_pos: int, keep=()) -> None:
    """Delete the staged blocks whose last use (``last_use[b]``, a plan position) is before
    ``done_pos``, except those in ``keep``; they leave ``staged``."""
    for b in [b for b, last in last_use.items() if last < done_pos and b in staged and b not in keep]:
        ds.reader.staging.remove(ds.version, ds.block_name(b))
        del staged[b]


def block_schedule(ds, plan: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks needed by ``plan`` (sample ids in consumption order) in first-need order.

    Returns (blocks int64 (K,), first_need int64 (K,), last_need int64 (K,)): the distinct
    blocks, ascending by the plan position at which each is first needed, and the
    position of each block's last use.
    """
    blocks = ds.sample_block[plan]
    uniq, first = np.unique(blocks, return_index=True)
    _, rev = np.unique(blocks[::-1], return_index=True)
    last = len(blocks) - 1 - rev
    order = np.argsort(first, kind="stable")
    return uniq[order].astype(np.int64), first[order].astype(np.int64), last[order].astype(np.int64)


def _fill(ds, b: int) -> str:
    if ds.cache.contains(ds.version, ds.block_name(b)):
        return "cached"
    status = ds.reader.fill_block(b, blocking=False, want_data=False)
    if status == "refused" and ds.reader.staging is not None:
        return ds.reader.stage_block(b)
    return status


def _timed_fill(ds, run: tuple, clock: infl.BusyClock, target: infl.InflightTarget) -> dict:
    """The fill of ``run`` (consecutive block ids; one block, or several fetched with one merged
    GET by :func:`stoker.store.runs.fill_run`) on the busy clock; ``{block: status}``, a status
    being what :func:`_fill` returns or, in a run, the exception of that block's fetch. A fill
    that read the origin feeds the in-flight target (one request of the bytes it fetched)."""
    t0 = clock.start()
    try:
        status = {run[0]: _fill(ds, run[0])} if len(run) == 1 else fill_run(ds, list(run))
    finally:
        t1 = clock.stop()
    fetched = [b for b, s in status.items() if s in ("filled", "staged")]
    if fetched:
        target.observe(int(sum(ds.block_end[b] - ds.block_start[b] for b in fetched)), t1 - t0, t1)
    return status


class _Staged(dict):
    """Staged block -> plan position of its last use, with the bytes of those blocks kept as a
    running total (:attr:`bytes`) instead of summed on every look."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.sizes, self.bytes = sizes, 0

    def __setitem__(self, b: int, last: int) -> None:
        if b not in self:
            self.bytes += self.sizes[b]
        super().__setitem__(b, last)

    def __delitem__(self, b: int) -> None:
        super().__delitem__(b)
        self.bytes -= self.sizes[b]

    def clear(self) -> None:
        super().clear()
        self.bytes = 0


class _FillThreads:
    """The threads that run the fills: one per fill in flight at most, started when the fills in
    flight outnumber them (so their number follows the in-flight target, not its ceiling). A fill
    is handed over once, through one queue, and its outcome comes back on ``events`` as
    ``(_FILL, token, status or None, exception or None)``: no ``Future``, no per-fill callback."""

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
                self.events.put((_FILL, token, fn(*args), None))
            except BaseException as exc:  # noqa: BLE001 - the main loop reports it per block
                self.events.put((_FILL, token, None, exc))

    def shutdown(self) -> None:
        """Fills not started are dropped; fills in flight finish (each one ranged GET, bounded by
        the request timeout); then the threads end."""
        self._stopping = True
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()


def _read_commands(commands, events: queue.SimpleQueue, parent: int) -> None:
    """Thread: blocks on the command queue and posts each command to ``events`` as ``(_CMD, cmd)``.
    Posts ``(_CMD, None)`` (stop) after a stop command, when the parent process is gone (looked at
    every :data:`PARENT_POLL_S` while no command comes; ``PR_SET_PDEATHSIG`` kills the process at
    once where the kernel has it) or when the queue breaks."""
    from .._procs import parent_gone
    try:
        while True:
            try:
                cmd = commands.get(timeout=PARENT_POLL_S)
            except queue.Empty:
                if parent_gone(parent):
                    return
                continue
            if cmd is None:
                return
            events.put((_CMD, cmd))
    except (EOFError, OSError, ValueError) as exc:  # the queue is closed or broken: nothing more will come
        log.debug("prefetch command queue: %s", exc)
    finally:
        events.put((_CMD, None))


def prefetch_main(ds, commands, position, done, counters, concurrency: int, ahead_bytes: int,
                  staging_bytes: int = 64 << 20, prev_done=None, adopt: bool = False, ready=None) -> None:
    """Prefetcher process loop. ``commands``: queue of (run, blocks, first_need, last_need[,
    draining]) or None to stop (``draining``: the previous plan is still being delivered, so the
    blocks it needs are charged to its ledger row, :mod:`.inflight`); ``position``: shared int64, plan position dispatched to the workers;
    ``done``: shared int64, plan position already delivered (staged blocks whose last use
    is before it are deleted); ``counters``: shared int64 array (see N_COUNTERS).
    ``staging_bytes``: most bytes held in staged blocks plus fills in flight that may be staged.
    ``prev_done``: shared int64, the previous plan's delivered position while it drains after a
    plan change: its staged blocks go as soon as their last use in it is delivered.
    ``adopt``: this process replaces one that died; the blocks of its first plan that are in the
    staging area already (staged by the dead one: whole files, written by rename) are taken over
    as staged, so they are counted in ``staging_bytes`` and deleted after their last use. Its
    origin counters continue from the values in ``counters`` (the dead one's).
    ``concurrency``: the least ranged GETs kept in flight; more while the measured
    bandwidth-delay product asks for them (:class:`stoker.loader.inflight.InflightTarget`).
    ``ready``: a shared counter (``multiprocessing.Value``) incremented once the origin client is built.

    The loop sleeps on one queue (:data:`_CMD` commands from a thread that blocks on ``commands``,
    :data:`_FILL` outcomes from the fill threads) and looks at the shared positions only when it
    wakes; it wakes on a timer only while something waits on the consumer (``ahead_bytes`` or
    ``staging_bytes`` reached, staged blocks waiting for their last use to be delivered), on a
    fill's retry time, or while the origin throttles."""
    from .._procs import exit_with_parent, parent_gone
    from .workers import fresh_copy
    parent = os.getppid()
    exit_with_parent()
    ds = fresh_copy(ds)
    if not ds.origin.use_native():  # this process never forks: obstore's runtime is safe here
        ds.origin.warm()  # s3fs: build the client now (~0.25 s), not at the first read
    target = infl.InflightTarget(concurrency)
    clock = infl.BusyClock(counters)
    events: queue.SimpleQueue = queue.SimpleQueue()
    pool = _FillThreads(events)
    threading.Thread(target=_read_commands, args=(commands, events, parent), name="stoker-prefetch-commands",
                     daemon=True).start()
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    loop = _Loop(ds, counters, pool, clock, target, ahead_bytes, staging_bytes, position, done, prev_done, adopt)
    try:
        timeout = None
        while True:
            try:
                batch = [events.get(timeout=timeout)]
            except queue.Empty:
                batch = []
                if parent_gone(parent):
                    break
            while not events.empty():  # one consumer: what is there now is taken without waiting
                batch.append(events.get())
            if not loop.wake(batch):
                break
            timeout = loop.timeout
    finally:
        # Queued fills are dropped; fills waiting to retry give up at once (cancel); fills in flight
        # finish (each is one ranged GET, bounded by the request timeout). The loader kills this
        # process if that takes too long; a fill cut short leaves only a temporary file, which the
        # next open of the cache removes (DiskCache.recover).
        ds.origin.backoff.cancel()
        pool.shutdown()
        if ds.reader.staging is not None:
            ds.reader.staging.clear()


class _Loop:
    """The state of :func:`prefetch_main` between wake-ups, with running totals (bytes and blocks
    in flight, staged bytes) kept on submit and completion instead of recomputed on every look.
    Block ids, positions and sizes are Python ints."""

    def __init__(self, ds, counters, pool: _FillThreads, clock, target, ahead_bytes: int, staging_bytes: int,
                 position, done, prev_done, adopt: bool):
        self.ds, self.counters, self.pool, self.clock, self.target = ds, counters, pool, clock, target
        self.ahead_bytes, self.staging_bytes = int(ahead_bytes), int(staging_bytes)
        self.position, self.done, self.prev_done, self.adopt = position, done, prev_done, adopt
        self.sizes: list[int] = (ds.block_end - ds.block_start).astype(np.int64).tolist()
        self.block_bytes = int(ds.block_bytes)
        self.staging = ds.reader.staging
        self.plan_run, self.prev_run = -1, None  # run ids of the current and the draining plan (ledger rows)
        self.prev_all: dict[int, int] = {}  # every block of the draining plan -> its last use there
        self.seen_bytes, self.seen_requests = ds.origin.counters.bytes, ds.origin.counters.requests
        self.job: dict | None = None
        self.staged = _Staged(self.sizes)  # staged block -> plan position of its last use
        self.prev: dict[int, int] = {}    # staged blocks of the previous plan -> their last use in it
        self.cur_last: dict[int, int] = {}  # block -> last use in the current plan (kept after it is done)
        self.carried: set[int] = set()    # blocks still staged for the draining plan when the current one came
        self.base_bytes, self.base_requests = int(counters[0]), int(counters[1])  # a dead predecessor's
        self.base_retries = int(counters[infl.ORIGIN_RETRIES])
        self.inflight: dict[int, tuple] = {}  # token -> the blocks of one fill in flight
        self.inflight_bytes = 0               # their bytes
        self.flying: dict[int, int] = {}      # block -> fills in flight that hold it
        self.token = 0
        self.seen_pos = self.seen_done = self.seen_prev_done = -1
        self.timeout: float | None = None

    # -- events ---------------------------------------------------------------
    def wake(self, batch: list) -> bool:
        """Take the events of one wake-up (commands first, then fill outcomes, as they came) and
        do what is due; False to stop. Sets :attr:`timeout` (seconds, or None: until an event)."""
        fills = []
        for ev in batch:
            if ev[0] is _CMD:
                if ev[1] is None:
                    return False
                self._plan(ev[1])
            else:
                fills.append(ev)
        pos, done_v = int(self.position.value), int(self.done.value)
        prev_done_v = int(self.prev_done.value) if self.prev_done is not None else 0
        if (not batch and pos == self.seen_pos and done_v == self.seen_done and prev_done_v == self.seen_prev_done
                and not (self.job is not None and self.job["retry"]) and not self.ds.origin.backoff.throttled):
            return True  # a timer, and nothing it waits for has moved: keep waiting as before
        self.seen_done, self.seen_prev_done = done_v, prev_done_v
        fetched = self._outcomes(fills, done_v) if fills else []
        # staged blocks go once their last use is delivered, also after every block is fetched (a
        # block a fill in flight may be finding staged stays until that fill is accounted)
        if self.staged:
            _drop_staged(self.ds, self.staged, self.staged, done_v, keep=self.flying)
            if self.prev_done is not None and self.prev:
                _drop_staged(self.ds, self.staged, self.prev, prev_done_v, keep=self.flying)
                self.prev = {b: last for b, last in self.prev.items() if b in self.staged}
        c = self.counters
        c[0] = self.base_bytes + self.ds.origin.counters.bytes
        c[1] = self.base_requests + self.ds.origin.counters.requests
        c[infl.ORIGIN_RETRIES] = self.base_retries + self.ds.origin.counters.retries
        if fills:
            self.seen_bytes, self.seen_requests = _charge(
                self.ds, c, fetched, self.sizes, self.seen_bytes, self.seen_requests,
                self.plan_run, self.prev_run, self.prev_all, self.prev_done)
            c[infl.TARGET] = self.target.target
            if self.target.bandwidth_Bps:
                c[infl.LATENCY_US] = int(self.target.latency_s * 1e6)
                c[infl.BANDWIDTH_BPS] = int(self.target.bandwidth_Bps)
        if self.inflight:
            self.clock.flush()
        self.timeout = None
        if self.job is None:
            self.seen_pos = pos
            self._idle_timeout()
            return True
        self._issue(pos, done_v)
        return True

    def _plan(self, cmd) -> None:
        """A new plan ``(run, blocks, first_need, last_need[, draining])``."""
        ds, staged = self.ds, self.staged
        run, blocks, first_need, last_need = cmd[:4]
        draining = len(cmd) > 4 and bool(cmd[4])
        self.prev_run, self.prev_all = (self.plan_run, self.cur_last) if draining and self.plan_run != run else (None, {})
        self.plan_run = int(run)
        infl.open_row(self.counters, self.plan_run)
        blocks_l: list[int] = [int(b) for b in blocks.tolist()]
        new_last = dict(zip(blocks_l, last_need.tolist()))
        if draining:
            # Blocks staged for the previous plan may still be read by its last batches; they go
            # once their last use there is delivered (prev_done), or at the latest once the new
            # plan's first batch is delivered (done > 0). One that the new plan reaches while it
            # is still there is used again (``staged_reused``), not fetched a second time.
            self.prev = {b: self.cur_last[b] for b in staged if b in self.cur_last}
            for b in staged:
                staged[b] = 0
            self.carried = set(staged)
        elif self.staging is not None:  # no staged block outlives the plan it was fetched for
            _end_plan(ds, staged, new_last)
            self.prev, self.carried = {}, set()
        cum = [0]
        for b in blocks_l:
            cum.append(cum[-1] + self.sizes[b])
        # fills still in flight for the previous plan stay tracked (their staged blocks too)
        self.job = {"blocks": blocks_l, "first": [int(x) for x in first_need.tolist()], "cum": cum, "next": 0,
                    "retry": [], "tries": {}, "failures": 0, "last": new_last, "covered": set(),
                    "depth_pos": None, "first_round": cum[min(self.target.floor, len(blocks_l))]}
        self.cur_last = new_last
        if self.adopt and self.staging is not None:
            self.adopt = False
            for name in self.staging.names(ds.version):
                b = ds.block_of_name(name)
                if b in self.cur_last:
                    staged[b] = self.cur_last[b]

    def _outcomes(self, fills: list, done_v: int) -> list[tuple[int, str]]:
        """Account the fills that finished; returns the blocks fetched from the origin as
        ``(block, "prefetch_fills" / "prefetch_staged")``."""
        results: list[tuple[int, object]] = []  # (block, status or the exception of its fill)
        for _, token, status, exc in fills:
            run_blocks = self.inflight.pop(token)
            self.pool.reported()
            for b in run_blocks:
                self.inflight_bytes -= self.sizes[b]
                n = self.flying[b] - 1
                if n:
                    self.flying[b] = n
                else:
                    del self.flying[b]
            if exc is not None:  # the reader will retry and report
                results.extend((b, exc) for b in run_blocks)
            else:
                results.extend(status.items())
        fetched: list[tuple[int, str]] = []
        for b, status in results:
            self._result(b, status, done_v, fetched)
        return fetched

    def _result(self, b: int, status, done_v: int, fetched: list) -> None:
        """Account block ``b``'s fill outcome ``status`` (a status of :func:`_fill` or an exception)."""
        job, c, staged = self.job, self.counters, self.staged
        if job is None:  # cannot happen: a plan is done only once nothing is in flight
            job = {"blocks": [], "next": 0, "failures": 0, "last": {}, "tries": {}, "retry": []}
        if isinstance(status, BaseException):
            log.warning("prefetch failed: %s", status)
            c[4] += 1
            job["failures"] += 1
            if job["failures"] >= MAX_FAILURES:
                # The origin is failing: stop adding load; the workers' own reads
                # retry and report the error to the training process.
                log.warning("prefetch stopped for this epoch after %d failures", job["failures"])
                job["next"] = len(job["blocks"])
            return
        job["failures"] = 0
        if status in ("filled", "staged"):
            fetched.append((b, "prefetch_fills" if status == "filled" else "prefetch_staged"))
        if status == "filled":
            c[2] += 1
        elif status == "cached":
            c[3] += 1
        elif status == "refused":  # no staging area: nothing later would be admitted either
            job["next"] = len(job["blocks"])
        elif status == "staged":
            c[5] += 1
            staged[b] = job["last"].get(b, 0)  # 0: a block of the previous plan
            self.prev.pop(b, None)  # staged for the new plan: kept for its last use there
        elif status == "in_staging":  # a worker's fetch, or a block the draining plan still holds
            if b in self.carried:
                self.carried.discard(b)
                infl.charge(c, self.plan_run, "staged_reused", 1)
            staged[b] = job["last"].get(b, 0)  # taken over: counted in staging, deleted after its last use
            self.prev.pop(b, None)
        elif status == "busy" and b in job["last"] and job["last"][b] >= done_v:
            # another process holds its fetch lock (a worker that got there first, or another
            # job filling it): try again, or the block would never be staged for this plan
            k = job["tries"][b] = job["tries"].get(b, 0) + 1
            if k <= MAX_BUSY_RETRIES:
                job["retry"].append((time.monotonic() + min(BUSY_BACKOFF_MAX_S, BUSY_BACKOFF_S * 2 ** k), b))

    # -- issuing fills ----------------------------------------------------------
    def _submit(self, run: tuple) -> None:
        self.token += 1
        self.inflight[self.token] = run
        for b in run:
            self.inflight_bytes += self.sizes[b]
            self.flying[b] = self.flying.get(b, 0) + 1
        self.pool.submit(self.token, _timed_fill, self.ds, run, self.clock, self.target)

    def _issue(self, pos: int, done_v: int) -> None:
        """Start the fills that are due (retries, then the plan's next blocks) and set the timer."""
        job, ds, c = self.job, self.ds, self.counters
        concurrency = self.target.target
        # the origin throttles: start nothing new while the fills in flight wait for its back-off
        # (with none in flight, the next fill is the one that probes the origin)
        throttled = bool(self.inflight) and ds.origin.backoff.throttled
        timeout = THROTTLE_POLL_S if throttled else None
        if job["retry"]:
            now = time.monotonic()
            if len(self.inflight) < concurrency and not throttled:
                due = [r for r in job["retry"] if r[0] <= now][: concurrency - len(self.inflight)]
                for r in due:
                    job["retry"].remove(r)
                    self._submit((r[1],))
            if job["retry"]:
                # the next retry's time; one due already waits for a free slot (a fill's end wakes
                # the loop) or for the back-off (THROTTLE_POLL_S)
                later = [r[0] for r in job["retry"] if r[0] > now]
                if later:
                    timeout = _sooner(timeout, min(later) - now)
        blocks, cum = job["blocks"], job["cum"]
        j = job["next"]
        consumed = bisect_left(job["first"], pos)
        self.seen_pos = pos
        if pos != job["depth_pos"]:
            # prefetch depth: bytes of blocks issued and finished ahead of the consumer
            c[6] += max(0, cum[j] - cum[min(consumed, j)] - self.inflight_bytes)
            c[7] += 1
            job["depth_pos"] = pos
        staging, staged = self.staging, self.staged
        covered = job["covered"]  # blocks fetched ahead of their turn by a merged GET
        cap_bytes = None
        waits_on_consumer = False
        while j < len(blocks) and len(self.inflight) < concurrency and not throttled:
            if cum[j] - cum[min(consumed, j)] > self.ahead_bytes:
                waits_on_consumer = True
                break
            b = blocks[j]
            if b in covered:
                j += 1
                continue
            if ds.cache.contains(ds.version, ds.block_name(b)):
                # present already: accounted here, no fill thread woken for it
                covered.add(b)
                self._result(b, "cached", done_v, [])
                j += 1
                continue
            if cap_bytes is None:
                cap_bytes = self._cap_bytes()
            # a plan's first round of fills (``fetch_concurrency`` of them) is one block each, as the
            # first batch waits for them; then runs grow with the bytes of the plan before them
            ramp = max(self.sizes[b], cum[j] - job["first_round"])
            run = _merge(ds, job, j, consumed, self.ahead_bytes, 2 * concurrency, min(cap_bytes, ramp), covered,
                         self.sizes)
            if staging is not None:
                # may end up staged: keep staged bytes plus such fills in flight within budget
                if staged.bytes + self.inflight_bytes + sum(self.sizes[x] for x in run) > self.staging_bytes:
                    run = (b,)  # a merged run would not fit: this block alone, as before
                    if (staged.bytes + self.inflight_bytes + self.sizes[b] > self.staging_bytes
                            and (staged or self.inflight)):
                        waits_on_consumer = True  # until staged blocks are delivered (or fills end)
                        break
            covered.update(run)
            self._submit(run)
            j += 1
        job["next"] = j
        if j >= len(blocks) and not self.inflight and not job["retry"]:
            c[infl.PLAN_DONE] = self.plan_run  # the loader may start the next plan's batches
            self.job = None
            self._idle_timeout()
            return
        if waits_on_consumer:
            timeout = _sooner(timeout, CONSUMER_POLL_S)
        if self.staged:
            timeout = _sooner(timeout, STAGED_POLL_S)
        if not self.inflight and j < len(blocks) and not waits_on_consumer and not job["retry"] and timeout is None:
            timeout = CONSUMER_POLL_S  # not expected (a fill is issued then); never sleep with nothing to wake us
        self.timeout = timeout

    def _cap_bytes(self) -> int:
        """Largest merged GET now: the measured bandwidth-delay product; until the origin is
        measured, that of an origin of :data:`ASSUMED_LATENCY_S` and :data:`ASSUMED_BANDWIDTH_BPS`,
        so that merged GETs start with the first fills."""
        t = self.target
        if t.bandwidth_Bps and 0 < t.latency_s < float("inf"):
            return merge_cap_bytes(t.latency_s, t.bandwidth_Bps, self.block_bytes)
        return merge_cap_bytes(ASSUMED_LATENCY_S, ASSUMED_BANDWIDTH_BPS, self.block_bytes)

    def _idle_timeout(self) -> None:
        """No plan in progress: wake for commands only, and for the delivered position while
        staged blocks wait for their last use."""
        self.timeout = STAGED_POLL_S if self.staged else None


def _sooner(a: float | None, b: float | None) -> float | None:
    """The shorter of two timeouts (None: none)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def _merge(ds, job: dict, j: int, consumed: int, ahead_bytes: int, lookahead: int, cap_bytes: int,
           covered: set, sizes: list) -> tuple:
    """The run of adjacent blocks to fetch with block ``job["blocks"][j]``: its neighbours in the
    shard (:func:`stoker.store.runs.adjacent_run`, at most ``cap_bytes`` together) among the next
    ``lookahead`` blocks of the schedule that lie within ``ahead_bytes`` of the consumer and are
    neither issued yet nor cached. A tuple of ascending block ids. ``sizes``: block -> bytes."""
    blocks, cum = job["blocks"], job["cum"]
    b = blocks[j]
    if cap_bytes <= sizes[b]:
        return (b,)
    base = cum[min(consumed, j)]
    stop = bisect_right(cum, base + ahead_bytes)  # positions < stop qualify
    window = set(blocks[j + 1:max(j + 1, min(j + 1 + lookahead, stop))])
    if not window:
        return (b,)

    def wanted(w: int) -> bool:  # asked only about the neighbours the run reaches: few cache looks
        return w in window and w not in covered and not ds.cache.contains(ds.version, ds.block_name(w))
    return tuple(adjacent_run(ds, b, wanted, cap_bytes))


def _charge(ds, counters, fetched, sizes_of, seen_bytes: int, seen_requests: int, plan_run: int,
            prev_run, prev_all: dict, prev_done) -> tuple[int, int]:
    """Charge the origin traffic since (``seen_bytes``, ``seen_requests``) to the ledger rows:
    each fetched block (size, one request) to the plan it serves first
    (:func:`stoker.loader.inflight.serving_plan`), the rest (retries, partial reads) to the
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
