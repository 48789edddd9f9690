"""Block prefetch that follows the epoch's order, in its own process.

The order of an epoch is known in advance, so the blocks it needs are known too:
block b is first needed at position ``first_need[b]`` of the rank's sample plan.
The prefetcher fills blocks in first-need order (the order that makes the
longest prefix of the epoch servable soonest), with ``concurrency`` ranged GETs
in flight, staying at most ``ahead_bytes`` ahead of the position the loader has
dispatched to its workers. A block the cache would not admit ends prefetching for
the epoch (under the no-eviction policy nothing later would be admitted either);
the workers then read those samples on demand.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import numpy as np

log = logging.getLogger(__name__)

# Shared counters: [origin bytes, origin requests, blocks filled, blocks already cached, errors, refused]
N_COUNTERS = 6
#: Consecutive failed fills after which prefetching stops for the epoch.
MAX_FAILURES = 3


def block_schedule(ds, plan: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks needed by ``plan`` (sample ids in consumption order) in first-need order.

    Returns (blocks int64 (K,), first_need int64 (K,)): the distinct blocks and the
    plan position at which each is first needed, ascending.
    """
    blocks = ds.sample_block[plan]
    uniq, first = np.unique(blocks, return_index=True)
    order = np.argsort(first, kind="stable")
    return uniq[order].astype(np.int64), first[order].astype(np.int64)


def _fill(ds, b: int) -> str:
    if ds.cache.contains(ds.version, ds.block_name(b)):
        return "cached"
    return ds.fill_block(b, blocking=False, want_data=False)


def prefetch_main(ds, commands, position, counters, concurrency: int, ahead_bytes: int) -> None:
    """Prefetcher process loop. ``commands``: queue of (run, blocks, first_need) or None to stop;
    ``position``: shared int64, plan position dispatched by the loader; ``counters``: shared int64 array."""
    from .workers import fresh_copy
    ds = fresh_copy(ds)
    ds.origin.warm()
    pool = ThreadPoolExecutor(concurrency)
    lock = threading.Lock()
    job = None
    while True:
        try:
            cmd = commands.get(timeout=0.05) if job is None else commands.get_nowait()
        except queue.Empty:
            cmd = ...
        if cmd is None:
            break
        if cmd is not ...:
            _, blocks, first_need = cmd
            sizes = (ds.block_end[blocks] - ds.block_start[blocks]).astype(np.int64)
            cum = np.concatenate([[0], np.cumsum(sizes)])
            job = {"blocks": blocks, "first": first_need, "cum": cum, "next": 0, "inflight": set(),
                   "failures": 0}
        if job is None:
            continue
        inflight = job["inflight"]
        done = {f for f in inflight if f.done()}
        for f in done:
            inflight.discard(f)
            try:
                status = f.result()
            except Exception as exc:  # noqa: BLE001 - the reader will retry and report
                log.warning("prefetch failed: %s", exc)
                counters[4] += 1
                job["failures"] += 1
                if job["failures"] >= MAX_FAILURES:
                    # The origin is failing: stop adding load; the workers' own reads
                    # retry and report the error to the training process.
                    log.warning("prefetch stopped for this epoch after %d failures", job["failures"])
                    job["next"] = len(job["blocks"])
                continue
            job["failures"] = 0
            with lock:
                if status == "filled":
                    counters[2] += 1
                elif status == "cached":
                    counters[3] += 1
                elif status == "refused":
                    counters[5] += 1
                    job["next"] = len(job["blocks"])  # nothing later would be admitted either
            counters[0] = ds.origin.counters.bytes
            counters[1] = ds.origin.counters.requests
        j = job["next"]
        if j >= len(job["blocks"]):
            if not inflight:
                job = None
            continue
        pos = int(position.value)
        consumed = int(np.searchsorted(job["first"], pos, side="left"))
        progressed = False
        while j < len(job["blocks"]) and len(inflight) < concurrency:
            if job["cum"][j] - job["cum"][min(consumed, j)] > ahead_bytes:
                break
            inflight.add(pool.submit(_fill, ds, int(job["blocks"][j])))
            j += 1
            progressed = True
        job["next"] = j
        if inflight and not progressed:
            wait(inflight, timeout=0.02, return_when=FIRST_COMPLETED)
        elif not progressed:
            time.sleep(0.005)
    # Queued fills are dropped; fills in flight finish (each is one ranged GET). The loader
    # kills this process if that takes too long; a fill cut short leaves only a temporary
    # file, which the next open of the cache removes (DiskCache.recover).
    pool.shutdown(wait=True, cancel_futures=True)
