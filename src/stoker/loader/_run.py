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
import mmap
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import WorkerError
from . import inflight as infl
from .config import RunConfig
from .epoch_stats import EpochStats, account, fill_from_counters, fill_origin_figures, process_cpu_s
from .launch import start_context, wait_ready
from .pool import WorkerPool
from .prefetch import block_schedule
from .prefetcher import Prefetcher
from .shm import SlotRing
from .split import join_replies, split_ids
from .workers import BatchDecoder, counters

log = logging.getLogger(__name__)

__all__ = ["Processes", "Run", "RunHooks"]


@dataclass(frozen=True)
class RunHooks:
    """What a started pipeline gets from the Loader that owns it (explicit collaborators, so the
    pipeline never reads the Loader's attributes).

    Attributes:
        state: the Loader's :class:`~stoker.loader.state.LoaderState`, advanced as batches are yielded.
        plan: ``plan(epoch) -> (sample ids int64 (n,), mean displacement)``: the order served in ``epoch``.
        record: called with each epoch's :class:`EpochStats` when the epoch ends (finished or cut short).
        live: the Loader's :class:`~stoker.loader.live.LiveTotals` (``begin``/``tick``/``end``).
        device_decoder: ``device_decoder() -> DeviceBatchDecoder | None``: the decoder of
            ``decode_device`` (made on the first call, after the processes are forked), or None.
    """

    state: Any
    plan: Callable
    record: Callable
    live: Any
    device_decoder: Callable


@dataclass(frozen=True)
class Processes:
    """A started pipeline's processes, for inspection (tests, benchmarks, fault injection).

    Attributes:
        workers: the decode worker processes (``multiprocessing.Process``), one per worker slot
            (a replaced one is not among them).
        prefetcher: the prefetch process, or None (no node cache, no workers, or none started).
        start_method: the start method they were started with, or None before a start.
        ready: processes that finished their own start (object store client, decoder).
    """

    workers: tuple = ()
    prefetcher: Any = None
    start_method: str | None = None
    ready: int = 0

    def pids(self) -> list[int]:
        """The workers' pids, then the prefetcher's."""
        return [p.pid for p in self.workers] + ([self.prefetcher.pid] if self.prefetcher is not None else [])


class Run:
    """The started pipeline of one loader (see the module docstring), built from parts that own
    their state: a :class:`~stoker.loader.pool.WorkerPool`, a
    :class:`~stoker.loader.prefetcher.Prefetcher` (with a node cache and workers), a
    :class:`~stoker.loader.shm.SlotRing` and, for ``device="cuda"``, a
    :class:`~stoker.loader.transfer.DeviceTransfer`.

    Args:
        config: the frozen :class:`~stoker.loader.config.RunConfig`.
        hooks: the Loader's :class:`RunHooks` (state, plan, stats, live figures, device decoder).
    """

    def __init__(self, config: RunConfig, hooks: RunHooks):
        self.config, self.hooks = config, hooks
        self.state = hooks.state
        self.dataset, self.cfg = config.dataset, config.cfg
        self.num_workers, self.batch_size = config.num_workers, config.batch_size
        self.prefetch_batches, self.timeout_s = config.prefetch_batches, config.timeout_s
        self.start_method = config.start_method  #: the start method used, once started
        self.workers: WorkerPool | None = None
        self.prefetcher: Prefetcher | None = None
        self.ring: SlotRing | None = None
        self.transfer = None  #: the :class:`~stoker.loader.transfer.DeviceTransfer`, or None
        self._ready = None  # shared count of processes set up
        self._fork_hazards: list[str] = []
        self._decoder = None
        self._device_decoder = None
        self._own_staging = False
        self._pre: dict | None = None  # the next epoch's first batches, dispatched early
        self._parts: dict[tuple, tuple] = {}  # (run, seq) of a split batch -> (parts, replies so far)
        self._run_id = 0  # one per epoch served: replies carry it, so stale ones are recognised
        self._worker_counters: dict[int, dict] = {}  # worker id -> its last counters (dead ones kept)
        self._start_s = 0.0  # seconds the next epoch's iter() spent starting this pipeline
        self._live_gen: weakref.ref | None = None  # the last epoch's generator, closed by close()
        self.started = False

    def start(self) -> None:
        """Map the slots and start the processes (or the in-process decoder).

        Raises:
            SharedMemoryError: not one batch slot fits in shared memory (:mod:`stoker.loader.shm`).
            ForkUnsafeError: ``start_method="fork"`` where fork is unsafe.
            TypeError: the user's decode/collate do not pickle under the start method chosen.
            RuntimeError: ``device`` is a CUDA device and CUDA is not available.
        """
        from .. import _torch as _torch_adapter  # pay torch's import before the first batch
        from .. import decode  # noqa: F401 - imported once here, inherited by forked workers
        _torch_adapter.load()
        config = self.config
        if config.device not in (None, "cpu"):
            from .transfer import DeviceTransfer
            self.transfer = DeviceTransfer(config.device)
        self.ring = SlotRing(self.batch_size, self.cfg.image_size, self.prefetch_batches + 2,
                             shared=self.num_workers > 0,  # SharedMemoryError: not one slot fits
                             slot_bytes=mmap.PAGESIZE if self.cfg.generic else None)  # grown by batches.py
        if self.dataset.cache is not None and self.num_workers > 0 and self.dataset.staging is None:
            from ..cache import StagingArea
            self.dataset.staging = StagingArea.create(self.dataset.cache.root,
                                                      getattr(self.dataset.cache, "mode", 0o600),
                                                      config.staging_bytes)
            self._own_staging = True
        self.started = True  # from here on, close() has something to stop
        if self.num_workers > 0:
            self._start_processes()  # ForkUnsafeError: start_method="fork" where fork is unsafe
        elif self.cfg.generic:
            from .batches import GenericDecoder
            self._decoder = GenericDecoder(self.dataset, self.cfg)
        else:
            self._decoder = BatchDecoder(self.dataset, self.cfg)
        self._device_decoder = self.hooks.device_decoder()  # after the forks (CUDA)

    def _start_processes(self) -> None:
        """Choose the start method (again: threads may have appeared since the Loader was built),
        start the workers and, with a node cache, the prefetcher; wait for their own start."""
        ctx, self.start_method, self._fork_hazards = start_context(self.config.start_method, self.cfg)
        self._ready = ctx.Value("q", 0)
        self.workers = WorkerPool(ctx, self.dataset, self.cfg, self.num_workers, self._ready)
        if self.dataset.cache is not None:
            c = self.config
            self.prefetcher = Prefetcher(ctx, self.dataset, fetch_concurrency=c.fetch_concurrency,
                                         prefetch_bytes=c.prefetch_bytes, staging_bytes=c.staging_bytes,
                                         ready=self._ready)
        wait_ready(self._ready, list(self.processes().workers) + (
            [self.prefetcher.process] if self.prefetcher is not None else []))

    def processes(self) -> Processes:
        """The processes now (see :class:`Processes`)."""
        return Processes(workers=self.workers.processes if self.workers is not None else (),
                         prefetcher=self.prefetcher.process if self.prefetcher is not None else None,
                         start_method=self.start_method if self.workers is not None else None,
                         ready=self._ready.value if self._ready is not None else 0)

    def check_processes(self) -> None:
        """Replace every dead worker (WorkerError naming it, its pid, exit code or signal and the
        sample it was on once its slot's restarts are spent), then a dead prefetcher (past its
        bound the epoch goes on without one). The epoch loop does this on its own; public for
        tests that kill processes."""
        if self.workers is not None:
            self.workers.check()
        self._check_prefetcher()

    def _check_prefetcher(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.check()

    def restarts(self) -> tuple[int, int]:
        """(workers, prefetchers) replaced this epoch."""
        return (self.workers.restarts if self.workers is not None else 0,
                self.prefetcher.restarts if self.prefetcher is not None else 0)

    def close(self) -> None:
        """Stop the workers and the prefetcher (3 s to finish, then killed), unlink the shared
        memory and the staging area this run made. Idempotent."""
        if not self.started:
            return
        gen = self._live_gen() if self._live_gen is not None else None
        if gen is not None and gen.gi_frame is not None and not gen.gi_running:
            # an epoch's iterator still held by the caller: end it now, while the processes and
            # the interpreter are up (its stats are final then), not when it is collected at exit
            try:
                gen.close()
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.warning("ending the open epoch at close: %s: %s", type(exc).__name__, exc)
        self.started = False
        self._pre = None
        self._parts = {}
        if self.workers is not None:
            self.workers.signal_stop()
        if self.prefetcher is not None:
            self.prefetcher.signal_stop()
        deadline = time.monotonic() + 3
        if self.workers is not None:
            self.workers.join(deadline)
        if self.prefetcher is not None:
            self.prefetcher.join(deadline)
        if self.ring is not None:
            self.ring.close()
        if self._own_staging:
            self.dataset.staging.clear()
            self.dataset.staging = None
            self._own_staging = False

    def drop_pre(self) -> None:
        """Forget the next epoch's early batches (the loader was moved to another position);
        their replies are recognised by their run id and their slots freed."""
        self._pre = None

    def epoch(self, epoch: int, start: int = 0, start_s: float = 0.0):
        """A generator of the batches of ``epoch`` from batch ``start`` on (see
        :class:`stoker.loader.Loader` for what a batch is). ``stats.first_batch_s`` counts from
        this call; ``start_s``: seconds the loader's ``iter()`` spent starting this pipeline
        (``stats.pipeline_start_s``)."""
        self._run_id += 1
        gen = self._epoch(self._run_id, epoch, start, time.perf_counter())
        self._start_s = start_s
        self._live_gen = weakref.ref(gen)
        return gen

    # -- counters ---------------------------------------------------------
    def _cpu(self) -> dict:
        out = {"main": process_cpu_s(None)}
        procs = self.processes()
        if procs.workers:
            out["workers"] = sum(process_cpu_s(p.pid) for p in procs.workers)
        if procs.prefetcher is not None:
            out["prefetch"] = process_cpu_s(procs.prefetcher.pid)
        return out

    def totals(self) -> dict:
        """Counters summed over the workers, and the prefetcher's clocks and origin retries (its
        origin traffic is read per plan from its ledger, :meth:`prefetch_ledger`)."""
        tot: dict[str, int] = {}
        sources = (list(self._worker_counters.values()) if self.num_workers > 0
                   else [counters(self.dataset, self.cfg.derived)])
        for c in sources:
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        if self.prefetcher is not None:
            pf = self.prefetcher.totals()
            pf["origin_retries"] += tot.get("origin_retries", 0)
            tot.update(pf)
        return tot

    def prefetch_ledger(self, run: int) -> dict:
        """The prefetcher's origin traffic charged to plan ``run`` (empty without a prefetcher),
        with its in-flight target, latency and bandwidth estimates now."""
        return self.prefetcher.ledger(run) if self.prefetcher is not None else {}

    def _epoch(self, run: int, epoch: int, start: int = 0, t_iter: float | None = None):
        t_start = time.perf_counter()
        t_iter = t_start if t_iter is None else t_iter
        stats = EpochStats(epoch=epoch)
        stats.pipeline_start_s, self._start_s = self._start_s, 0.0
        if self.num_workers > 0:
            self.workers.new_epoch()
            if self.prefetcher is not None:
                self.prefetcher.new_epoch()
        carry = self._take_pre(epoch, start) if self.num_workers > 0 else None
        if carry is not None:
            run, ids, batches = carry["run"], carry["ids"], carry["batches"]
            stats.order_displacement = carry["displacement"]
        else:
            ids, stats.order_displacement = self.hooks.plan(epoch)
            ids = ids[start * self.batch_size:]
            batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        self.state.position = (epoch, start)
        if start == 0:
            self.state.carry = None  # a streaming collate's carry never crosses an epoch
        # the prefetcher's traffic for this epoch, also what it did while the previous one drained,
        # is in its ledger row of this plan; the workers' early replies count here (carry)
        before = self.totals()
        if carry is not None:  # workers' counters as of their early replies for this epoch
            self._worker_counters.update(carry["counters"])
        cpu_before = self._cpu()
        delivered: list = []  # the sample ids of each delivered batch (counted at the end)
        if self.prefetcher is not None and carry is None:  # (a pre-dispatched epoch sent its plan)
            self.prefetcher.position = 0
            self.prefetcher.done = 0
            self.prefetcher.send((run, *block_schedule(self.dataset, ids)))
        wait_box = [0.0]  # seconds blocked in next(), also when the epoch is cut short
        t_resume = time.perf_counter()
        self.hooks.live.begin(self, stats, before, wait_box, t_start, plan=run)  # live figures (loader/live.py)
        try:
            if self.num_workers == 0:
                for seq, bids in enumerate(batches):
                    last = seq == len(batches) - 1
                    if self.cfg.generic:  # the user's decode/collate, here; no slot
                        n, sk, sk_keys, batch = self._decoder.run(epoch, bids)
                        out = self._deliver(epoch, None, bids, n, sk, sk_keys, None,
                                            None if batch is None else ("local", batch),
                                            stats=stats, delivered=delivered, last=last)
                    else:
                        slot = self.ring.acquire()
                        out = self._deliver(epoch, slot, bids, *self._decoder.run(epoch, bids, *self.ring.views(slot)),
                                            stats=stats, delivered=delivered)
                    if out is None:  # every sample of the batch was skipped: yield nothing for it
                        self.state.position = (epoch, start + seq + 1)
                        continue
                    wait_box[0] += time.perf_counter() - t_resume
                    self.state.position = (epoch, start + seq + 1)
                    self.hooks.live.tick()
                    if not stats.first_batch_s:
                        stats.first_batch_s = time.perf_counter() - t_iter
                    yield out
                    t_resume = time.perf_counter()
            else:
                yield from self._parallel(run, epoch, batches, stats, delivered, t_resume, wait_box, carry, t_iter)
        finally:
            stats.seconds = time.perf_counter() - t_start
            stats.worker_restarts, stats.prefetcher_restarts = self.restarts()
            stats.cpu_s = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in self._cpu().items()}
            after = self.totals()
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            ledger = self.prefetch_ledger(run)
            for k in infl.LEDGER_FIELDS[1:]:
                d[k] = d.get(k, 0) + ledger.get(k, 0)
            fill_from_counters(stats, d, wait_box[0], ids, delivered, len(self.dataset))
            fill_origin_figures(stats, d, ledger, self.num_workers)
            self.hooks.record(stats)
            self.hooks.live.end(stats, d)
            if self.state.position[0] == epoch and self.state.epoch == epoch + 1:  # no later iter()/set_epoch/load
                if self.state.position[1] == start + len(batches):  # every batch done (yielded or all skipped)
                    self._report_epoch(stats)
                self.state.position = (epoch + 1, 0)  # done or cut short: the next iter() (and a resume) runs epoch + 1
                self.state.carry = None

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

    def _deliver(self, epoch, slot, bids, n, skipped, skipped_keys, payloads, generic=None, *, stats, delivered,
                 last=False):
        """Account for one finished batch and turn slot ``slot`` into what ``next()`` yields:
        tensors over the slot (or on ``device``), or the device decode of the workers'
        ``payloads`` (the slot is then released at once), or the user's collated batch
        (``generic``, the worker's reply of :func:`stoker.loader.batches.pack_reply`; ``last``: the
        epoch's last batch, where a streaming collate flushes its carry). None when every sample
        was skipped (or a streaming collate carried every token to the next batch)."""
        if self.cfg.generic:
            return self._deliver_generic(slot, bids, skipped, skipped_keys, generic, stats, delivered, last)
        if payloads is not None:
            labels = self.ring.views(slot)[1][:n].copy()
            self.ring.release(slot)
            images, labels, more, more_keys = self._device_decoder(epoch, payloads, labels)
            account(stats, bids, list(skipped) + more, list(skipped_keys) + more_keys, delivered)
            return None if images is None else (images, labels)
        account(stats, bids, skipped, skipped_keys, delivered)
        if n == 0:
            self.ring.release(slot)
            return None
        imgs, labels = self.ring.batch(slot, n)
        return self._as_batch(imgs, labels)

    def _deliver_generic(self, slot, bids, skipped, skipped_keys, reply, stats, delivered, last):
        from .batches import receive, to_device
        account(stats, bids, skipped, skipped_keys, delivered)
        batch = receive(self.ring, slot, reply, stats)
        cut = getattr(self.cfg.collate, "cut", None)  # a streaming collate (stoker.collate.PackTokens)
        if cut is not None and (batch is not None or (last and self.state.carry is not None)):
            if batch is None:
                batch = {"tokens": self.state.carry[:0]}
            batch, self.state.carry = cut(self.state.carry, batch, last)
        if batch is None:
            return None
        return batch if self.transfer is None else to_device(batch, self.transfer.device)

    def _as_batch(self, imgs, labels):
        """Tensors over the slot (no copy), or on ``device`` through :mod:`stoker.loader.transfer`."""
        from .._torch import as_tensors
        out = as_tensors(imgs, labels)
        return out if self.transfer is None else self.transfer(*out)

    def _dispatch(self, run: int, epoch: int, seq: int, bids, inflight: dict, may_raise: bool = False,
                  split: bool = False) -> bool:
        """Send batch ``seq`` to the workers; False (nothing sent) when no slot is free and
        shared memory has no room for another. ``may_raise``: batch ``seq`` is the one the
        consumer waits for; then SharedMemoryError when no slot is with the workers either (every
        slot is held by batches the caller keeps): none would come back, waiting would only time out.
        ``split``: the first batch of an epoch, decoded by every worker at once (:mod:`.split`)."""
        slot = self.ring.try_acquire()
        if slot is None:
            if may_raise and not self.ring.busy:
                raise self.ring.shortage()
            return False
        self.ring.busy.add(slot)
        parts = [(0, bids)]
        if split and self.num_workers > 1 and not self.cfg.generic and self.cfg.decode_on == "cpu":
            parts = split_ids(bids, self.num_workers)
        if len(parts) > 1:
            self._parts[(run, seq)] = (len(parts), [])
        for offset, ids in parts:
            self.workers.send((run, seq, epoch, slot, self.ring.paths[slot], ids, offset))
        inflight[seq] = (slot, bids)
        return True

    def _keep_counters(self, msg: tuple, run: int) -> None:
        """Record the worker counters a reply carries (every reply, each part of a split batch
        too), where its run counts them: the pre-dispatched next epoch's own, else this run's (a
        reply to an abandoned epoch counts here as well)."""
        pre = self._pre
        if msg[2] != run and pre is not None and msg[2] == pre["run"]:
            pre["counters"][msg[1]] = msg[8]
        else:
            self._worker_counters[msg[1]] = msg[8]

    def _whole(self, msg: tuple):
        """The reply of a whole batch: ``msg`` itself, or for a part of a split batch None until
        its last part came, then the joined reply (:func:`.split.join_replies`)."""
        key = (msg[2], msg[3])
        if key not in self._parts:
            return msg
        left, msgs = self._parts[key]
        msgs.append(msg)
        if left > len(msgs):
            return None
        del self._parts[key]
        images, labels = self.ring.views(msg[4])
        return join_replies(msgs, images, labels)

    def _predispatch(self, epoch: int) -> None:
        """Start the first batches of the next epoch while this one drains (its plan is a pure
        function of the epoch), so the pipeline does not run dry at the epoch boundary. Kept
        in ``self._pre`` and adopted by the next ``iter()`` if it starts that epoch at batch 0;
        otherwise dropped (its replies are recognised by their run id)."""
        self._run_id += 1
        ids, displacement = self.hooks.plan(epoch)
        batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        pre = {"run": self._run_id, "epoch": epoch, "ids": ids, "batches": batches, "inflight": {},
               "pending": {}, "next": 0, "displacement": displacement, "counters": {}}
        while pre["next"] < min(len(batches), self.prefetch_batches):
            if not self._dispatch(pre["run"], epoch, pre["next"], batches[pre["next"]], pre["inflight"],
                                  split=pre["next"] == 0):
                break
            pre["next"] += 1
        self._pre = pre
        pf = self.prefetcher
        if pf is not None:  # the prefetcher moves on to the next epoch's plan now
            pf.prev_done = pf.done
            pf.position = pre["next"] * self.batch_size
            pf.done = 0
            # draining: blocks this epoch still needs are charged to it, not to the next one
            pf.send((pre["run"], *block_schedule(self.dataset, ids), True))

    def _pf_plan_done(self, run: int) -> bool:
        """Whether the prefetcher has fetched (or given up) every block of plan ``run``: only then
        do the next epoch's first batches start, so that their reads never fetch a block this
        epoch still needs and charge it to the next one (True without a working prefetcher)."""
        return self.prefetcher is None or self.prefetcher.plan_done(run)

    def _take_pre(self, epoch: int, start: int):
        """The pre-dispatched next epoch, if it is the one starting now; else drop it."""
        pre, self._pre = self._pre, None
        if pre is not None and pre["epoch"] == epoch and start == 0:
            return pre
        return None

    def _parallel(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry=None, t_iter=None):
        pending: dict[int, tuple] = carry["pending"] if carry else {}
        try:
            yield from self._parallel_run(run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending,
                                          t_iter)
        finally:  # replies never yielded (an epoch cut short, an error): their slots are free again
            for msg in pending.values():
                self.ring.release(msg[4])
            pending.clear()

    def _parallel_run(self, run, epoch, batches, stats, delivered, t_resume, wait_box, carry, pending, t_iter):
        inflight: dict[int, tuple] = carry["inflight"] if carry else {}
        next_dispatch = carry["next"] if carry else 0
        for seq in range(len(batches)):
            deadline = time.monotonic() + self.timeout_s
            while True:  # dispatch what slots allow (again after each reply: it may free one), then wait
                while next_dispatch < len(batches) and len(inflight) < self.prefetch_batches:
                    if not self._dispatch(run, epoch, next_dispatch, batches[next_dispatch], inflight,
                                          may_raise=next_dispatch <= seq,  # (the batch now due)
                                          split=next_dispatch == 0):
                        break  # shared memory is short: more go out as slots come back
                    next_dispatch += 1
                    if self.prefetcher is not None and self._pre is None:
                        self.prefetcher.position = next_dispatch * self.batch_size
                if (next_dispatch == len(batches) and self._pre is None and self.state.resume_batch == 0
                        and self.state.epoch == epoch + 1 and self.config.prefetch_next_epoch
                        and self._pf_plan_done(run)):
                    self._predispatch(epoch + 1)
                if seq in pending:
                    break
                msg = self._reply(0.25)  # dead workers are replaced meanwhile (pool.py)
                if msg is None:
                    self.check_processes()
                    # a replacement decodes its batches again: the wait starts over from it
                    if time.monotonic() > max(deadline, self._restarted_at() + self.timeout_s):
                        raise self._stall_error(seq, epoch) from None
                    continue
                self._keep_counters(msg, run)  # the next epoch's early work counts in the next epoch
                msg = self._whole(msg)
                if msg is None:  # a part of a split batch; the others are still being decoded
                    continue
                mrun = msg[2]
                self.ring.busy.discard(msg[4])
                if mrun != run:
                    if self._pre is not None and mrun == self._pre["run"]:
                        self._pre["pending"][msg[3]] = msg  # the next epoch's, early: keep it
                    else:  # a reply to an abandoned epoch: just free its slot
                        self.ring.release(msg[4])
                    continue
                pending[msg[3]] = msg  # errors too: raised when their batch is due, in plan order
            msg = pending.pop(seq)
            if msg[0] == "error":
                _, wid, _, _, slot, key, err, tb = msg[:8]
                self.ring.release(slot)
                raise WorkerError(f"worker {wid} failed on sample {key!r} (epoch {epoch}, batch {self.state.position[1]}): "
                                  f"{err}\n{tb}") from msg[9]  # the worker's own stoker error, or None (workers.py)
            slot, n, skipped, skipped_keys = msg[4:8]
            bids = inflight.pop(seq)[1]
            if seq % 8 == 7 or seq == len(batches) - 1:  # a syscall: not on every batch
                self._check_prefetcher()
            out = self._deliver(epoch, slot, bids, n, skipped, skipped_keys, msg[9], msg[10], stats=stats,
                                delivered=delivered, last=seq == len(batches) - 1)
            if out is None:  # every sample of the batch was skipped: yield nothing for it
                self.state.position = (epoch, self.state.position[1] + 1)
                continue
            wait_box[0] += time.perf_counter() - t_resume
            self.state.position = (epoch, self.state.position[1] + 1)
            if self.prefetcher is not None:  # positions in this epoch's plan
                if self._pre is None:
                    self.prefetcher.done = (seq + 1) * self.batch_size
                else:  # the prefetcher is on the next plan already: this one's progress is "previous"
                    self.prefetcher.prev_done = (seq + 1) * self.batch_size
            self.hooks.live.tick()
            if not stats.first_batch_s:
                stats.first_batch_s = time.perf_counter() - t_iter
            yield out
            t_resume = time.perf_counter()

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

    def _stall_error(self, seq: int, epoch: int) -> WorkerError:
        """The error for ``timeout_s`` without the batch due: what each worker was doing, and the
        fork hazards of the training process if the workers were forked anyway."""
        msg = (f"no batch from the workers for {self.timeout_s:.0f} s (batch {seq} of epoch {epoch}): "
               + self.workers.describe())
        if self.start_method == "fork" and self._fork_hazards:
            msg += "; the workers were forked from a process with " + "; ".join(self._fork_hazards)
        elif self.workers.idle():
            msg += " (no worker is reading or decoding: none took the task, or their replies are lost)"
        return WorkerError(msg)
