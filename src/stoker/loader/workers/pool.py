"""The decode workers of one started pipeline: their processes, channels, and replacement (the
rules it keeps: this folder's README.md, "Invariants").

Each decode worker has its own task queue and its own result queue (a worker killed in ``get()``
on a shared queue would hold its read lock for ever), and the pool records which batches it
handed to which worker (``(run, seq, offset) -> task`` per worker slot; the offset tells the parts
of a split batch apart, :mod:`.split`). The batches a dead worker took but did not answer are sent
again, with the same run, sequence number and slot, to the live workers (the replacement
included); a reply it sent that was not received yet is dropped with its queue, so each batch is
delivered once. A worker that exits before its own start is done is not replaced
(:mod:`stoker.loader.workers.launch`). A worker stuck in one sample past ``timeout_s`` is ended
and replaced by :meth:`WorkerPool.end_stuck` after the stall error, so the next epoch does not
wait behind the same call.

Limit: a reply is read once its queue is readable; a reply larger than the pipe's atomic write
(4 KiB; replies carry no pixels, except the sample bytes when decoding on the device, and a
user-collated batch's non-array leaves, or a batch with no array, pickled) cut short by
a kill in the middle of writing it leaves a partial message that the reader would wait on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import queue
import select
import time
from collections import deque

from ...errors import WorkerError, WorkerStartError
from ..shm import SharedCell
from . import interrupts, launch
from .launch import abandon, died, stop_processes
from .sharedpickle import SharedPickle
from .worker import STARTING, worker_main

log = logging.getLogger(__name__)

__all__ = ["MAX_WORKER_RESTARTS", "WorkerPool"]

#: Replacements of one worker slot per epoch before its death ends the epoch in WorkerError
#: (a sample that crashes the decoder every time would otherwise be retried for ever).
MAX_WORKER_RESTARTS = 3


class _Watch:
    """:func:`multiprocessing.connection.wait` over the same handles call after call, with one
    ``select.poll`` registered once per set of handles (``wait`` makes and fills a selector per
    call: about 30 us, per batch). Handles: ints (descriptors, process sentinels) or objects
    with ``fileno()`` (a Connection); any event (data, hang-up, error) makes a handle ready, as
    for ``wait``."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._poll = select.poll()
        self._by_fd: dict[int, object] = {}

    def wait(self, handles: list, timeout_s: float) -> list:
        """The handles of ``handles`` that are ready within ``timeout_s`` seconds, in their order."""
        key = tuple(handles)
        if key != self._key:
            self._poll = select.poll()
            self._by_fd = {}
            for h in handles:
                fd = h if isinstance(h, int) else h.fileno()
                self._poll.register(fd, select.POLLIN)
                self._by_fd[fd] = h
            self._key = key
        got = {fd for fd, _ in self._poll.poll(math.ceil(timeout_s * 1000) if timeout_s > 0 else 0)}
        return [h for fd, h in self._by_fd.items() if fd in got]


def _readable(q):
    """The handle of ``q`` (a ``multiprocessing.Queue``) that becomes ready when it has data, for
    :func:`multiprocessing.connection.wait`. The stdlib offers no public one: a Queue is the
    pipe's read end plus a feeder thread that lets a worker reply without waiting for us."""
    return q._reader


class WorkerPool:
    """``num_workers`` decode processes (:func:`stoker.loader.workers.worker.worker_main`), one task and
    one result queue each, and their replacement (module docstring).

    Args:
        ctx: the multiprocessing context (:func:`stoker.loader.workers.launch.start_context`).
        dataset: the :class:`~stoker.store.dataset.Dataset` each worker gets a copy of.
        cfg: the frozen :class:`~stoker.loader.options.WorkerConfig`.
        num_workers: worker slots (>= 1).
        ready: a shared int each process increments once set up (``ctx.Value("q")``).
        shipped: what the workers receive instead of ``dataset`` (spawn/forkserver): the dataset
            pickled once, its arrays in a shared file (:class:`.sharedpickle.SharedPickle`).
    """

    def __init__(self, ctx, dataset, cfg, num_workers: int, ready, shipped: SharedPickle | None = None):
        self._ctx, self._dataset, self._cfg, self._ready = ctx, dataset, cfg, ready
        self._method = ctx.get_start_method()
        # spawn/forkserver: the config goes pickled, so a user function the child cannot find fails
        # in the worker's own start (named), not in the bootstrap before it
        self._cfg_arg = cfg if self._method == "fork" else pickle.dumps(cfg, protocol=pickle.HIGHEST_PROTOCOL)
        # spawn/forkserver: the dataset as pickled once for every process, its arrays in a shared file
        self._dataset_arg = dataset if shipped is None else shipped
        # sample id per slot, -1 idle, STARTING until the worker is set up
        self._current = ctx.Array("q", [STARTING] * num_workers, lock=False)
        self._start_errors: dict[int, str] = {}  # slot -> the error its worker sent while starting
        self._stop = ctx.Event()  # workers drop queued tasks instead of finishing them
        self._procs: list = []
        self._task_qs: list = []
        self._result_qs: list = []
        self._wids: list[int] = []
        self._assigned: list[dict] = []
        self._replies: deque = deque()  # replies received, not yet taken
        self._watch = _Watch()
        self._next_wid = 0  # worker ids: 0..num_workers-1, then one new id per replacement
        self._restarts = [0] * num_workers  # replacements per slot, this epoch
        self.restarted_at = 0.0  #: ``time.monotonic()`` of the last replacement (0: none)
        for slot in range(num_workers):
            self._spawn(slot)

    # -- inspection ---------------------------------------------------------
    @property
    def processes(self) -> tuple:
        """The live worker processes (``multiprocessing.Process``), one per slot."""
        return tuple(self._procs)

    @property
    def restarts(self) -> int:
        """Workers replaced this epoch (all slots)."""
        return sum(self._restarts)

    def sample_key(self, slot: int) -> str | None:
        """Key of the sample the worker in ``slot`` is on, or None when idle."""
        sid = int(self._current[slot])
        return self._dataset.key(sid) if 0 <= sid < len(self._dataset) else None

    def describe(self) -> str:
        """What each worker is doing, in words (for a stall error)."""
        parts = []
        for slot, p in enumerate(self._procs):
            key = self.sample_key(slot)
            state = f"on sample {key!r}" if key else ("starting" if self._current[slot] == STARTING else "idle")
            parts.append(f"worker {self._wids[slot]} (pid {p.pid}) {state}")
        return ", ".join(parts)

    def idle(self) -> bool:
        """True when no worker is reading or decoding a sample."""
        return all(self.sample_key(s) is None for s in range(len(self._procs)))

    # -- talking ------------------------------------------------------------
    def new_epoch(self) -> None:
        """Start counting restarts for a new epoch (the bound is per epoch)."""
        self._restarts = [0] * len(self._restarts)

    def send(self, task: tuple) -> None:
        """Hand ``task`` (run, seq, epoch, slot, slot path, ids, offset in the slot, whole) to the worker
        with fewest batches."""
        slot = min(range(len(self._procs)), key=lambda s: len(self._assigned[s]))
        self._assigned[slot][(task[0], task[1], task[6])] = task
        self._task_qs[slot].put(task)

    def reply(self, timeout_s: float, also=None) -> tuple:
        """The next reply of a live worker, or None after ``timeout_s`` seconds without one.

        Dead workers found meanwhile are replaced (:meth:`check`). ``also``: one more handle to
        wake on (the prefetcher's sentinel).

        Returns:
            (reply or None, whether ``also`` was ready).

        Raises:
            WorkerError: a dead worker's slot is past :data:`MAX_WORKER_RESTARTS` this epoch.
            WorkerStartError: a worker exited before its own start was done (names the cause).
        """
        if self._replies:
            return self._replies.popleft(), False
        sentinels = {p.sentinel: s for s, p in enumerate(self._procs)}
        readers = {_readable(q): s for s, q in enumerate(self._result_qs)}
        watch = list(sentinels) + list(readers) + ([also] if also is not None else [])
        ready = self._watch.wait(watch, timeout_s)
        dead = {sentinels[r] for r in ready if r in sentinels}
        for r in ready:
            s = readers.get(r)
            if s is None or s in dead:  # a dead worker's queue is never read (module docstring)
                continue
            q = self._result_qs[s]
            with interrupts.held():  # a Ctrl-C never cuts a message in half
                while True:
                    try:
                        msg = q.get(False)
                    except queue.Empty:
                        break
                    if msg[0] == "start-error":  # the worker ends now: its death says the rest
                        self._start_errors[s] = msg[2]
                        continue
                    self._assigned[s].pop((msg[2], msg[3], msg[-1]), None)  # (run, seq, offset)
                    self._replies.append(msg)
        for s in sorted(dead):
            self._replace(s)
        woke = also is not None and also in ready
        return (self._replies.popleft() if self._replies else None), woke

    def check(self) -> None:
        """Replace every dead worker (WorkerError past the bound, WorkerStartError for one that
        died starting, see :meth:`reply`)."""
        for slot, p in enumerate(self._procs):
            if p.exitcode is not None:
                self._replace(slot)

    # -- stopping -----------------------------------------------------------
    def signal_stop(self) -> None:
        """Tell every worker to stop (queued tasks are dropped)."""
        self._stop.set()
        for q in self._task_qs:
            with contextlib.suppress(OSError, ValueError):
                q.put(None)

    def join(self, deadline: float) -> None:
        """Wait for the workers until ``deadline`` (``time.monotonic()``), then kill them; one
        still starting is killed at once (it holds nothing, and may never read the stop)."""
        for slot, p in enumerate(self._procs):
            if self._current[slot] == STARTING and p.is_alive():
                p.kill()
        stop_processes(self._procs, deadline)
        self._procs = []

    def end_stuck(self) -> tuple[list[str], list[int]]:
        """End every worker in the middle of a sample (called after a stall: no batch came for
        ``timeout_s``) and start a new one in its slot, so the next epoch does not wait behind
        the same call; the batches it had not answered are dropped (their epoch is over).

        Returns:
            (each ended worker in words, the batch slots of its dropped batches that no other
            worker still holds: the caller frees them).
        """
        ended, lost = [], []
        for slot, p in enumerate(self._procs):
            key = self.sample_key(slot)
            if key is None:
                continue
            p.kill()
            p.join(5)
            ended.append(f"worker {self._wids[slot]} (pid {p.pid}) on sample {key!r}")
            lost += list(self._assigned[slot].values())
            abandon(self._task_qs[slot])
            abandon(self._result_qs[slot])
            self._assigned[slot] = {}
            self._spawn(slot)
        held = {t[3] for tasks in self._assigned for t in tasks.values()}
        free = sorted({t[3] for t in lost} - held)
        if ended:
            log.warning("ended %s after the stall; new workers started in their place", ", ".join(ended))
        return ended, free

    # -- starting and replacing ---------------------------------------------
    def _spawn(self, slot: int) -> None:
        """Start a worker in ``slot`` (a fresh id, new queues)."""
        ctx, wid = self._ctx, self._next_wid
        self._next_wid += 1
        tasks, results = ctx.Queue(), ctx.Queue()
        self._current[slot] = STARTING
        self._start_errors.pop(slot, None)
        p = ctx.Process(
            target=worker_main,
            name=f"stoker-worker-{wid}",
            args=(
                wid,
                self._dataset_arg,
                self._cfg_arg,
                tasks,
                results,
                SharedCell(self._current, slot),
                self._stop,
                self._ready,
            ),
            daemon=True,
        )
        launch.start(p)
        if slot < len(self._procs):
            self._procs[slot], self._task_qs[slot], self._result_qs[slot] = p, tasks, results
            self._wids[slot] = wid
        else:
            self._procs.append(p)
            self._task_qs.append(tasks)
            self._result_qs.append(results)
            self._wids.append(wid)
            self._assigned.append({})

    def _start_error(self, slot: int) -> str | None:
        """The error the worker of ``slot`` sent while starting, if it sent one (it is dead: its
        queue is read only for that message, which it wrote whole before it exited)."""
        if slot not in self._start_errors:
            q = self._result_qs[slot]
            with contextlib.suppress(queue.Empty, EOFError, OSError, pickle.UnpicklingError):
                if _readable(q).poll(0.2):
                    msg = q.get(False)
                    if msg[0] == "start-error":
                        self._start_errors[slot] = msg[2]
        return self._start_errors.get(slot)

    def _replace(self, slot: int) -> None:
        """Replace the dead worker of ``slot`` and send again the batches it had not answered.

        Raises:
            WorkerError: the slot was replaced :data:`MAX_WORKER_RESTARTS` times this epoch
                already; names the worker, its pid, exit code or signal and the sample it was on.
            WorkerStartError: the worker exited before its own start was done (not replaced).
        """
        p, wid = self._procs[slot], self._wids[slot]
        p.join(1)  # reaped (its sentinel is ready): exitcode is known
        if self._current[slot] == STARTING and (p.exitcode or 0) > 0:  # exited while starting: not replaced
            raise WorkerStartError(
                launch.start_failure(f"worker {wid} (pid {p.pid})", p.exitcode, self._method, self._start_error(slot))
            )
        key = self.sample_key(slot)
        what = died(f"worker {wid} (pid {p.pid})", p.exitcode) + (
            f" while reading/decoding sample {key!r}" if key else ""
        )
        if self._restarts[slot] >= MAX_WORKER_RESTARTS:
            raise WorkerError(
                what + f" (worker slot {slot} was already replaced {self._restarts[slot]} times this epoch)"
            )
        self._restarts[slot] += 1
        self.restarted_at = time.monotonic()
        lost = list(self._assigned[slot].values())
        log.warning("%s; starting a new worker and decoding its %d unanswered batch(es) again", what, len(lost))
        abandon(self._task_qs[slot])
        abandon(self._result_qs[slot])
        self._assigned[slot] = {}
        self._current[slot] = -1
        self._spawn(slot)
        for task in lost:  # in the order they were dispatched
            self.send(task)
