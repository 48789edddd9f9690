"""The Loader's processes: how they are started, and what is said when they die or stall.

Start method: :func:`stoker._procs.pick_start_method` (``fork`` unless the training process runs
threads that a forked child cannot live with, then ``forkserver``). Health: a dead worker or
prefetcher is named with its pid and its exit code or signal; a worker killed by SIGBUS is
pointed at the shared-memory directory (a full ``/dev/shm`` is the usual cause); a stall names
what each worker was doing and why forking may have broken it. A dead worker or prefetcher is
replaced, within a bound per epoch (:mod:`stoker.loader.respawn`); replacements use the start
method chosen at start.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from collections import deque

from .._procs import describe_exit, pick_start_method
from ..errors import WorkerError  # noqa: F401 - re-exported
from .prefetch import N_COUNTERS
from .respawn import RespawnMixin
from .shm import free_bytes, shm_base

log = logging.getLogger(__name__)

__all__ = ["WorkerError", "ProcessesMixin"]

#: Modules the forkserver imports once, so that each child it forks starts with them loaded.
FORKSERVER_PRELOAD = ["stoker.loader.workers", "stoker.decode", "stoker.loader.prefetch"]
#: Most seconds the start waits for the processes to finish their own start (spawn or forkserver
#: children import stoker and torch: seconds on a loaded machine).
READY_TIMEOUT_S = 30.0


class ProcessesMixin(RespawnMixin):
    """Start, watch and describe the worker and prefetch processes of a loader's started pipeline
    (:class:`stoker.loader._run.Run`, which holds the attributes used here)."""

    def _start_processes(self) -> None:
        """Choose the start method (again: threads may have appeared since construction) and
        start ``num_workers`` workers and, with a node cache, the prefetcher.

        Raises:
            ForkUnsafeError: ``start_method="fork"`` in a process where fork is unsafe.
        """
        method, hazards = pick_start_method(self._start_method_asked, mp.get_all_start_methods())
        if hazards and method != "fork":
            log.warning("starting stoker's worker processes with %r instead of fork: %s. Each worker imports "
                        "the main script again: keep the training code under `if __name__ == \"__main__\":`",
                        method, "; ".join(hazards))
        self.cfg.check_picklable(method)  # TypeError naming the user's function that does not pickle
        self.start_method, self._fork_hazards = method, hazards
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._ctx = ctx
        self._current = ctx.Array("q", [-1] * self.num_workers, lock=False)
        self._stop = ctx.Event()
        self._task_qs, self._result_qs, self._wids, self._assigned = [], [], [], []
        self._replies = deque()  # replies received, not yet taken by the epoch loop
        self._next_wid = 0  # worker ids: 0..num_workers-1, then one new id per replacement
        self._ready = ctx.Value("q", 0)  # processes that finished their own start (see _wait_ready)
        self._new_epoch_restarts()
        for slot in range(self.num_workers):
            self._spawn_worker(slot)
        if self.dataset.cache is not None:
            self._pf_pos = ctx.Value("q", 0, lock=False)
            self._pf_done = ctx.Value("q", 0, lock=False)
            self._pf_prev_done = ctx.Value("q", 0, lock=False)  # the previous plan's, while it drains
            self._pf_counters = ctx.Array("q", [0] * N_COUNTERS, lock=False)
            self._spawn_prefetcher(adopt=False)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every worker and the prefetcher has finished its own start (the object
        store client built, the decoder set up), so that this start is counted in the pipeline's
        one-time start (``pipeline_start_s``) and the first epoch's plan reaches a prefetcher that
        fetches at once, instead of workers racing it for the first blocks. Returns early when a
        process has died (the epoch loop replaces or reports it) and after ``timeout_s`` seconds
        (then the first epoch simply starts with processes still starting: never a hang)."""
        procs = self._workers + ([self._prefetcher] if self._prefetcher is not None else [])
        deadline = time.monotonic() + timeout_s
        while self._ready.value < len(procs) and time.monotonic() < deadline:
            if not all(p.is_alive() for p in procs):
                return
            time.sleep(0.002)

    def _sample_key(self, slot: int) -> str | None:
        """Key of the sample the worker in ``slot`` is on (``_current`` is indexed by slot, not by
        worker id: a replacement worker gets a new id in the same slot), or None when idle."""
        sid = int(self._current[slot])
        return self.dataset.key(sid) if 0 <= sid < len(self.dataset) else None

    def _died(self, what: str, exitcode: int) -> str:
        """``what`` died with ``exitcode``, in words, with the usual cause of a bus error."""
        msg = f"{what} died with {describe_exit(exitcode)}"
        if exitcode == -signal.SIGBUS:
            base = shm_base()
            msg += (f" (a bus error in stoker's processes usually means shared memory ran out: {base} has "
                    f"{free_bytes(base)} bytes free)")
        return msg

    def _check_workers(self) -> None:
        """Replace every dead worker (:meth:`RespawnMixin._replace_worker`: WorkerError naming it,
        its pid, exit code or signal and the sample it was on once its slot's restarts are spent);
        then the same for the prefetcher."""
        for slot, p in enumerate(self._workers):
            if p.exitcode is not None:
                self._replace_worker(slot)
        self._check_prefetcher()

    def _check_prefetcher(self) -> None:
        """Replace the prefetch process if it died (checked every 8th and every last batch of an
        epoch, and whenever its sentinel wakes the wait for replies): the workers would go on
        reading sample by sample from the origin, and nothing would delete staged blocks. Past
        the bound the epoch goes on without it (:meth:`RespawnMixin._restart_prefetcher`)."""
        if self._prefetcher is not None and self._prefetcher.exitcode not in (None, 0):
            self._restart_prefetcher()

    def _stall_error(self, seq: int, epoch: int) -> WorkerError:
        """The error for ``timeout_s`` without the batch due: what each worker was doing, and the
        fork hazards of the training process if the workers were forked anyway."""
        parts = []
        for slot, p in enumerate(self._workers):
            key = self._sample_key(slot)
            parts.append(f"worker {self._wids[slot]} (pid {p.pid}) " + (f"on sample {key!r}" if key else "idle"))
        msg = (f"no batch from the workers for {self.timeout_s:.0f} s (batch {seq} of epoch {epoch}): "
               + ", ".join(parts))
        if self.start_method == "fork" and getattr(self, "_fork_hazards", None):
            msg += "; the workers were forked from a process with " + "; ".join(self._fork_hazards)
        elif all(self._sample_key(w) is None for w in range(len(self._workers))):
            msg += " (no worker is reading or decoding: none took the task, or their replies are lost)"
        return WorkerError(msg)
