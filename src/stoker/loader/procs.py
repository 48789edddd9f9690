"""The Loader's processes: how they are started, and what is said when they die or stall.

Start method: :func:`stoker._procs.pick_start_method` (``fork`` unless the training process runs
threads that a forked child cannot live with, then ``forkserver``). Health: a dead worker or
prefetcher is named with its pid and its exit code or signal; a worker killed by SIGBUS is
pointed at the shared-memory directory (a full ``/dev/shm`` is the usual cause); a stall names
what each worker was doing and why forking may have broken it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal

from .._procs import describe_exit, pick_start_method
from ..errors import WorkerError  # noqa: F401 - re-exported
from .prefetch import N_COUNTERS, prefetch_main
from .shm import SharedCell, free_bytes, shm_base
from .workers import worker_main

log = logging.getLogger(__name__)

__all__ = ["WorkerError", "ProcessesMixin"]

#: Modules the forkserver imports once, so that each child it forks starts with them loaded.
FORKSERVER_PRELOAD = ["stoker.loader.workers", "stoker.decode", "stoker.loader.prefetch"]


class ProcessesMixin:
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
        self.start_method, self._fork_hazards = method, hazards
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._ctx = ctx
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._current = ctx.Array("q", [-1] * self.num_workers, lock=False)
        self._stop = ctx.Event()
        for wid in range(self.num_workers):
            p = ctx.Process(target=worker_main, name=f"stoker-worker-{wid}",
                            args=(wid, self.dataset, self.cfg, self._tasks, self._results,
                                  SharedCell(self._current, wid), self._stop), daemon=True)
            p.start()
            self._workers.append(p)
        if self.dataset.cache is not None:
            self._pf_cmds = ctx.Queue()
            self._pf_pos = ctx.Value("q", 0, lock=False)
            self._pf_done = ctx.Value("q", 0, lock=False)
            self._pf_prev_done = ctx.Value("q", 0, lock=False)  # the previous plan's, while it drains
            self._pf_counters = ctx.Array("q", [0] * N_COUNTERS, lock=False)
            self._prefetcher = ctx.Process(target=prefetch_main, name="stoker-prefetch",
                                           args=(self.dataset, self._pf_cmds, self._pf_pos, self._pf_done,
                                                 self._pf_counters,
                                                 self.fetch_concurrency, self.prefetch_bytes, self.staging_bytes,
                                                 self._pf_prev_done),
                                           daemon=True)
            self._prefetcher.start()

    def _sample_key(self, wid: int) -> str | None:
        sid = int(self._current[wid])
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
        """WorkerError naming the first dead worker (pid, exit code or signal, the sample it was on)."""
        for wid, p in enumerate(self._workers):
            if p.exitcode is not None:
                key = self._sample_key(wid)
                raise WorkerError(self._died(f"worker {wid} (pid {p.pid})", p.exitcode)
                                  + (f" while reading/decoding sample {key!r}" if key else ""))
        self._check_prefetcher()

    def _check_prefetcher(self) -> None:
        """WorkerError if the prefetch process died (checked every 8th and every last batch of an
        epoch: the workers would go on reading sample by sample from the origin, and nothing
        would delete staged blocks)."""
        if self._prefetcher is not None and self._prefetcher.exitcode not in (None, 0):
            raise WorkerError(self._died(f"prefetch process (pid {self._prefetcher.pid})", self._prefetcher.exitcode))

    def _stall_error(self, seq: int, epoch: int) -> WorkerError:
        """The error for ``timeout_s`` without the batch due: what each worker was doing, and the
        fork hazards of the training process if the workers were forked anyway."""
        parts = []
        for wid, p in enumerate(self._workers):
            key = self._sample_key(wid)
            parts.append(f"worker {wid} (pid {p.pid}) " + (f"on sample {key!r}" if key else "idle"))
        msg = (f"no batch from the workers for {self.timeout_s:.0f} s (batch {seq} of epoch {epoch}): "
               + ", ".join(parts))
        if self.start_method == "fork" and getattr(self, "_fork_hazards", None):
            msg += "; the workers were forked from a process with " + "; ".join(self._fork_hazards)
        elif all(self._sample_key(w) is None for w in range(len(self._workers))):
            msg += " (no worker is reading or decoding: none took the task, or their replies are lost)"
        return WorkerError(msg)
