"""Block prefetch that follows the epoch's order, in its own process.

The order of an epoch is known in advance, so the blocks it needs are known too:
block b is first needed at position ``first_need[b]`` of the rank's sample plan.
The prefetcher fills blocks in first-need order (the order that makes the
longest prefix of the epoch servable soonest), with ``concurrency`` ranged GETs
in flight, staying at most ``ahead_bytes`` ahead of the position the loader has
dispatched to its workers. A block whose neighbours in its shard are among the next blocks
to fetch is fetched with them in one merged ranged GET (:mod:`stoker.store.runs`), capped at the
measured bandwidth-delay product. A block the cache does not admit is fetched into the
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
"""
from __future__ import annotations

import logging
import os
import queue
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

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


def prefetch_main(ds, commands, position, done, counters, concurrency: int, ahead_bytes: int,
                  staging_bytes: int = 64 << 20, prev_done=None, adopt: bool = False, ready=None) -> None:
    """Prefetcher process loop. ``commands``: queue of (run, blocks, first_need, last_need[,
    draining]) or None to stop (``draining``: the previous plan is still being delivered, so the
    blocks it needs are charged to its ledger row, :mod:`.inflight`); ``position``: shared int64, plan
    position dispatched to the workers;
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
    ``ready``: a shared counter (``multiprocessing.Value``) incremented once the origin client is built."""
    from .._procs import exit_with_parent, parent_gone
    from .workers import fresh_copy
    parent = os.getppid()
    exit_with_parent()
    ds = fresh_copy(ds)
    if not ds.origin.use_native():  # this process never forks: obstore's runtime is safe here
        ds.origin.warm()  # s3fs: build the client now (~0.25 s), not at the first read
    target = infl.InflightTarget(concurrency)
    clock = infl.BusyClock(counters)
    pool = ThreadPoolExecutor(target.ceiling)
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    plan_run, prev_run = -1, None  # run ids of the current and the draining plan (ledger rows)
    prev_all: dict[int, int] = {}  # every block of the draining plan -> its last use there
    seen_bytes, seen_requests = ds.origin.counters.bytes, ds.origin.counters.requests
    job = None
    staged: dict[int, int] = {}  # staged block -> plan position of its last use
    prev: dict[int, int] = {}    # staged blocks of the previous plan -> their last use in it
    cur_last: dict[int, int] = {}  # block -> last use in the current plan (kept after it is done)
    carried: set[int] = set()    # blocks still staged for the draining plan when the current one came
    sizes_of = (ds.block_end - ds.block_start).astype(np.int64)
    base_bytes, base_requests = int(counters[0]), int(counters[1])  # a dead predecessor's
    base_retries = int(counters[infl.ORIGIN_RETRIES])
    while True:
        try:
            cmd = commands.get(timeout=0.05) if job is None else commands.get_nowait()
        except queue.Empty:
            cmd = ...
        if cmd is None or (cmd is ... and parent_gone(parent)):
            break
        if cmd is not ...:
            run, blocks, first_need, last_need = cmd[:4]
            draining = len(cmd) > 4 and bool(cmd[4])
            prev_run, prev_all = (plan_run, cur_last) if draining and plan_run != run else (None, {})
            plan_run = int(run)
            infl.open_row(counters, plan_run)
            new_last = dict(zip(blocks.tolist(), last_need.tolist(), strict=True))
            if draining:
                # Blocks staged for the previous plan may still be read by its last batches; they go
                # once their last use there is delivered (prev_done), or at the latest once the new
                # plan's first batch is delivered (done > 0). One that the new plan reaches while it
                # is still there is used again (``staged_reused``), not fetched a second time.
                prev = {b: cur_last[b] for b in staged if b in cur_last}
                for b in staged:
                    staged[b] = 0
                carried = set(staged)
            elif ds.reader.staging is not None:  # no staged block outlives the plan it was fetched for
                _end_plan(ds, staged, new_last)
                prev, carried = {}, set()
            cum = np.concatenate([[0], np.cumsum(sizes_of[blocks])])
            # fills still in flight for the previous plan stay tracked (their staged blocks too)
            job = {"blocks": blocks, "first": first_need, "cum": cum, "next": 0, "retry": [], "tries": {},
                   "inflight": job["inflight"] if job else {},
                   "failures": 0, "last": new_last}
            cur_last = job["last"]
            if adopt and ds.reader.staging is not None:
                adopt = False
                for name in ds.reader.staging.names(ds.version):
                    b = ds.block_of_name(name)
                    if b in cur_last:
                        staged[b] = cur_last[b]
        # staged blocks go once their last use is delivered, also after every block is fetched
        inflight = job["inflight"] if job is not None else {}
        flying = {b for r in inflight.values() for b in r}  # a fill may be finding them staged
        _drop_staged(ds, staged, staged, int(done.value), keep=flying)
        if prev_done is not None and prev:
            _drop_staged(ds, staged, prev, int(prev_done.value), keep=flying)
            prev = {b: last for b, last in prev.items() if b in staged}
        if job is None:
            continue
        finished = [f for f in inflight if f.done()]
        fetched: list[tuple[int, str]] = []  # (block, "prefetch_fills" / "prefetch_staged")
        results: list[tuple[int, object]] = []  # (block, status or the exception of its fill)
        for f in finished:
            run_blocks = inflight.pop(f)
            try:
                results.extend(f.result().items())
            except Exception as exc:  # noqa: BLE001 - the reader will retry and report
                results.extend((b, exc) for b in run_blocks)
        for b, status in results:
            if isinstance(status, BaseException):
                log.warning("prefetch failed: %s", status)
                counters[4] += 1
                job["failures"] += 1
                if job["failures"] >= MAX_FAILURES:
                    # The origin is failing: stop adding load; the workers' own reads
                    # retry and report the error to the training process.
                    log.warning("prefetch stopped for this epoch after %d failures", job["failures"])
                    job["next"] = len(job["blocks"])
                continue
            job["failures"] = 0
            if status in ("filled", "staged"):
                fetched.append((b, "prefetch_fills" if status == "filled" else "prefetch_staged"))
            if status == "filled":
                counters[2] += 1
            elif status == "cached":
                counters[3] += 1
            elif status == "refused":  # no staging area: nothing later would be admitted either
                job["next"] = len(job["blocks"])
            elif status == "staged":
                counters[5] += 1
                staged[b] = job["last"].get(b, 0)  # 0: a block of the previous plan
                prev.pop(b, None)  # staged for the new plan: kept for its last use there
            elif status == "in_staging":  # a worker's fetch, or a block the draining plan still holds
                if b in carried:
                    carried.discard(b)
                    infl.charge(counters, plan_run, "staged_reused", 1)
                staged[b] = job["last"].get(b, 0)  # taken over: counted in staging, deleted after its last use
                prev.pop(b, None)
            elif status == "busy" and b in job["last"] and job["last"][b] >= int(done.value):
                # another process holds its fetch lock (a worker that got there first, or another
                # job filling it): try again, or the block would never be staged for this plan
                k = job["tries"][b] = job["tries"].get(b, 0) + 1
                if k <= MAX_BUSY_RETRIES:
                    job["retry"].append((time.monotonic() + min(BUSY_BACKOFF_MAX_S, BUSY_BACKOFF_S * 2 ** k), b))
        counters[0] = base_bytes + ds.origin.counters.bytes
        counters[1] = base_requests + ds.origin.counters.requests
        counters[infl.ORIGIN_RETRIES] = base_retries + ds.origin.counters.retries
        if finished:
            seen_bytes, seen_requests = _charge(ds, counters, fetched, sizes_of, seen_bytes, seen_requests,
                                                plan_run, prev_run, prev_all, prev_done)
            counters[infl.TARGET] = target.target
            if target.bandwidth_Bps:
                counters[infl.LATENCY_US] = int(target.latency_s * 1e6)
                counters[infl.BANDWIDTH_BPS] = int(target.bandwidth_Bps)
        concurrency = target.target
        # the origin throttles: start nothing new while the fills in flight wait for its back-off
        # (with none in flight, the next fill is the one that probes the origin)
        throttled = bool(inflight) and ds.origin.backoff.throttled
        if job["retry"] and len(inflight) < concurrency and not throttled:
            now = time.monotonic()
            due = [r for r in job["retry"] if r[0] <= now][: concurrency - len(inflight)]
            for r in due:
                job["retry"].remove(r)
                inflight[pool.submit(_timed_fill, ds, (r[1],), clock, target)] = (r[1],)
        j = job["next"]
        pos = int(position.value)
        consumed = int(np.searchsorted(job["first"], pos, side="left"))
        if pos != job.get("depth_pos"):
            # prefetch depth: bytes of blocks issued and finished ahead of the consumer
            pending = sum(sizes_of[f_b] for r in inflight.values() for f_b in r)
            counters[6] += max(0, int(job["cum"][j] - job["cum"][min(consumed, j)]) - int(pending))
            counters[7] += 1
            job["depth_pos"] = pos
        if j >= len(job["blocks"]):
            if not inflight and not job["retry"]:
                counters[infl.PLAN_DONE] = plan_run  # the loader may start the next plan's batches
                job = None
            elif not inflight:
                time.sleep(0.005)  # only retries left, waiting for their time
            continue
        progressed = False
        staged_now = sum(sizes_of[b] for b in staged) if ds.reader.staging is not None else 0
        cap_bytes = merge_cap_bytes(target.latency_s, target.bandwidth_Bps, int(ds.block_bytes))
        covered = job.setdefault("covered", set())  # blocks fetched ahead of their turn by a merged GET
        while j < len(job["blocks"]) and len(inflight) < concurrency and not throttled:
            if job["cum"][j] - job["cum"][min(consumed, j)] > ahead_bytes:
                break
            b = int(job["blocks"][j])
            if b in covered:
                j += 1
                continue
            run = _merge(ds, job, j, consumed, ahead_bytes, 2 * concurrency, cap_bytes, covered)
            if ds.reader.staging is not None and not ds.cache.contains(ds.version, ds.block_name(b)):
                # may end up staged: keep staged bytes plus such fills in flight within budget
                pending_bytes = sum(sizes_of[f_b] for r in inflight.values() for f_b in r)
                if staged_now + pending_bytes + int(sizes_of[list(run)].sum()) > staging_bytes:
                    run = (b,)  # a merged run would not fit: this block alone, as before
                    if staged_now + pending_bytes + sizes_of[b] > staging_bytes and (staged or inflight):
                        break
            covered.update(run)
            inflight[pool.submit(_timed_fill, ds, run, clock, target)] = run
            j += 1
            progressed = True
        job["next"] = j
        if inflight and not progressed:
            wait(inflight, timeout=0.005 if job["retry"] else 0.02, return_when=FIRST_COMPLETED)
            clock.flush()
        elif not progressed:
            time.sleep(0.005)
    # Queued fills are dropped; fills waiting to retry give up at once (cancel); fills in flight
    # finish (each is one ranged GET, bounded by the request timeout). The loader kills this
    # process if that takes too long; a fill cut short leaves only a temporary file, which the
    # next open of the cache removes (DiskCache.recover).
    ds.origin.backoff.cancel()
    pool.shutdown(wait=True, cancel_futures=True)
    if ds.reader.staging is not None:
        ds.reader.staging.clear()


def _merge(ds, job: dict, j: int, consumed: int, ahead_bytes: int, lookahead: int, cap_bytes: int,
           covered: set) -> tuple:
    """The run of adjacent blocks to fetch with block ``job["blocks"][j]``: its neighbours in the
    shard (:func:`stoker.store.runs.adjacent_run`, at most ``cap_bytes`` together) among the next
    ``lookahead`` blocks of the schedule that lie within ``ahead_bytes`` of the consumer and are
    neither issued yet nor cached. A tuple of ascending block ids."""
    b = int(job["blocks"][j])
    if cap_bytes <= int(ds.block_end[b] - ds.block_start[b]):
        return (b,)
    base = job["cum"][min(consumed, j)]
    stop = int(np.searchsorted(job["cum"], base + ahead_bytes, side="right"))  # positions < stop qualify
    window = set(job["blocks"][j + 1:max(j + 1, min(j + 1 + lookahead, stop))].tolist())
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
