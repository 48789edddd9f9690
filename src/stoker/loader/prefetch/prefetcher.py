"""The prefetch process of one started pipeline (only with a node cache): its handle, the shared
positions it reads, its counters, and its replacement.

The process itself is :func:`stoker.loader.prefetch.process.prefetch_main`. The training process tells it
plans (``(run, blocks, first_need, last_need[, draining])``, :func:`stoker.loader.prefetch.process.block_schedule`)
through a command queue and the consumer's progress through plain shared integers
(:attr:`Prefetcher.position`, :attr:`~Prefetcher.done`, :attr:`~Prefetcher.prev_done`: no lock a
dead process could hold); it reports through a shared array of counters (:mod:`stoker.loader.prefetch.inflight`).

A dead prefetcher is replaced at most :data:`MAX_PREFETCHER_RESTARTS` times per epoch (then the
epoch goes on without read-ahead, after one warning). The replacement reuses the shared positions and
counters, gets a new command queue and the current plan again, and adopts the blocks its
predecessor staged (``prefetch_main(..., adopt=True)``): staged blocks are whole files (temporary
file + rename) and fetch locks are ``flock`` locks that the kernel releases when their holder
dies, so nothing the dead one left blocks the new one.

A prefetch process that exits before its own start is done is not replaced
(:mod:`stoker.loader.workers.launch`): when it ran the user's main script again
:class:`~stoker.errors.WorkerStartError` names that, else the epoch goes on without read-ahead
after one warning naming its exit.
"""

from __future__ import annotations

import contextlib
import logging
import time

from ..._procs import EXIT_UNGUARDED_MAIN
from ...errors import WorkerStartError
from ..workers import launch
from ..workers.launch import abandon, died, stop_processes
from . import inflight as infl
from .process import PrefetchShared, prefetch_main

log = logging.getLogger(__name__)

__all__ = ["MAX_PREFETCHER_RESTARTS", "Prefetcher"]

#: Replacements of the prefetcher per epoch; past them the epoch continues without prefetch.
MAX_PREFETCHER_RESTARTS = 3


class Prefetcher:
    """Handle of the prefetch process (module docstring); starts it.

    Args:
        ctx: the multiprocessing context (:func:`stoker.loader.workers.launch.start_context`).
        dataset: the :class:`~stoker.store.dataset.Dataset` (with a node cache).
        read: the loader's :class:`~stoker.loader.options.ReadOptions`, handed whole to the process
            (``prefetch_bytes``, ``staging_bytes``, ``fetch_concurrency``).
        ready: a shared int each process increments once set up.
    """

    def __init__(self, ctx, dataset, read, *, ready, shipped=None):
        self._ctx, self._dataset, self._read, self._ready = ctx, dataset, read, ready
        # spawn/forkserver: the dataset as pickled once, its arrays in a shared file (the workers' too)
        self._dataset_arg = dataset if shipped is None else shipped
        self._shared = PrefetchShared.create(ctx)  # positions, counters, started: kept over a replacement
        self._counters = self._shared.counters
        self._restarts = 0
        self._off = False  # died more often than allowed this epoch, or could not start
        self._start_failed = False  # exited before its own start was done: never started again
        self._last_cmd = None  # the last plan sent, for a replacement
        self.restarted_at = 0.0  #: ``time.monotonic()`` of the last replacement (0: none)
        self._spawn(adopt=False)

    # -- the consumer's progress (samples of the plan) ----------------------
    @property
    def position(self) -> int:
        """Samples of the current plan dispatched to the workers."""
        return self._shared.position.value

    @position.setter
    def position(self, n: int) -> None:
        self._shared.position.value = n

    @property
    def done(self) -> int:
        """Samples of the current plan delivered to the consumer."""
        return self._shared.done.value

    @done.setter
    def done(self, n: int) -> None:
        self._shared.done.value = n

    @property
    def prev_done(self) -> int:
        """Samples of the previous plan delivered, while it drains."""
        return self._shared.prev_done.value

    @prev_done.setter
    def prev_done(self, n: int) -> None:
        self._shared.prev_done.value = n

    # -- inspection ---------------------------------------------------------
    @property
    def process(self):
        """The prefetch process (``multiprocessing.Process``)."""
        return self._proc

    @property
    def restarts(self) -> int:
        """Prefetchers replaced this epoch."""
        return self._restarts

    def totals(self) -> dict:
        """Its clocks and origin retries (for ``Run.totals``)."""
        pc = list(self._counters)
        return {
            "prefetch_depth_sum": pc[6],
            "prefetch_depth_n": pc[7],
            "origin_busy_us": pc[infl.BUSY_US],
            "origin_request_us": pc[infl.REQUEST_US],
            "origin_retries": pc[infl.ORIGIN_RETRIES],
        }

    def ledger(self, run: int) -> dict:
        """Its origin traffic charged to plan ``run``, with its in-flight target, latency and
        bandwidth estimates now (:func:`stoker.loader.prefetch.inflight.ledger_row`)."""
        out = infl.ledger_row(self._counters, run)
        out.update(
            inflight_target=int(self._counters[infl.TARGET]),
            origin_latency_us=int(self._counters[infl.LATENCY_US]),
            origin_bandwidth_Bps=int(self._counters[infl.BANDWIDTH_BPS]),
        )
        return out

    def plan_done(self, run: int) -> bool:
        """Whether it has fetched (or given up) every block of plan ``run`` (True when it is off)."""
        return self._off or int(self._counters[infl.PLAN_DONE]) >= run

    def sentinel(self):
        """The process's sentinel to wait on, or None when it is off."""
        return None if self._off else self._proc.sentinel

    # -- talking ------------------------------------------------------------
    def send(self, cmd) -> None:
        """Send a plan ``(run, blocks, first_need, last_need[, draining])``; kept, so that a
        replacement gets it too."""
        self._last_cmd = cmd
        if not self._off:
            self._cmds.put(cmd)

    def new_epoch(self) -> None:
        """Start counting restarts for a new epoch (the bound is per epoch)."""
        self._restarts = 0

    def check(self) -> None:
        """Replace the process if it died (within :data:`MAX_PREFETCHER_RESTARTS` this epoch,
        else go on without one, warned once); one that exited before its own start was done is
        not replaced (module docstring).

        Raises:
            WorkerStartError: it died starting because it ran the user's main script again.
        """
        p = self._proc
        if p.exitcode in (None, 0) or self._start_failed:
            return
        if not self._shared.started.value and p.exitcode > 0:  # exited while starting (killed then: replaced)
            what = launch.start_failure(f"the prefetch process (pid {p.pid})", p.exitcode, self._ctx.get_start_method())
            if p.exitcode == EXIT_UNGUARDED_MAIN:
                raise WorkerStartError(what)
            if not self._off:
                abandon(self._cmds)
            self._off = self._start_failed = True
            log.warning("%s; going on without prefetch (the workers read the blocks themselves)", what)
            return
        what = died(f"prefetch process (pid {p.pid})", p.exitcode)
        if self._restarts >= MAX_PREFETCHER_RESTARTS:
            if not self._off:
                self._off = True
                abandon(self._cmds)
                log.warning(
                    "%s, %d times this epoch: going on without prefetch (the workers read the blocks themselves)",
                    what,
                    self._restarts + 1,
                )
            return
        self._restarts += 1
        self.restarted_at = time.monotonic()
        log.warning("%s; starting a new prefetch process", what)
        if not self._off:
            abandon(self._cmds)
        self._off = False
        self._spawn(adopt=True)
        if self._last_cmd is not None:
            self._cmds.put(self._last_cmd)

    # -- stopping -----------------------------------------------------------
    def signal_stop(self) -> None:
        """Tell the process to stop."""
        if self._off:
            return
        with contextlib.suppress(OSError, ValueError):
            self._cmds.put(None)

    def join(self, deadline: float) -> None:
        """Wait for the process until ``deadline`` (``time.monotonic()``), then kill it; one
        still starting is killed at once."""
        if not self._shared.started.value and self._proc.is_alive():
            self._proc.kill()
        stop_processes([self._proc], deadline)

    def _spawn(self, adopt: bool) -> None:
        """Start the process with a new command queue (``adopt``: take over the blocks a dead
        predecessor staged)."""
        self._cmds = self._ctx.Queue()
        self._shared.started.value = 0
        self._proc = self._ctx.Process(
            target=prefetch_main,
            name="stoker-prefetch",
            args=(self._dataset_arg, self._cmds, self._shared, self._read, adopt, self._ready),
            daemon=True,
        )
        launch.start(self._proc)
