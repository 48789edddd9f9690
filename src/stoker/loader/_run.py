"""One started pipeline of a :class:`stoker.loader.Loader`: its processes, queues, shared-memory
slots and prefetcher, and the epoch loop that turns them into batches.

The Loader keeps the configuration and the resume state (:class:`stoker.loader.state.LoaderState`);
its first ``iter()`` starts a :class:`Run`, which serves that epoch and every later one (workers
stay up between epochs, and the first batches of the next epoch are dispatched while the current
one drains) until :meth:`stoker.loader.Loader.close`, which stops it; a later ``iter()`` starts a
new one. The data flow and the processes are drawn in this package's README.md.
"""
from __future__ import annotations

import logging
import time

from .epoch_stats import EpochStats, account, fill_from_counters, process_cpu_s
from .prefetch import block_schedule
from .procs import ProcessesMixin, WorkerError
from .shm import SlotRing
from .workers import BatchDecoder, counters

log = logging.getLogger(__name__)

__all__ = ["Run"]


class Run(ProcessesMixin):
    """The started pipeline of one loader (see the module docstring).

    Args:
        loader: the :class:`stoker.loader.Loader` it serves; its configuration is read once
            here, its ``state`` (a :class:`~stoker.loader.state.LoaderState`) is advanced as
            batches are yielded, and each epoch's :class:`EpochStats` is set on its ``stats``
            and appended to its ``history``.
    """

    def __init__(self, loader):
        self.loader, self.state = loader, loader.state
        self.dataset, self.cfg = loader.dataset, loader.cfg
        self.num_workers, self.batch_size = loader.num_workers, loader.batch_size
        self.prefetch_batches, self.timeout_s = loader.prefetch_batches, loader.timeout_s
        self.prefetch_bytes, self.fetch_concurrency = loader.prefetch_bytes, loader.fetch_concurrency
        self.staging_bytes = loader.staging_bytes
        self._start_method_asked, self.start_method = loader._start_method_asked, loader.start_method
        self._workers: list = []
        self._prefetcher = None
        self._ring: SlotRing | None = None
        self._transfer = None
        self._own_staging = False
        self._pre: dict | None = None  # the next epoch's first batches, dispatched early
        self._run_id = 0  # one per epoch served: replies carry it, so stale ones are recognised
        self._worker_counters: dict[int, dict] = {}  # worker id -> its last counters (dead ones kept)
        self._pf_off = False  # the prefetcher died more often than allowed this epoch (respawn.py)
        self._pf_last_cmd = None  # the last plan sent to the prefetcher, for a replacement
        self._restarts: list[int] = [0] * self.num_workers  # replacements per worker slot, this epoch
        self._pf_restarts = 0
        self._restarted_at = 0.0  # time.monotonic() of the last replacement
        self.started = False

    def start(self) -> None:
        """Map the slots and start the processes (or the in-process decoder).

        Raises:
            SharedMemoryError: not one batch slot fits in shared memory (:mod:`stoker.loader.shm`).
            ForkUnsafeError: ``start_method="fork"`` where fork is unsafe.
            RuntimeError: ``device`` is a CUDA device and CUDA is not available.
        """
        from .. import _torch as _torch_adapter  # pay torch's import before the first batch
        from .. import decode  # noqa: F401 - imported once here, inherited by forked workers
        _torch_adapter.load()
        loader = self.loader
        if loader.device not in (None, "cpu"):
            from .transfer import DeviceTransfer
            self._transfer = DeviceTransfer(loader.device)
        self._ring = SlotRing(self.batch_size, self.cfg.image_size, self.prefetch_batches + 2,
                              shared=self.num_workers > 0)  # SharedMemoryError: not one slot fits
        if self.dataset.cache is not None and self.num_workers > 0 and self.dataset.staging is None:
            from ..cache import StagingArea
            self.dataset.staging = StagingArea.create(self.dataset.cache.root)
            self._own_staging = True
        self.started = True  # from here on, close() has something to stop
        if self.num_workers > 0:
            self._start_processes()  # ForkUnsafeError: start_method="fork" where fork is unsafe
        else:
            self._decoder = BatchDecoder(self.dataset, self.cfg)
        if loader.decode_device is not None and loader._device_decoder is None:  # after the forks (CUDA)
            from .device_decode import DeviceBatchDecoder
            loader._device_decoder = DeviceBatchDecoder.create(loader.decode_device, self.dataset, self.cfg)

    def close(self) -> None:
        """Stop the workers and the prefetcher (3 s to finish, then killed), unlink the shared
        memory and the staging area this run made. Idempotent."""
        if not self.started:
            return
        self.started = False
        self._pre = None
        if self._workers:
            self._stop.set()  # workers drop queued tasks instead of finishing them
        for q in getattr(self, "_task_qs", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        if self._prefetcher is not None and not self._pf_off:
            try:
                self._pf_cmds.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 3
        for p in self._workers + ([self._prefetcher] if self._prefetcher else []):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
        self._workers = []
        if self._ring is not None:
            self._ring.close()
        if self._own_staging:
            self.dataset.staging.clear()
            self.dataset.staging = None
            self._own_staging = False

    def drop_pre(self) -> None:
        """Forget the next epoch's early batches (the loader was moved to another position);
        their replies are recognised by their run id and their slots freed."""
        self._pre = None

    def epoch(self, epoch: int, start: int = 0):
        """A generator of the batches of ``epoch`` from batch ``start`` on (see
        :class:`stoker.loader.Loader` for what a batch is)."""
        self._run_id += 1
        return self._epoch(self._run_id, epoch, start)

    # -- counters ---------------------------------------------------------
    def _cpu(self) -> dict:
        out = {"main": process_cpu_s(None)}
        if self._workers:
            out["workers"] = sum(process_cpu_s(p.pid) for p in self._workers)
        if self._prefetcher is not None:
            out["prefetch"] = process_cpu_s(self._prefetcher.pid)
        return out

    def _totals(self, pf_counters=None) -> dict:
        """Counters summed over the workers and the prefetcher (``pf_counters``: a snapshot of
        the prefetcher's counters to use instead of their current values)."""
        tot: dict[str, int] = {}
        sources = (list(self._worker_counters.values()) if self.num_workers > 0
                   else [counters(self.dataset, self.cfg.derived)])
        for c in sources:
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        if self._prefetcher is not None:
            pc = list(self._pf_counters) if pf_counters is None else pf_counters
            tot["origin_bytes"] = tot.get("origin_bytes", 0) + pc[0]
            tot["origin_requests"] = tot.get("origin_requests", 0) + pc[1]
            tot["prefetch_fills"] = pc[2]
            tot["prefetch_staged"] = pc[5]
            tot["prefetch_depth_sum"] = pc[6]
            tot["prefetch_depth_n"] = pc[7]
        return tot

    def _epoch(self, run: int, epoch: int, start: int = 0):
        t_start = time.perf_counter()
        stats = EpochStats(epoch=epoch)
        if self.num_workers > 0:
            self._new_epoch_restarts()
        carry = self._take_pre(epoch, start) if self.num_workers > 0 else None
        if carry is not None:
            run, ids, batches = carry["run"], carry["ids"], carry["batches"]
            stats.order_displacement = carry["displacement"]
        else:
            ids, stats.order_displacement = self.loader._epoch_plan(epoch)
            ids = ids[start * self.batch_size:]
            batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        self.state.position = (epoch, start)
        # prefetch work for this epoch done while the previous one drained counts here
        before = self._totals(carry.get("pf_boundary") if carry is not None else None)
        if carry is not None:  # workers' counters as of their early replies for this epoch
            self._worker_counters.update(carry["counters"])
        cpu_before = self._cpu()
        delivered: list = []  # the sample ids of each delivered batch (counted at the end)
        if self._prefetcher is not None and carry is None:  # (a pre-dispatched epoch sent its plan)
            self._pf_pos.value = 0
            self._pf_done.value = 0
            self._pf_send((run, *block_schedule(self.dataset, ids)))
        wait_box = [0.0]  # seconds blocked in next(), also when the epoch is cut short
        t_resume = time.perf_counter()
        try:
            if self.num_workers == 0:
                for seq, bids in enumerate(batches):
                    slot = self._ring.acquire()
                    out = self._deliver(epoch, slot, bids, *self._decoder.run(epoch, bids, *self._ring.views(slot)),
                                        stats=stats, delivered=delivered)
                    if out is None:  # every sample of the batch was skipped: yield nothing for it
                        self.state.position = (epoch, start + seq + 1)
                        continue
                    wait_box[0] += time.perf_counter() - t_resume
                    self.state.position = (epoch, start + seq + 1)
                    yield out
                    t_resume = time.perf_counter()
            else:
                yield from self._parallel(run, epoch, batches, stats, delivered, t_resume, wait_box, carry)
        finally:
            stats.seconds = time.perf_counter() - t_start
            stats.worker_restarts, stats.prefetcher_restarts = sum(self._restarts), self._pf_restarts
            stats.cpu_s = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in self._cpu().items()}
            pre = self._pre if self._pre is not None and self._pre["epoch"] != epoch else None
            after = self._totals(pre.get("pf_boundary") if pre is not None else None)
            fill_from_counters(stats, {k: after.get(k, 0) - before.get(k, 0) for k in after}, wait_box[0], ids,
                               delivered, len(self.dataset))
            self.loader.stats = stats
            self.loader.history.append(stats)
            if self.state.position[0] == epoch and self.state.epoch == epoch + 1:  # no later iter()/set_epoch/load
                if self.state.position[1] == start + len(batches):  # every batch done (yielded or all skipped)
                    self._report_epoch(stats)
                self.state.position = (epoch + 1, 0)  # done or cut short: the next iter() (and a resume) runs epoch + 1

    def _report_epoch(self, stats: EpochStats) -> None:
        """Tell the node cache's policy how fast this job reads its dataset: the time to
        read the whole dataset at this rank's pace (seconds), so the rates of a job's ranks
        on one node add up to the job's rate (:mod:`stoker.cache.policy`)."""
        cache = getattr(self.dataset, "cache", None)
        if cache is None or not stats.samples or not stats.seconds or not hasattr(cache, "register"):
            return
        try:
            cache.register(self.dataset.version, self.dataset.index.total_bytes,
                           stats.seconds * len(self.dataset) / stats.samples)
        except OSError as exc:  # the policy's bookkeeping must never stop training
            log.warning("could not update the cache policy's job record: %s", exc)

    def _deliver(self, epoch, slot, bids, n, skipped, skipped_keys, payloads, *, stats, delivered):
        """Account for one finished batch and turn slot ``slot`` into what ``next()`` yields:
        tensors over the slot (or on ``device``), or the device decode of the workers'
        ``payloads`` (the slot is then released at once). None when every sample was skipped."""
        if payloads is not None:
            labels = self._ring.views(slot)[1][:n].copy()
            self._ring.release(slot)
            images, labels, more, more_keys = self.loader._device_decoder(epoch, payloads, labels)
            account(stats, bids, list(skipped) + more, list(skipped_keys) + more_keys, delivered)
            return None if images is None else (images, labels)
        account(stats, bids, skipped, skipped_keys, delivered)
        if n == 0:
            self._ring.release(slot)
            return None
        imgs, labels = self._ring.batch(slot, n)
        return self._as_batch(imgs, labels)

    def _as_batch(self, imgs, labels):
        """Tensors over the slot (no copy), or on ``device`` through :mod:`stoker.loader.transfer`."""
        from .._torch import as_tensors
        out = as_tensors(imgs, labels)
        return out if self._transfer is None else self._transfer(*out)

    def _dispatch(self, run: int, epoch: int, seq: int, bids, inflight: dict, may_raise: bool = False) -> bool:
        """Send batch ``seq`` to the workers; False (nothing sent) when no slot is free and
        shared memory has no room for another. ``may_raise``: batch ``seq`` is the one the
        consumer waits for; then SharedMemoryError when no slot is with the workers either (every
        slot is held by batches the caller keeps): none would come back, waiting would only time out."""
        slot = self._ring.try_acquire()
        if slot is None:
            if may_raise and not self._ring.busy:
                raise self._ring.shortage()
            return False
        self._ring.busy.add(slot)
        self._send_task((run, seq, epoch, slot, self._ring.paths[slot], bids))
        inflight[seq] = (slot, bids)
        return True

    def _predispatch(self, epoch: int) -> None:
        """Start the first batches of the next epoch while this one drains (its plan is a pure
        function of the epoch), so the pipeline does not run dry at the epoch boundary. Kept
        in ``self._pre`` and adopted by the next ``iter()`` if it starts that epoch at batch 0;
        otherwise dropped (its replies are recognised by their run id)."""
        self._run_id += 1
        ids, displacement = self.loader._epoch_plan(epoch)
        batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        pre = {"run": self._run_id, "epoch": epoch, "ids": ids, "batches": batches, "inflight": {},
               "pending": {}, "next": 0, "displacement": displacement, "counters": {}}
        while pre["next"] < min(len(batches), self.prefetch_batches):
            if not self._dispatch(pre["run"], epoch, pre["next"], batches[pre["next"]], pre["inflight"]):
                break
            pre["next"] += 1
        self._pre = pre
        if self._prefetcher is not None:  # the prefetcher moves on to the next epoch's plan now
            pre["pf_boundary"] = list(self._pf_counters)  # its work from here on is the next epoch's
            self._pf_prev_done.value = self._pf_done.value
            self._pf_pos.value = pre["next"] * self.batch_size
            self._pf_done.value = 0
            self._pf_send((pre["run"], *block_schedule(self.dataset, ids)))

    def _take_pre(self, epoch: int, start: int):
        """The pre-dispatched next epoch, if it is the one starting now; else drop it."""
        pre, self._pre = self._pre, None
        if pre is not None and pre["epoch"] == epoch and start == 0:
            return pre
        return None

    def _parallel(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry=None):
        pending: dict[int, tuple] = carry["pending"] if carry else {}
        try:
            yield from self._parallel_run(run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending)
        finally:  # replies never yielded (an epoch cut short, an error): their slots are free again
            for msg in pending.values():
                self._ring.release(msg[4])
            pending.clear()

    def _parallel_run(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending):
        inflight: dict[int, tuple] = carry["inflight"] if carry else {}
        next_dispatch = carry["next"] if carry else 0
        for seq in range(len(batches)):
            deadline = time.monotonic() + self.timeout_s
            while True:  # dispatch what slots allow (again after each reply: it may free one), then wait
                while next_dispatch < len(batches) and len(inflight) < self.prefetch_batches:
                    if not self._dispatch(run, epoch, next_dispatch, batches[next_dispatch], inflight,
                                          may_raise=next_dispatch <= seq):  # (the batch now due)
                        break  # shared memory is short: more go out as slots come back
                    next_dispatch += 1
                    if self._prefetcher is not None and self._pre is None:
                        self._pf_pos.value = next_dispatch * self.batch_size
                if (next_dispatch == len(batches) and self._pre is None and self.state.resume_batch == 0
                        and self.state.epoch == epoch + 1 and self.loader.prefetch_next_epoch):
                    self._predispatch(epoch + 1)
                if seq in pending:
                    break
                msg = self._reply(0.25)  # dead workers are replaced meanwhile (respawn.py)
                if msg is None:
                    self._check_workers()
                    # a replacement decodes its batches again: the wait starts over from it
                    if time.monotonic() > max(deadline, self._restarted_at + self.timeout_s):
                        raise self._stall_error(seq, epoch) from None
                    continue
                kind, wid, mrun = msg[0], msg[1], msg[2]
                self._ring.busy.discard(msg[4])
                if mrun != run:
                    if self._pre is not None and mrun == self._pre["run"]:
                        self._pre["pending"][msg[3]] = msg  # the next epoch's, early: keep it
                        self._pre["counters"][wid] = msg[8]  # its work counts in the next epoch
                    else:  # a reply to an abandoned epoch: just free its slot
                        self._worker_counters[wid] = msg[8]
                        self._ring.release(msg[4])
                    continue
                self._worker_counters[wid] = msg[8]
                pending[msg[3]] = msg  # errors too: raised when their batch is due, in plan order
            msg = pending.pop(seq)
            if msg[0] == "error":
                _, wid, _, _, slot, key, err, tb, _ = msg
                self._ring.release(slot)
                raise WorkerError(f"worker {wid} failed on sample {key!r} (epoch {epoch}, batch {self.state.position[1]}): {err}\n{tb}")
            slot, n, skipped, skipped_keys = msg[4:8]
            bids = inflight.pop(seq)[1]
            if seq % 8 == 7 or seq == len(batches) - 1:  # a syscall: not on every batch
                self._check_prefetcher()
            out = self._deliver(epoch, slot, bids, n, skipped, skipped_keys, msg[9], stats=stats, delivered=delivered)
            if out is None:  # every sample of the batch was skipped: yield nothing for it
                self.state.position = (epoch, self.state.position[1] + 1)
                continue
            wait_box[0] += time.perf_counter() - t_resume
            self.state.position = (epoch, self.state.position[1] + 1)
            if self._prefetcher is not None:  # positions in this epoch's plan
                if self._pre is None:
                    self._pf_done.value = (seq + 1) * self.batch_size
                else:  # the prefetcher is on the next plan already: this one's progress is "previous"
                    self._pf_prev_done.value = (seq + 1) * self.batch_size
            yield out
            t_resume = time.perf_counter()
