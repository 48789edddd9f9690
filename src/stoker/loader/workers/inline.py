"""The epoch loop without decode workers (``num_workers=0``): batches decoded in the training
process, on a watched thread, so that ``timeout_s`` holds here too.

Each batch's decode (its reads, then the built-in decoder or the user's decode and collate) runs
on one daemon thread of the training process, ``stoker-decode-<n>``, while the training thread
waits for it at most ``timeout_s`` (:class:`DecodeThread`). A decode that does not finish in
time (a user decode stuck in a loop, a read of a network path that never answers) ends the epoch
with :class:`~stoker.errors.WorkerError` naming the sample and the thread. Python cannot stop a
thread, so the stuck one is left where it is (a daemon: it ends with the process; if it ever
returns, its batch is dropped) and the next batch goes to a new thread. A Ctrl-C interrupts the
training thread's wait, not the decode: that batch finishes on its thread and is dropped (its
slot freed), and the next batch is decoded after it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

from ...errors import WorkerError
from .worker import BatchDecoder

__all__ = ["DecodeThread", "InlineLoop"]

_THREAD_IDS = itertools.count()

#: how long :meth:`DecodeThread.close` waits for the thread to end its batch, in seconds (a
#: batch's decode takes well under a second; a thread still busy after this is left)
CLOSE_WAIT_S = 10.0


class _Cell:
    """The sample id a decode thread is on (-1: none), as the decoders publish it (``.value``)."""

    def __init__(self):
        self.value = -1


class _Job:
    """One batch's decode on the thread: ``fn(*args, cell)``, its outcome, and who frees what it
    holds when nobody waits for it any more (``on_drop``, called exactly once then)."""

    def __init__(self, fn, args: tuple, on_drop=None):
        self.fn, self.args, self.on_drop = fn, args, on_drop
        self.result = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._done = self._dropped = False

    def complete(self) -> None:
        """The thread's side: the decode ended (returned or raised)."""
        with self._lock:
            self._done, dropped = True, self._dropped
        self.finished.set()
        if dropped and self.on_drop is not None:
            self.on_drop()

    def drop(self) -> None:
        """The waiter's side: it does not want the outcome any more."""
        with self._lock:
            self._dropped, done = True, self._done
        if done and self.on_drop is not None:
            self.on_drop()


def _serve(jobs: queue.SimpleQueue, cell: _Cell) -> None:
    """A decode thread: run jobs until None."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.result = job.fn(*job.args, cell)
        except BaseException as exc:  # noqa: BLE001 - raised again in the training thread
            job.error = exc
        finally:
            job.complete()
        del job


class DecodeThread:
    """Runs one batch's decode at a time on a daemon thread and waits for it at most a given time
    (see the module docstring). Not thread-safe: the training thread's."""

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._cell = _Cell()
        self.stuck: list[str] = []  #: the names of the threads left stuck, oldest first
        #: True when the last :meth:`run` gave up its decode (a timeout or an interrupted wait):
        #: its ``on_drop`` frees what it holds then, not the caller
        self.dropped = False

    def run(self, fn, args: tuple, timeout_s: float, on_drop=None):
        """``fn(*args, cell)`` on the thread (``cell.value``: the sample it is on), its result, or
        its exception raised here.

        Args:
            fn, args: the decode.
            timeout_s: longest wait in seconds.
            on_drop: called once when the outcome is not wanted any more and the decode has
                ended (after a timeout or an interrupt of the wait): frees what it holds.

        Raises:
            TimeoutError: it did not end within ``timeout_s``; the thread is left (its name is in
                the message and in :attr:`stuck`) and the next call starts a new one.
            whatever ``fn`` raised.
        """
        if self._thread is None:
            self._jobs, self._cell = queue.SimpleQueue(), _Cell()
            self._thread = threading.Thread(
                target=_serve, args=(self._jobs, self._cell), name=f"stoker-decode-{next(_THREAD_IDS)}", daemon=True
            )
            self._thread.start()
        assert self._jobs is not None
        job = _Job(fn, args, on_drop)
        self.dropped = False
        self._jobs.put(job)
        try:
            finished = job.finished.wait(timeout_s)
        except BaseException:  # a Ctrl-C: the decode ends on its thread, its batch is dropped there
            self.dropped = True
            job.drop()
            raise
        if not finished:
            self.dropped = True
            job.drop()
            name, sid = self._thread.name, self._cell.value
            self.stuck.append(name)
            self._thread = self._jobs = None  # left stuck; the next batch gets a new thread
            raise TimeoutError(name, sid)
        if job.error is not None:
            raise job.error
        return job.result

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop the thread when it has ended its batch, and wait at most ``wait_s`` seconds for it
        to end (a stuck one is left: a daemon).

        The wait matters at exit. A job that never calls ``close()`` is closed by the exit hook
        (loader/loader.py), just before the interpreter finalizes. A thread that ended after that
        would free its thread-local torch tensors (decode/resample.py's scratch buffers) when
        Python no longer lets a thread take the GIL: glibc then unwinds it through torch's C++
        and the process aborts ("terminate called without an active exception").
        """
        thread, jobs = self._thread, self._jobs
        self._thread = self._jobs = None
        if jobs is not None:
            jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)


class InlineLoop:
    """Serves epochs decoded in the training process (see the module docstring).

    Args:
        config: the :class:`~stoker.loader.options.RunConfig` (``run.timeout_s``).
        state: the Loader's :class:`~stoker.loader.state.LoaderState`, advanced per batch.
        live: the Loader's :class:`~stoker.loader.live.LiveTotals` (ticked per batch).
        decoder: a :class:`~stoker.loader.workers.worker.BatchDecoder` (writes into a slot) or a
            :class:`~stoker.loader.workers.batches.GenericDecoder` (the user's decode/collate).
        ring: the :class:`~stoker.loader.shm.SlotRing` (private slots).
        deliver: the :class:`~stoker.loader.pipeline.deliver.Delivery`.
        dataset: the dataset read (for the key of a stuck sample).
    """

    def __init__(self, config, state, live, decoder, ring, deliver, dataset):
        self.config = config
        self.state, self.live, self.decoder, self.ring, self.deliver = state, live, decoder, ring, deliver
        self.dataset = dataset
        self.slots = isinstance(decoder, BatchDecoder)  # the built-in decoder writes into a slot
        self.thread = DecodeThread()

    def __call__(self, epoch, start, batches, stats, delivered, t_resume, wait_box, t_iter):
        """A generator of the batches of ``epoch`` (``batches``: lists of sample ids, from batch
        ``start`` of the epoch); fills ``stats``, ``delivered`` and ``wait_box[0]`` as
        :class:`~stoker.loader.pipeline.parallel.ParallelLoop` does.

        Raises:
            WorkerError: a batch's decode did not end within ``timeout_s`` (names the sample and
                the thread left stuck on it).
            whatever the decode raised (DecodeError, SampleFnError, OriginError, ...).
        """
        for seq, bids in enumerate(batches):
            out = self._one(epoch, start + seq, bids, seq == len(batches) - 1, stats, delivered)
            self.state.position = (epoch, start + seq + 1)
            if out is None:  # every sample skipped on one rank, or a streaming collate carried every token on
                continue
            wait_box[0] += time.perf_counter() - t_resume
            self.live.tick()
            if not stats.first_batch_s:
                stats.first_batch_s = time.perf_counter() - t_iter
            yield out
            t_resume = time.perf_counter()

    def _one(self, epoch, seq, bids, last, stats, delivered):
        """Batch ``seq`` decoded on the thread and delivered."""
        if not self.slots:
            n, sk, sk_keys, batch, padded = self._decode(self.decoder.run, (epoch, bids), epoch, seq)
            payload = None if batch is None else ("local", batch)
            return self.deliver(
                epoch, None, bids, n, sk, sk_keys, None, payload, padded, stats=stats, delivered=delivered, last=last
            )
        ring = self.ring
        slot = ring.acquire()
        try:
            done = self._decode(self.decoder.run, (epoch, bids, *ring.views(slot)), epoch, seq, slot)
        except BaseException:
            if not self.thread.dropped:  # the decode failed: its slot is free again (a dropped one frees it itself)
                ring.release(slot)
            raise
        n, sk, sk_keys, payloads, padded = done
        return self.deliver(epoch, slot, bids, n, sk, sk_keys, payloads, None, padded, stats=stats, delivered=delivered)

    def _decode(self, fn, args, epoch, seq, slot=None):
        """``fn(*args, cell)`` on the thread; a stuck decode becomes WorkerError."""
        ring = self.ring
        on_drop = (lambda: ring.release(slot)) if slot is not None else None
        try:
            return self.thread.run(fn, args, self.config.run.timeout_s, on_drop)
        except TimeoutError as exc:
            if not self.thread.dropped:  # the user's decode raised TimeoutError itself
                raise
            name, sid = exc.args
            key = self.dataset.key(sid) if 0 <= sid < len(self.dataset) else None
            raise WorkerError(
                f"no batch decoded for {self.config.run.timeout_s:.0f} s (batch {seq} of epoch {epoch}, decoded in the "
                f"training process: num_workers=0): thread {name} is "
                + (f"on sample {key!r}" if key else "stuck")
                + "; a thread cannot be stopped, so it is left (it ends with the process) and the next "
                "batch goes to a new thread"
            ) from None

    def close(self) -> None:
        """Stop the decode thread (one left stuck stays, a daemon)."""
        self.thread.close()
