"""Per-worker channels and the replacement of a loader's dead processes.

Each decode worker has its own task queue and its own result queue, and the training process
records which batches it handed to which worker (``_assigned[slot]``: ``(run, seq, offset) -> task``;
the offset tells the parts of a split batch apart, :mod:`.split`).
That is what makes a death survivable:

- A shared task queue cannot be used: a worker waiting in ``get()`` holds the queue's read lock,
  and one killed there would block every other worker for ever. With one queue per worker, a
  dead worker's queues are abandoned whole and its replacement gets new ones.
- A batch is done when its reply has been *received*: a worker writes the slot first and
  replies after, so a batch whose reply never arrived may be half-written and is never
  delivered. The batches a dead worker took but did not answer are sent again, with the same
  run, sequence number and slot, to the live workers (the replacement included): the new worker
  writes the whole slot again. Decoding is a pure function of (seed, epoch, sample id)
  (:func:`stoker.order.sample_seed`), so the batch is the one it would have been.
- The queue of a dead worker is never read again, so a reply it sent but that was not received
  yet is dropped with it (its batch is decoded again): each batch is delivered once, in plan order
  (the epoch loop in ``_run.py`` reorders replies by sequence number as before).

Restarts are bounded per epoch: :data:`MAX_WORKER_RESTARTS` per worker slot, then the clean
:class:`~stoker.errors.WorkerError` naming the worker, its exit code or signal and the sample it
was on; :data:`MAX_PREFETCHER_RESTARTS` for the prefetcher, then the epoch goes on without
read-ahead (the workers read blocks themselves) after one warning. The counts of an epoch are
``EpochStats.worker_restarts`` and ``EpochStats.prefetcher_restarts``.

The prefetcher's replacement reuses the shared positions and counters (plain shared integers:
no lock a dead process could hold), gets a new command queue and the current plan again, and
adopts the blocks its predecessor staged (``prefetch_main(..., adopt=True)``): staged blocks are
whole files (temporary file + rename) and fetch locks are ``flock`` locks that the kernel
releases when their holder dies, so nothing the dead one left blocks the new one.

Limit: a reply is read once its queue is readable; a reply larger than the pipe's atomic write
(4 KiB; replies carry no pixels, except the sample bytes when decoding on the device, and a
user-collated batch's non-array leaves, or a batch with no array, pickled) cut short by
a kill in the middle of writing it leaves a partial message that the reader would wait on.
"""
from __future__ import annotations

import logging
import queue
import time
from multiprocessing.connection import wait as mp_wait

from ..errors import WorkerError
from .prefetch import prefetch_main
from .shm import SharedCell
from .workers import worker_main

log = logging.getLogger(__name__)

__all__ = ["MAX_WORKER_RESTARTS", "MAX_PREFETCHER_RESTARTS", "RespawnMixin"]

#: Replacements of one worker slot per epoch before its death ends the epoch in WorkerError
#: (a sample that crashes the decoder every time would otherwise be retried for ever).
MAX_WORKER_RESTARTS = 3
#: Replacements of the prefetcher per epoch; past them the epoch continues without prefetch.
MAX_PREFETCHER_RESTARTS = 3


def _abandon(q) -> None:
    """Close a queue of a dead process without waiting for its feeder thread (nobody reads it)."""
    try:
        q.cancel_join_thread()
        q.close()
    except (OSError, ValueError):  # pragma: no cover - already closed
        pass


class RespawnMixin:
    """Worker and prefetcher channels with replacement of dead processes (see the module
    docstring); mixed into :class:`stoker.loader._run.Run` through
    :class:`stoker.loader.procs.ProcessesMixin`, which sets up the attributes used here."""

    # -- starting ----------------------------------------------------------
    def _spawn_worker(self, slot: int) -> None:
        """Start a worker in ``slot`` (a fresh id, new queues); it replaces ``_workers[slot]``."""
        ctx = self._ctx
        wid = self._next_wid
        self._next_wid += 1
        tasks, results = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=worker_main, name=f"stoker-worker-{wid}",
                        args=(wid, self.dataset, self.cfg, tasks, results,
                              SharedCell(self._current, slot), self._stop, self._ready), daemon=True)
        p.start()
        if slot < len(self._workers):
            self._workers[slot], self._task_qs[slot], self._result_qs[slot] = p, tasks, results
            self._wids[slot] = wid
        else:
            self._workers.append(p)
            self._task_qs.append(tasks)
            self._result_qs.append(results)
            self._wids.append(wid)
            self._assigned.append({})

    def _spawn_prefetcher(self, adopt: bool) -> None:
        """Start the prefetch process with a new command queue (``adopt``: take over the blocks
        a dead predecessor staged)."""
        ctx = self._ctx
        self._pf_cmds = ctx.Queue()
        self._prefetcher = ctx.Process(target=prefetch_main, name="stoker-prefetch",
                                       args=(self.dataset, self._pf_cmds, self._pf_pos, self._pf_done,
                                             self._pf_counters, self.fetch_concurrency, self.prefetch_bytes,
                                             self.staging_bytes, self._pf_prev_done, adopt, self._ready),
                                       daemon=True)
        self._prefetcher.start()

    # -- talking -----------------------------------------------------------
    def _send_task(self, task: tuple) -> None:
        """Hand ``task`` (run, seq, epoch, slot, slot path, ids, offset in the slot) to the worker
        with fewest batches."""
        slot = min(range(len(self._workers)), key=lambda s: len(self._assigned[s]))
        self._assigned[slot][(task[0], task[1], task[6])] = task
        self._task_qs[slot].put(task)

    def _pf_send(self, cmd) -> None:
        """Send a plan ``(run, blocks, first_need, last_need)`` to the prefetcher; kept, so that a
        replacement gets it too."""
        self._pf_last_cmd = cmd
        if not self._pf_off:
            self._pf_cmds.put(cmd)

    def _reply(self, timeout_s: float):
        """The next reply of a live worker, or None after ``timeout_s`` seconds without one.
        Dead workers found meanwhile are replaced (:meth:`_replace_worker`, which raises
        WorkerError past the bound) and a dead prefetcher too."""
        if self._replies:
            return self._replies.popleft()
        sentinels = {p.sentinel: s for s, p in enumerate(self._workers)}
        readers = {q._reader: s for s, q in enumerate(self._result_qs)}
        watch = list(sentinels) + list(readers)
        pf = self._prefetcher if self._prefetcher is not None and not self._pf_off else None
        if pf is not None:
            watch.append(pf.sentinel)
        ready = mp_wait(watch, timeout_s)
        dead = {sentinels[r] for r in ready if r in sentinels}
        for r in ready:
            s = readers.get(r)
            if s is None or s in dead:  # a dead worker's queue is never read (module docstring)
                continue
            q = self._result_qs[s]
            while True:
                try:
                    msg = q.get(False)
                except queue.Empty:
                    break
                self._assigned[s].pop((msg[2], msg[3], msg[-1]), None)  # (run, seq, offset)
                self._replies.append(msg)
        for s in sorted(dead):
            self._replace_worker(s)
        if pf is not None and pf.sentinel in ready:
            self._check_prefetcher()
        return self._replies.popleft() if self._replies else None

    # -- replacing ---------------------------------------------------------
    def _replace_worker(self, slot: int) -> None:
        """Replace the dead worker of ``slot`` and send again the batches it had not answered.

        Raises:
            WorkerError: the slot was replaced :data:`MAX_WORKER_RESTARTS` times this epoch
                already; names the worker, its pid, exit code or signal and the sample it was on.
        """
        p, wid = self._workers[slot], self._wids[slot]
        p.join(1)  # reaped (its sentinel is ready): exitcode is known
        key = self._sample_key(slot)
        what = self._died(f"worker {wid} (pid {p.pid})", p.exitcode) + (
            f" while reading/decoding sample {key!r}" if key else "")
        if self._restarts[slot] >= MAX_WORKER_RESTARTS:
            raise WorkerError(what + f" (worker slot {slot} was already replaced {self._restarts[slot]} "
                                     "times this epoch)")
        self._restarts[slot] += 1
        self._restarted_at = time.monotonic()
        lost = list(self._assigned[slot].values())
        log.warning("%s; starting a new worker and decoding its %d unanswered batch(es) again", what, len(lost))
        _abandon(self._task_qs[slot])
        _abandon(self._result_qs[slot])
        self._assigned[slot] = {}
        self._current[slot] = -1
        self._spawn_worker(slot)
        for task in lost:  # in the order they were dispatched
            self._send_task(task)

    def _restart_prefetcher(self) -> None:
        """Replace the dead prefetcher (within :data:`MAX_PREFETCHER_RESTARTS` this epoch), else
        go on without one (warned once)."""
        p = self._prefetcher
        what = self._died(f"prefetch process (pid {p.pid})", p.exitcode)
        if self._pf_restarts >= MAX_PREFETCHER_RESTARTS:
            if not self._pf_off:
                self._pf_off = True
                _abandon(self._pf_cmds)
                log.warning("%s, %d times this epoch: going on without prefetch (the workers read "
                            "the blocks themselves)", what, self._pf_restarts + 1)
            return
        self._pf_restarts += 1
        self._restarted_at = time.monotonic()
        log.warning("%s; starting a new prefetch process", what)
        if not self._pf_off:
            _abandon(self._pf_cmds)
        self._pf_off = False
        self._spawn_prefetcher(adopt=True)
        if self._pf_last_cmd is not None:
            self._pf_cmds.put(self._pf_last_cmd)

    def _new_epoch_restarts(self) -> None:
        """Start counting restarts for a new epoch (the bounds are per epoch)."""
        self._restarts = [0] * self.num_workers
        self._pf_restarts = 0
