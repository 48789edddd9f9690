"""The prefetch process's state between wake-ups (:class:`PrefetchLoop`): which plan it
serves, what is in flight and staged, and which fills to start next, in first-need order within
``read.prefetch_bytes`` of the consumer. :func:`stoker.loader.prefetch.process.prefetch_main` wakes it with the
events of one wake-up (commands and fill outcomes) and sleeps for the :attr:`PrefetchLoop.timeout`
it sets; the fills run in :mod:`stoker.loader.prefetch.fills`.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import numpy as np

from ...store.runs import merge_cap_bytes
from . import inflight as infl
from .fills import FillThreads, charge_origin, merge_run, timed_fill

log = logging.getLogger(__name__)

#: The tag of a command on the prefetch loop's event queue (the plan, or None: stop).
CMD = "cmd"

#: Consecutive failed fills after which prefetching stops for the epoch.
MAX_FAILURES = 3
#: Times a block whose fetch lock was held elsewhere is tried again while it is still needed.
MAX_BUSY_RETRIES = 50
#: Wait before the k-th such retry: BUSY_BACKOFF_S * 2**k seconds, at most BUSY_BACKOFF_MAX_S.
#: A fill holds its lock for one block GET (tens of ms), so retries spread over about 4 s;
#: retrying at once spent all 50 tries in 10 ms and the block was then read sample by sample.
BUSY_BACKOFF_S = 0.005
BUSY_BACKOFF_MAX_S = 0.1
#: Seconds between looks at the consumer's position while the prefetcher waits on it (``prefetch_bytes``
#: reached, or the staging budget full until staged blocks are delivered). The loader sends no
#: notification of its progress (plain shared integers), so this is the one timer of a busy loop.
CONSUMER_POLL_S = 0.01
#: Seconds between looks at the delivered position while staged blocks wait for their last use.
STAGED_POLL_S = 0.05
#: Seconds between looks at the origin's back-off while the fills in flight wait for it.
THROTTLE_POLL_S = 0.05
#: Seconds between checks that the parent process is alive while no command comes (the kernel
#: Until the origin's latency and bandwidth are measured, merged GETs are capped as for an
#: origin of 20 ms and 200 MB/s (4 MB): one GET moves several blocks from the first fills on.
ASSUMED_LATENCY_S = 0.02
ASSUMED_BANDWIDTH_BPS = 200e6
#: Kinds of the events the loop sleeps on: a command (or None: stop), a fill's outcome.


def end_plan(ds, staged: dict, needed: dict) -> None:
    """The previous plan is over (delivered, cut short or given up): delete the blocks staged
    for it (``staged``, emptied) and every other staged file that the new plan (``needed``:
    block -> last use) does not need. A file the new plan needs that the prefetcher did not
    stage is a worker's fetch for this plan (:meth:`stoker.store.blocks.BlockReader.block_for_read`)
    and stays, to be taken over when the prefetcher reaches it (rarely, a worker's fetch for the
    previous plan that the prefetcher never reached, having stopped: it is kept too)."""
    for name in ds.reader.staging.names(ds.version):
        b = ds.blocks.of_name(name)
        if b is None or b in staged or b not in needed:
            ds.reader.staging.remove(ds.version, name)
    staged.clear()


def drop_staged(ds, staged: dict, last_use: dict, done_pos: int, keep=()) -> None:
    """Delete the staged blocks whose last use (``last_use[b]``, a plan position) is before
    ``done_pos``, except those in ``keep``; they leave ``staged``."""
    for b in [b for b, last in last_use.items() if last < done_pos and b in staged and b not in keep]:
        ds.reader.staging.remove(ds.version, ds.blocks.name(b))
        del staged[b]


class StagedBlocks(dict):
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


class PrefetchLoop:
    """The state of :func:`prefetch_main` between wake-ups, with running totals (bytes and blocks
    in flight, staged bytes) kept on submit and completion instead of recomputed on every look.
    Block ids, positions and sizes are Python ints. Its arguments are :func:`prefetch_main`'s
    (``pool``: the :class:`~stoker.loader.prefetch.fills.FillThreads` that run the fills); it reads
    ``read.prefetch_bytes`` (how far ahead of the consumer fills start), ``read.staging_bytes`` and
    ``read.fetch_concurrency`` from the :class:`~stoker.loader.options.ReadOptions` it is handed.
    """

    def __init__(self, ds, shared, pool: FillThreads, read, adopt: bool):
        self.ds, self.shared, self.counters, self.pool, self.read = ds, shared, shared.counters, pool, read
        self.clock = infl.BusyClock(shared.counters)
        self.target = infl.InflightTarget(read.fetch_concurrency)
        self.adopt = adopt
        self.sizes: list[int] = (ds.blocks.end - ds.blocks.start).astype(np.int64).tolist()
        self.block_bytes = int(ds.block_bytes)
        self.staging = ds.reader.staging
        # run ids of the current and the draining plan (ledger rows)
        self.plan_run: int = -1
        self.prev_run: int | None = None
        self.prev_all: dict[int, int] = {}  # every block of the draining plan -> its last use there
        self.seen_bytes, self.seen_requests = ds.origin.counters.bytes, ds.origin.counters.requests
        self.job: dict | None = None
        self.staged = StagedBlocks(self.sizes)  # staged block -> plan position of its last use
        self.prev: dict[int, int] = {}  # staged blocks of the previous plan -> their last use in it
        self.cur_last: dict[int, int] = {}  # block -> last use in the current plan (kept after it is done)
        self.carried: set[int] = set()  # blocks still staged for the draining plan when the current one came
        counters = shared.counters
        self.base_bytes, self.base_requests = int(counters[0]), int(counters[1])  # a dead predecessor's
        self.base_retries = int(counters[infl.ORIGIN_RETRIES])
        self.inflight: dict[int, tuple] = {}  # token -> the blocks of one fill in flight
        self.inflight_bytes = 0  # their bytes
        self.flying: dict[int, int] = {}  # block -> fills in flight that hold it
        self.token = 0
        self.seen_pos = self.seen_done = self.seen_prev_done = -1
        self.timeout: float | None = None

    # -- events ---------------------------------------------------------------
    def wake(self, batch: list) -> bool:
        """Take the events of one wake-up (commands first, then fill outcomes, as they came) and
        do what is due; False to stop. Sets :attr:`timeout` (seconds, or None: until an event)."""
        fills = []
        for ev in batch:
            if ev[0] is CMD:
                if ev[1] is None:
                    return False
                self._plan(ev[1])
            else:
                fills.append(ev)
        sh = self.shared
        pos, done_v, prev_done_v = int(sh.position.value), int(sh.done.value), int(sh.prev_done.value)
        if (
            not batch
            and pos == self.seen_pos
            and done_v == self.seen_done
            and prev_done_v == self.seen_prev_done
            and not (self.job is not None and self.job["retry"])
            and not self.ds.origin.backoff.throttled
        ):
            return True  # a timer, and nothing it waits for has moved: keep waiting as before
        self.seen_done, self.seen_prev_done = done_v, prev_done_v
        fetched = self._outcomes(fills, done_v) if fills else []
        # staged blocks go once their last use is delivered, also after every block is fetched (a
        # block a fill in flight may be finding staged stays until that fill is accounted)
        if self.staged:
            drop_staged(self.ds, self.staged, self.staged, done_v, keep=self.flying)
            if self.prev:
                drop_staged(self.ds, self.staged, self.prev, prev_done_v, keep=self.flying)
                self.prev = {b: last for b, last in self.prev.items() if b in self.staged}
        c = self.counters
        c[0] = self.base_bytes + self.ds.origin.counters.bytes
        c[1] = self.base_requests + self.ds.origin.counters.requests
        c[infl.ORIGIN_RETRIES] = self.base_retries + self.ds.origin.counters.retries
        if fills:
            self.seen_bytes, self.seen_requests = charge_origin(
                self.ds,
                c,
                fetched,
                self.sizes,
                self.seen_bytes,
                self.seen_requests,
                self.plan_run,
                self.prev_run,
                self.prev_all,
                sh.prev_done,
            )
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
        self.prev_run, self.prev_all = (
            (self.plan_run, self.cur_last) if draining and self.plan_run != run else (None, {})
        )
        self.plan_run = int(run)
        infl.open_row(self.counters, self.plan_run)
        blocks_l: list[int] = [int(b) for b in blocks.tolist()]
        new_last = dict(zip(blocks_l, last_need.tolist(), strict=True))
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
            end_plan(ds, staged, new_last)
            self.prev, self.carried = {}, set()
        cum = [0]
        for b in blocks_l:
            cum.append(cum[-1] + self.sizes[b])
        # fills still in flight for the previous plan stay tracked (their staged blocks too)
        self.job = {
            "blocks": blocks_l,
            "first": [int(x) for x in first_need.tolist()],
            "cum": cum,
            "next": 0,
            "retry": [],
            "tries": {},
            "failures": 0,
            "last": new_last,
            "covered": set(),
            "depth_pos": None,
            "first_round": cum[min(self.target.floor, len(blocks_l))],
        }
        self.cur_last = new_last
        if self.adopt and self.staging is not None:
            self.adopt = False
            for name in self.staging.names(ds.version):
                b = ds.blocks.of_name(name)
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
        """Account block ``b``'s fill outcome ``status`` (a status of :func:`fill_status` or an exception)."""
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
                job["retry"].append((time.monotonic() + min(BUSY_BACKOFF_MAX_S, BUSY_BACKOFF_S * 2**k), b))

    # -- issuing fills ----------------------------------------------------------
    def _submit(self, run: tuple) -> None:
        self.token += 1
        self.inflight[self.token] = run
        for b in run:
            self.inflight_bytes += self.sizes[b]
            self.flying[b] = self.flying.get(b, 0) + 1
        self.pool.submit(self.token, timed_fill, self.ds, run, self.clock, self.target)

    def _issue(self, pos: int, done_v: int) -> None:
        """Start the fills that are due (retries, then the plan's next blocks) and set the timer."""
        job, c = self.job, self.counters
        assert job is not None  # wake() issues fills only while a plan is in progress
        # the origin throttles: start nothing new while the fills in flight wait for its back-off
        # (with none in flight, the next fill is the one that probes the origin)
        throttled = bool(self.inflight) and self.ds.origin.backoff.throttled
        concurrency = self.target.target
        timeout = self._retries(concurrency, throttled, THROTTLE_POLL_S if throttled else None)
        blocks, cum = job["blocks"], job["cum"]
        consumed = bisect_left(job["first"], pos)
        self.seen_pos = pos
        if pos != job["depth_pos"]:
            # prefetch depth: bytes of blocks issued and finished ahead of the consumer
            j = job["next"]
            c[6] += max(0, cum[j] - cum[min(consumed, j)] - self.inflight_bytes)
            c[7] += 1
            job["depth_pos"] = pos
        waits_on_consumer = self._fills(consumed, done_v, concurrency, throttled)
        j = job["next"]
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

    def _retries(self, concurrency: int, throttled: bool, timeout: float | None) -> float | None:
        """Submit the busy blocks whose retry time has come, while fewer than ``concurrency`` fills
        are in flight (none while ``throttled``); returns ``timeout`` shortened to the next retry's time."""
        job = self.job
        assert job is not None
        if not job["retry"]:
            return timeout
        now = time.monotonic()
        if len(self.inflight) < concurrency and not throttled:
            due = [r for r in job["retry"] if r[0] <= now][: concurrency - len(self.inflight)]
            for r in due:
                job["retry"].remove(r)
                self._submit((r[1],))
        # the next retry's time; one due already waits for a free slot (a fill's end wakes the
        # loop) or for the back-off (THROTTLE_POLL_S)
        later = [r[0] for r in job["retry"] if r[0] > now]
        return _sooner(timeout, min(later) - now) if later else timeout

    def _fills(self, consumed: int, done_v: int, concurrency: int, throttled: bool) -> bool:
        """Submit the plan's next blocks in first-need order while fewer than ``concurrency`` fills
        are in flight (none while ``throttled``), each
        within ``read.prefetch_bytes`` of the consumer (``consumed``: blocks whose first use it has
        reached) and, where it may end up staged, within ``read.staging_bytes``; a block present
        already is accounted without a fill. Returns whether it stopped to wait on the consumer."""
        job, ds, staged = self.job, self.ds, self.staged
        assert job is not None
        blocks, cum, covered = job["blocks"], job["cum"], job["covered"]  # covered: fetched ahead by a merged GET
        read = self.read
        j, cap_bytes, waits = job["next"], None, False
        while j < len(blocks) and len(self.inflight) < concurrency and not throttled:
            if cum[j] - cum[min(consumed, j)] > read.prefetch_bytes:
                waits = True
                break
            b = blocks[j]
            if b in covered:
                j += 1
                continue
            if ds.cache.contains(ds.version, ds.blocks.name(b)):
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
            run = merge_run(
                ds, job, j, consumed, read.prefetch_bytes, 2 * concurrency, min(cap_bytes, ramp), covered, self.sizes
            )
            if self.staging is not None:
                # may end up staged: keep staged bytes plus such fills in flight within budget
                if staged.bytes + self.inflight_bytes + sum(self.sizes[x] for x in run) > read.staging_bytes:
                    run = (b,)  # a merged run would not fit: this block alone, as before
                    if staged.bytes + self.inflight_bytes + self.sizes[b] > read.staging_bytes and (
                        staged or self.inflight
                    ):
                        waits = True  # until staged blocks are delivered (or fills end)
                        break
            covered.update(run)
            self._submit(run)
            j += 1
        job["next"] = j
        return waits

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
