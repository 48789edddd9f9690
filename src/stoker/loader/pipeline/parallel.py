"""The epoch loop of a pipeline with decode workers: batches dispatched as slots allow, the
workers' replies reordered to plan order, dead processes replaced while waiting, the next epoch's
first batches started while this one drains, and a clean error instead of a hang.
"""

from __future__ import annotations

import time

from ...errors import WorkerError

__all__ = ["ParallelLoop"]


class ParallelLoop:
    """Serves epochs from the worker processes (see the module docstring).

    Args:
        config: the :class:`~stoker.loader.options.RunConfig` (``cfg.batch_size``, ``prefetch_batches``,
            ``run.timeout_s``, ``run.epochs``, ``read.prefetch_next_epoch``).
        state: the Loader's :class:`~stoker.loader.state.LoaderState`, advanced per batch.
        live: the Loader's :class:`~stoker.loader.live.LiveTotals` (ticked per batch).
        workers: the :class:`~stoker.loader.workers.pool.WorkerPool`.
        prefetcher: the :class:`~stoker.loader.prefetch.prefetcher.Prefetcher`, or None.
        dispatch: the :class:`~stoker.loader.pipeline.dispatch.Dispatcher`.
        deliver: the :class:`~stoker.loader.pipeline.deliver.Delivery`.
        start_method: the workers' start method; ``fork_hazards``: why forking was unsafe, if it was
            (both for the stall error).
    """

    def __init__(
        self, config, state, live, workers, prefetcher, dispatch, deliver, *, start_method: str, fork_hazards: list
    ):
        self.config, self.cfg = config, config.cfg
        self.state, self.live = state, live
        self.workers, self.prefetcher, self.dispatch, self.deliver = workers, prefetcher, dispatch, deliver
        self.ring = dispatch.ring
        self.start_method, self.fork_hazards = start_method, fork_hazards

    def __call__(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry=None, t_iter=None):
        """A generator of the batches of ``epoch`` (``batches``: lists of sample ids; ``run`` its run
        id) from the workers' replies, in plan order. ``carry``: its early batches, dispatched while
        the previous epoch drained (:meth:`~stoker.loader.pipeline.dispatch.Dispatcher.take_pre`).
        ``stats``, ``delivered`` (ids of each delivered batch) and ``wait_box[0]`` (seconds blocked
        in ``next()``, counted from ``t_resume``) are filled in as batches are yielded.

        Raises:
            WorkerError: a batch failed in a worker (names the sample), a worker slot died past its
                restarts, or no batch came for ``run.timeout_s`` seconds (names what each worker did;
                the workers stuck in a sample are ended and replaced).
            WorkerStartError: a worker exited before its own start was done (names the cause).
            SharedMemoryError: the batch due has no slot and none is with the workers.
        """
        pending: dict[int, tuple] = carry["pending"] if carry else {}
        try:
            yield from self._run(run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending, t_iter)
        finally:  # replies never yielded (an epoch cut short, an error): their slots are free again
            for msg in pending.values():
                self.ring.release(msg[4])
            pending.clear()

    def _run(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending, t_iter):
        inflight: dict[int, tuple] = carry["inflight"] if carry else {}
        sent = [carry["next"] if carry else 0]  # batches dispatched so far
        bs = self.cfg.batch_size
        for seq in range(len(batches)):
            self._await(run, epoch, seq, batches, inflight, pending, sent)
            msg = pending.pop(seq)
            if msg[0] == "error":
                _, wid, _, _, slot, key, err, tb = msg[:8]
                self.ring.release(slot)
                # from: the worker's own stoker error, or None (workers/worker.py)
                what = f"sample {key!r}" if key is not None else "a batch"  # None: a whole batch's function
                raise WorkerError(
                    f"worker {wid} failed on {what} (epoch {epoch}, batch {self.state.position[1]}): {err}\n{tb}"
                ) from msg[9]
            slot, n, skipped, skipped_keys = msg[4:8]
            bids = inflight.pop(seq)[1]
            if seq % 8 == 7 or seq == len(batches) - 1:  # a syscall: not on every batch
                self._check_prefetcher()
            last = seq == len(batches) - 1
            out = self.deliver(
                epoch, slot, bids, n, skipped, skipped_keys, *msg[9:12], stats=stats, delivered=delivered, last=last
            )
            if out is None:  # every sample skipped on one rank, or a streaming collate carried every token on
                self.state.position = (epoch, self.state.position[1] + 1)
                continue
            wait_box[0] += time.perf_counter() - t_resume
            self.state.position = (epoch, self.state.position[1] + 1)
            if self.prefetcher is not None:  # positions in this epoch's plan
                if self.dispatch.pre is None:
                    self.prefetcher.done = (seq + 1) * bs
                else:  # the prefetcher is on the next plan already: this one's progress is "previous"
                    self.prefetcher.prev_done = (seq + 1) * bs
            self.live.tick()
            if not stats.first_batch_s:
                stats.first_batch_s = time.perf_counter() - t_iter
            yield out
            t_resume = time.perf_counter()

    def _await(self, run, epoch, seq, batches, inflight: dict, pending: dict, sent: list) -> None:
        """Dispatch what the slots allow (again after each reply: it may free one), start the next
        epoch's first batches once this one is all sent, and wait until batch ``seq``'s reply is in
        ``pending``. ``sent[0]``: batches of ``batches`` dispatched so far (advanced here).

        Raises:
            WorkerError: no reply for ``run.timeout_s`` seconds (:meth:`_stall`).
        """
        deadline = time.monotonic() + self.config.run.timeout_s
        while True:
            self._send(run, epoch, seq, batches, inflight, sent)
            if (
                sent[0] == len(batches)
                and self.dispatch.pre is None
                and self.state.resume_batch == 0
                and self.state.epoch == epoch + 1
                and self.config.read.prefetch_next_epoch
                and (self.config.run.epochs is None or epoch + 1 < self.config.run.epochs)
                and self.dispatch.prefetch_plan_done(run)
            ):
                self.dispatch.predispatch(epoch + 1)
            if seq in pending:
                return
            msg = self._reply(0.25)  # dead workers are replaced meanwhile (workers/pool.py)
            if msg is None:
                self.workers.check()
                self._check_prefetcher()
                # a replacement decodes its batches again: the wait starts over from it
                if time.monotonic() > max(deadline, self._restarted_at() + self.config.run.timeout_s):
                    raise self._stall(seq, epoch) from None
                continue
            self.dispatch.keep_counters(msg, run)  # the next epoch's early work counts in the next epoch
            msg = self.dispatch.whole(msg)
            if msg is None:  # a part of a split batch; the others are still being decoded
                continue
            self.ring.busy.discard(msg[4])
            if msg[2] == run:
                pending[msg[3]] = msg  # errors too: raised when their batch is due, in plan order
                continue
            pre = self.dispatch.pre
            if pre is not None and msg[2] == pre["run"]:
                pre["pending"][msg[3]] = msg  # the next epoch's, early: keep it
            else:  # a reply to an abandoned epoch: just free its slot
                self.ring.release(msg[4])

    def _send(self, run, epoch, seq, batches, inflight: dict, sent: list) -> None:
        """Dispatch the next batches while fewer than ``prefetch_batches`` are with the workers
        and a slot is free (shared memory short: more go out as slots come back)."""
        while sent[0] < len(batches) and len(inflight) < self.config.prefetch_batches:
            k = sent[0]
            # may_raise: batch k is the one now due
            if not self.dispatch.dispatch(run, epoch, k, batches[k], inflight, may_raise=k <= seq, split=k == 0):
                return
            sent[0] = k + 1
            if self.prefetcher is not None and self.dispatch.pre is None:
                self.prefetcher.position = sent[0] * self.cfg.batch_size

    def _reply(self, timeout_s: float):
        """The next worker reply, or None after ``timeout_s`` seconds (dead workers replaced
        meanwhile, and a dead prefetcher when its sentinel wakes the wait)."""
        pf = self.prefetcher.sentinel() if self.prefetcher is not None else None
        msg, pf_woke = self.workers.reply(timeout_s, also=pf)
        if pf_woke:
            self._check_prefetcher()
        return msg

    def _restarted_at(self) -> float:
        """``time.monotonic()`` of the last replacement of a worker or the prefetcher (0: none)."""
        return max(self.workers.restarted_at, self.prefetcher.restarted_at if self.prefetcher is not None else 0.0)

    def _stall(self, seq: int, epoch: int) -> WorkerError:
        """The error for ``timeout_s`` without the batch due: what each worker was doing, and the
        fork hazards of the training process if the workers were forked anyway. The workers stuck
        in a sample are ended and replaced first (their batches' slots freed, the next epoch's
        early batches dropped), so the next epoch does not wait behind the same call."""
        msg = (
            f"no batch from the workers for {self.config.run.timeout_s:.0f} s (batch {seq} of epoch {epoch}): "
            + self.workers.describe()
        )
        if self.start_method == "fork" and self.fork_hazards:
            msg += "; the workers were forked from a process with " + "; ".join(self.fork_hazards)
        elif self.workers.idle():
            msg += " (no worker is reading or decoding: none took the task, or their replies are lost)"
        ended, free = self.workers.end_stuck()
        for slot in free:
            self.ring.busy.discard(slot)
            self.ring.release(slot)
        if ended:
            self.dispatch.pre = None  # its batches may have gone to an ended worker
            msg += f". Ended and replaced: {', '.join(ended)}"
        return WorkerError(msg)

    def _check_prefetcher(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.check()
