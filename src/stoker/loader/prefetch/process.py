"""Block prefetch that follows the epoch's order, in its own process.

The order of an epoch is known in advance, so the blocks it needs are known too:
block b is first needed at position ``first_need[b]`` of the rank's sample plan.
The prefetcher fills blocks in first-need order (the order that makes the
longest prefix of the epoch servable soonest), with ``read.fetch_concurrency`` ranged GETs or more
in flight, staying at most ``read.prefetch_bytes`` ahead of the position the loader has
dispatched to its workers. A block whose neighbours in its shard are among the next blocks
to fetch is fetched with them in one merged ranged GET (:mod:`stoker.store.runs`), capped at the
measured bandwidth-delay product (until it is measured, that of an assumed 20 ms, 200 MB/s origin:
merged GETs start with the first fills). A block the cache does not admit is fetched into the
loader's staging area instead (bounded by ``read.staging_bytes``); without a staging area such a
block ends prefetching for the epoch (under the no-eviction policy nothing later would be
admitted either) and the workers read those samples on demand.

Staged blocks and the rules of this process (each block once per plan, staging never serving a
later epoch but for the next epoch's first batches, one probe while the origin throttles:
:class:`stoker.storage.retry.SharedBackoff`) are listed in this folder's README.md; a block a
worker staged first is taken over (:meth:`stoker.store.blocks.BlockReader.block_for_read`), and one
still staged for this plan's last batches that the next plan reaches is used again (the
ledger's ``staged_reused``).

The process's main thread sleeps on one queue: commands (posted by a thread that blocks on the
command queue, and that posts a stop when the parent is gone) and fill outcomes (posted by the fill
threads, one thread per fill in flight at most). The loop looks at the consumer's progress on a
timer only while something waits on it: ``prefetch_bytes`` or the staging budget reached
(:data:`CONSUMER_POLL_S`), staged blocks waiting for their last use to be delivered
(:data:`STAGED_POLL_S`); besides, a busy block's retry time and the origin's back-off.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._procs import exit_with_parent, parent_gone, parent_identity
from . import inflight as infl
from .fills import FillThreads
from .loop import CMD, PrefetchLoop

log = logging.getLogger(__name__)

# Shared counters: [origin bytes, origin requests, blocks filled, blocks already cached, errors,
#                   blocks staged (not admitted to the cache), prefetch depth samples (bytes
#                   completed ahead of the consumer, summed), number of depth samples], then the
#                   requests in flight, the busy clock, the origin retries and the per-plan
#                   ledger (:mod:`.inflight`)
N_COUNTERS = infl.N_SHARED
#: seconds between looks at whether the training process is gone (the kernel kills this process
#: with its OS parent where it has ``PR_SET_PDEATHSIG``; under forkserver that parent is the fork
#: server, and these looks are what end it)
PARENT_POLL_S = 0.25


def block_schedule(ds, plan: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks needed by ``plan`` (sample ids in consumption order) in first-need order.

    Returns (blocks int64 (K,), first_need int64 (K,), last_need int64 (K,)): the distinct
    blocks, ascending by the plan position at which each is first needed, and the
    position of each block's last use.
    """
    blocks = ds.blocks.sample_block[plan]
    uniq, first = np.unique(blocks, return_index=True)
    _, rev = np.unique(blocks[::-1], return_index=True)
    last = len(blocks) - 1 - rev
    order = np.argsort(first, kind="stable")
    return uniq[order].astype(np.int64), first[order].astype(np.int64), last[order].astype(np.int64)


def read_commands(commands, events: queue.SimpleQueue, parent: tuple[int, int | None]) -> None:
    """Thread: blocks on the command queue and posts each command to ``events`` as ``(CMD, cmd)``.
    Posts ``(CMD, None)`` (stop) after a stop command, when the training process is gone
    (``parent``: :func:`stoker._procs.parent_identity`, looked at every :data:`PARENT_POLL_S`
    while no command comes; ``PR_SET_PDEATHSIG`` kills the process at once where the kernel has
    it and the training process is its OS parent, as with fork and spawn) or when the queue breaks."""
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
            events.put((CMD, cmd))
    except (EOFError, OSError, ValueError) as exc:  # the queue is closed or broken: nothing more will come
        log.debug("prefetch command queue: %s", exc)
    finally:
        events.put((CMD, None))


@dataclass(frozen=True)
class PrefetchShared:
    """What the training process and its prefetch process share, kept over a replacement of the
    process: plain shared integers (no lock a dead process could hold). ``position`` / ``done``:
    samples of the current plan dispatched to the workers / delivered; ``prev_done``: of the
    previous plan delivered, while it drains; ``counters``: int64 array of :data:`N_COUNTERS`
    (:mod:`.inflight`); ``started``: 1 once the process is set up (one that dies before is not
    replaced, :mod:`stoker.loader.workers.launch`)."""

    position: Any
    done: Any
    prev_done: Any
    counters: Any
    started: Any

    @classmethod
    def create(cls, ctx) -> PrefetchShared:
        """New shared values, all 0, from the multiprocessing context ``ctx``."""
        p, d, pd = (ctx.Value("q", 0, lock=False) for _ in range(3))
        return cls(p, d, pd, ctx.Array("q", [0] * N_COUNTERS, lock=False), ctx.Value("b", 0, lock=False))


def prefetch_main(ds, commands, shared: PrefetchShared, read, adopt: bool = False, ready=None) -> None:
    """The prefetch process (the module docstring): serve the plans that come on ``commands``
    (``(run, blocks, first_need, last_need[, draining])``, :func:`block_schedule`; ``draining``: the
    previous plan is still being delivered, its blocks are charged to its ledger row; None: stop)
    with the loader's :class:`~stoker.loader.options.ReadOptions` ``read``, until a stop or the
    parent's exit. ``shared``: the :class:`PrefetchShared` values. ``adopt``: this process replaces
    one that died; the blocks of its first plan already staged (whole files, written by rename)
    are taken over. ``ready``: a shared counter (``multiprocessing.Value``) incremented once the
    origin client is built. SIGINT is ignored (:mod:`stoker.loader.workers.interrupts`)."""
    from ..workers.interrupts import ignore_in_child
    from ..workers.sharedpickle import SharedPickle
    from ..workers.worker import fresh_copy

    ignore_in_child()
    parent = parent_identity()  # the training process (under forkserver not the OS parent)
    exit_with_parent()
    if isinstance(ds, SharedPickle):
        ds = ds.load()
    ds = fresh_copy(ds)
    if not ds.origin.use_native():  # this process never forks: obstore's runtime is safe here
        ds.origin.warm()  # s3fs: build the client now (~0.25 s), not at the first read
    events: queue.SimpleQueue = queue.SimpleQueue()
    pool = FillThreads(events)
    threading.Thread(
        target=read_commands, args=(commands, events, parent), name="stoker-prefetch-commands", daemon=True
    ).start()
    shared.started.value = 1
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    try:
        _serve(PrefetchLoop(ds, shared, pool, read, adopt), events)
    finally:
        # Queued fills are dropped; fills waiting to retry give up at once (cancel); fills in flight
        # finish (each is one ranged GET, bounded by the request timeout). The loader kills this
        # process if that takes too long; a fill cut short leaves only a temporary file, which the
        # next open of the cache removes (DiskCache.recover).
        ds.origin.backoff.cancel()
        pool.shutdown()
        if ds.reader.staging is not None:
            ds.reader.staging.clear()


def _serve(loop: PrefetchLoop, events: queue.SimpleQueue) -> None:
    """Wake ``loop`` with what is on ``events`` each time (waiting at most its timeout) until it
    says stop: after a stop command, or the stop :func:`read_commands` posts once the training
    process is gone (that thread alone watches it, every :data:`PARENT_POLL_S`; the loop's own
    timers, down to 10 ms while it waits on the consumer, do not look again)."""
    timeout = None
    while True:
        try:
            batch = [events.get(timeout=timeout)]
        except queue.Empty:
            batch = []
        while not events.empty():  # one consumer: what is there now is taken without waiting
            batch.append(events.get())
        if not loop.wake(batch):
            return
        timeout = loop.timeout
