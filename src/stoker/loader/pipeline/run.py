"""One started pipeline of a :class:`stoker.loader.Loader`: its processes, queues, shared-memory
slots and prefetcher, and the epoch loop that turns them into batches (this folder's README.md
says what starts and stops it; the data flow and the processes: loader/README.md).
"""

from __future__ import annotations

import logging
import mmap
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..._procs import EXIT_UNGUARDED_MAIN, exit_quietly, importing_main_in_child
from ..epoch_stats import EpochStats, fill_from_counters, fill_origin_figures, process_cpu_s
from ..iterator import EpochIterator
from ..options import RunConfig
from ..prefetch import inflight as infl
from ..prefetch.prefetcher import Prefetcher
from ..prefetch.process import block_schedule
from ..shm import SlotRing
from ..workers.inline import InlineLoop
from ..workers.launch import start_context, wait_ready
from ..workers.pool import WorkerPool
from ..workers.sharedpickle import SharedPickle, share
from ..workers.worker import BatchDecoder, counters
from .deliver import Delivery
from .dispatch import Dispatcher
from .parallel import ParallelLoop

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized

    from ..device.transfer import DeviceTransfer
    from ..workers.batches import GenericDecoder
    from ..workers.rawbatch import RawBatchesHere

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
        device_decoder: the :class:`~stoker.loader.device.device_decode.DeviceBatchDecoder` of
            ``decode_device`` (started by :meth:`Run.start`, after the processes are forked), or None.
    """

    state: Any
    plan: Callable
    record: Callable
    live: Any
    device_decoder: Any


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
    their state: a :class:`~stoker.loader.shm.SlotRing` (``ring``), with workers a
    :class:`~stoker.loader.workers.pool.WorkerPool` (``workers``), a
    :class:`~stoker.loader.pipeline.dispatch.Dispatcher` (``dispatch``) and a
    :class:`~stoker.loader.pipeline.parallel.ParallelLoop` (``loop``), with a node cache too a
    :class:`~stoker.loader.prefetch.prefetcher.Prefetcher` (``prefetcher``), a
    :class:`~stoker.loader.pipeline.deliver.Delivery` (``deliver``) and, for ``device="cuda"``, a
    :class:`~stoker.loader.device.transfer.DeviceTransfer` (``transfer``: batches copied from the
    pinned slots).

    Args:
        config: the frozen :class:`~stoker.loader.options.RunConfig`.
        hooks: the Loader's :class:`RunHooks` (state, plan, stats, live figures, device decoder).
    """

    def __init__(self, config: RunConfig, hooks: RunHooks):
        self.config, self.hooks = config, hooks
        self.state = hooks.state
        self.dataset, self.cfg = config.dataset, config.cfg  # dataset: a view with this run's staging, once started
        self.start_method = config.run.start_method or "fork"  #: the start method used (chosen again at start)
        self.workers: WorkerPool | None = None
        self.prefetcher: Prefetcher | None = None
        self.ring: SlotRing | None = None
        self.transfer: DeviceTransfer | None = None  #: for ``device="cuda"``
        self._ready: Synchronized[int] | None = None  # shared count of processes set up
        self._fork_hazards: list[str] = []
        self._shipped: SharedPickle | None = None  # the dataset as spawned processes receive it
        self._decoder: BatchDecoder | GenericDecoder | RawBatchesHere | None = None  # without workers: decodes here
        self._own_staging = False
        self.deliver: Delivery | None = None  # turns a finished batch into what next() yields
        self.dispatch: Dispatcher | None = None  # sends batches to the workers (with workers)
        self.loop: ParallelLoop | None = None  # the epoch loop over the workers' replies (with workers)
        self.inline: InlineLoop | None = None  # the epoch loop decoding here (without workers)
        self._run_id = 0  # one per epoch served without workers (with them: the dispatcher's)
        self._start_s = 0.0  # seconds the next epoch's iter() spent starting this pipeline
        self._live_iter: weakref.ref | None = None  # the last epoch's iterator, ended by close() or the next epoch
        self.started = False

    def start(self) -> None:
        """Map the slots and start the processes (or the in-process decoder).

        Raises:
            SharedMemoryError: not one batch slot fits in shared memory (:mod:`stoker.loader.shm`).
            ForkUnsafeError: ``start_method="fork"`` where fork is unsafe.
            TypeError: the user's decode/collate do not pickle under the start method chosen.
            RuntimeError: ``device`` is a CUDA device and CUDA is not available.
            WorkerStartError: a worker or the prefetch process exited before its own start was done
                (names the cause; :mod:`stoker.loader.workers.launch`).

        In a worker or prefetch process that runs the user's training code (the main script
        imported again by spawn/forkserver, without the ``__main__`` guard), the process exits
        here, quietly, with :data:`stoker._procs.EXIT_UNGUARDED_MAIN`: the training process names
        the cause.
        """
        if self.config.num_workers > 0 and importing_main_in_child():
            exit_quietly(EXIT_UNGUARDED_MAIN)
        from ... import _torch as _torch_adapter  # pay torch's import before the first batch

        _torch_adapter.load()  # first: on a thread, so that nothing keeps this stack (see there)
        from ... import decode  # noqa: F401 - imported once here, inherited by forked workers

        config = self.config
        self.ring = SlotRing(
            self.cfg.batch_size,
            self.cfg.image_size,
            config.prefetch_batches + 2,
            shared=config.num_workers > 0,  # SharedMemoryError: not one slot fits
            slot_bytes=mmap.PAGESIZE if self.cfg.generic else None,
        )  # grown by batches.py
        if self._fills_cache() and config.num_workers > 0 and self.dataset.reader.staging is None:
            from ...cache import StagingArea
            from ...store.blocks import BlockReader

            ds = self.dataset  # shared (other loaders may read it): this run reads a view with its own staging
            staging = StagingArea.create(
                ds.cache.root, getattr(ds.cache, "mode", 0o600), int(config.read.staging_bytes)
            )
            self.dataset = ds.with_reader(BlockReader(ds, staging=staging, router=ds.reader.router))
            self._own_staging = True
        self.started = True  # from here on, close() has something to stop
        if config.num_workers > 0:
            self._start_processes()  # ForkUnsafeError: start_method="fork" where fork is unsafe
        elif self.cfg.generic:
            from ..workers.batches import GenericDecoder
            from ..workers.rawbatch import RawBatchesHere, reads_raw

            self._decoder = (RawBatchesHere if reads_raw(self.cfg) else GenericDecoder)(self.dataset, self.cfg)
        else:
            self._decoder = BatchDecoder(self.dataset, self.cfg)
        if config.device not in (None, "cpu"):  # after the forks (CUDA)
            from ..device.transfer import DeviceTransfer

            self.transfer = DeviceTransfer(self.ring, config.device)
        dd = self.hooks.device_decoder  # started after the forks (CUDA)
        self.deliver = Delivery(self.ring, self.cfg, self.state, self.transfer, dd.start() if dd is not None else None)
        if self._decoder is not None:
            self.inline = InlineLoop(
                self.config, self.state, self.hooks.live, self._decoder, self.ring, self.deliver, self.dataset
            )
        if self.dispatch is not None:
            self.loop = ParallelLoop(
                self.config,
                self.state,
                self.hooks.live,
                self.workers,
                self.prefetcher,
                self.dispatch,
                self.deliver,
                start_method=self.start_method,
                fork_hazards=self._fork_hazards,
            )

    def _fills_cache(self) -> bool:
        """Whether this run fills a node cache (a prefetcher and a staging area): there is one,
        and it is not read-only (:class:`stoker.cache.readonly.ReadOnlyCache` is served as it is)."""
        cache = self.dataset.cache
        return cache is not None and not getattr(cache, "read_only", False)

    def _start_processes(self) -> None:
        """Choose the start method (again: threads may have appeared since the Loader was built),
        start the workers and, with a node cache, the prefetcher; wait for their own start."""
        ctx, self.start_method, self._fork_hazards = start_context(self.config.run.start_method, self.cfg)
        self._ready = ctx.Value("q", 0)
        # spawn/forkserver: pickled once, its arrays in one shared file that every process maps
        self._shipped = share(self.dataset) if self.start_method != "fork" else None
        self.workers = WorkerPool(ctx, self.dataset, self.cfg, self.config.num_workers, self._ready, self._shipped)
        if self._fills_cache():
            self.prefetcher = Prefetcher(ctx, self.dataset, self.config.read, ready=self._ready, shipped=self._shipped)
        self.dispatch = Dispatcher(self.config, self.hooks.plan, self.ring, self.workers, self.prefetcher)
        wait_ready(
            self._ready,
            list(self.processes().workers) + ([self.prefetcher.process] if self.prefetcher is not None else []),
        )
        self.check_processes()  # one that died starting: WorkerStartError naming why, now

    def processes(self) -> Processes:
        """The processes now (see :class:`Processes`)."""
        return Processes(
            workers=self.workers.processes if self.workers is not None else (),
            prefetcher=self.prefetcher.process if self.prefetcher is not None else None,
            start_method=self.start_method if self.workers is not None else None,
            ready=self._ready.value if self._ready is not None else 0,
        )

    def check_processes(self) -> None:
        """Replace every dead worker (WorkerError naming it, its pid, exit code or signal and the
        sample it was on once its slot's restarts are spent), then a dead prefetcher (past its
        bound the epoch goes on without one). The epoch loop does this on its own; public for
        tests that kill processes."""
        if self.workers is not None:
            self.workers.check()
        if self.prefetcher is not None:
            self.prefetcher.check()

    def restarts(self) -> tuple[int, int]:
        """(workers, prefetchers) replaced this epoch."""
        return (
            self.workers.restarts if self.workers is not None else 0,
            self.prefetcher.restarts if self.prefetcher is not None else 0,
        )

    def close(self) -> None:
        """Stop the workers and the prefetcher (3 s to finish, then killed), unlink the shared
        memory and the staging area this run made. Idempotent."""
        if not self.started:
            return
        it = self._live_iter() if self._live_iter is not None else None
        if it is not None and it.running:
            # an epoch's iterator still held by the caller: end it now, while the processes and
            # the interpreter are up (its stats are final then), not when it is collected at exit
            try:
                it.close()
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.warning("ending the open epoch at close: %s: %s", type(exc).__name__, exc)
        self.started = False
        if self.inline is not None:
            self.inline.close()
        if self.dispatch is not None:
            self.dispatch.reset()
        if self.workers is not None:
            self.workers.signal_stop()
        if self.prefetcher is not None:
            self.prefetcher.signal_stop()
        deadline = time.monotonic() + 3
        if self.workers is not None:
            self.workers.join(deadline)
        if self.prefetcher is not None:
            self.prefetcher.join(deadline)
        if self._shipped is not None:  # the processes' mappings, if any is left, keep its memory
            self._shipped.close()
            self._shipped = None
        if self.transfer is not None:  # copies in flight done, every slot unregistered: then unmapped
            self.transfer.close()
        if self.ring is not None:
            self.ring.close()
        if self._own_staging:
            self.dataset.reader.staging.clear()
            self.dataset = self.config.dataset
            self._own_staging = False

    def drop_pre(self) -> None:
        """Forget the next epoch's early batches (the loader was moved to another position);
        their replies are recognised by their run id and their slots freed."""
        if self.dispatch is not None:
            self.dispatch.pre = None

    def end_live(self, by: str | None = None, epoch: int | None = None) -> None:
        """End the epoch being iterated, if one is (its stats final, its slots free): its next
        ``next()`` raises :class:`~stoker.errors.StaleIteratorError` naming ``by``, what ended it
        (None: a later ``iter()``, which starts ``epoch``;
        :meth:`stoker.loader.iterator.EpochIterator.replace`)."""
        old = self._live_iter() if self._live_iter is not None else None
        if old is not None and old.running:
            old.replace(old.epoch if epoch is None else epoch, by)

    def epoch(self, epoch: int, start: int = 0, start_s: float = 0.0, owner=None) -> EpochIterator:
        """The batches of ``epoch`` from batch ``start`` on (see :class:`stoker.loader.Loader` for
        what a batch is), as an :class:`~stoker.loader.iterator.EpochIterator` that keeps
        ``owner`` (the Loader) alive. The previous epoch's iterator, if still open, is ended now
        and refuses its next ``next()`` (one epoch at a time). ``stats.first_batch_s`` counts from
        this call; ``start_s``: seconds the loader's ``iter()`` spent starting this pipeline
        (``stats.pipeline_start_s``)."""
        self.end_live(epoch=epoch)
        it = EpochIterator(self._epoch(self._new_run(), epoch, start, time.perf_counter()), epoch, owner)
        self._start_s = start_s
        self._live_iter = weakref.ref(it)
        return it

    def _new_run(self) -> int:
        """A new run id (the dispatcher's with workers)."""
        if self.dispatch is not None:
            return self.dispatch.new_run()
        self._run_id += 1
        return self._run_id

    def reopen(self, epoch: int) -> bool:
        """Make the last epoch's iterator serve ``epoch`` from its first batch instead, if no batch
        of it was asked for yet (:func:`stoker.loader.adapters.follow_epoch`). Returns whether it did;
        the next epoch's early batches, if any were sent, are forgotten."""
        it = self._live_iter() if self._live_iter is not None else None
        if it is None or not it.unstarted:
            return False
        self.drop_pre()
        it.restart(self._epoch(self._new_run(), epoch, 0, time.perf_counter()), epoch)
        return True

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
        origin traffic is read per plan from its ledger, :meth:`since`)."""
        tot: dict[str, int] = {}
        sources = (
            list(self.dispatch.worker_counters.values())
            if self.dispatch is not None
            else [counters(self.dataset, self.cfg.derived, self._decoder)]
        )
        for c in sources:
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        if self.prefetcher is not None:
            pf = self.prefetcher.totals()
            pf["origin_retries"] += tot.get("origin_retries", 0)
            tot.update(pf)
        return tot

    def since(self, before: dict, plan: int | None) -> tuple[dict, dict]:
        """``(change, ledger)``: the change of :meth:`totals` since ``before`` (read again when
        another thread adds a worker's counters meanwhile; empty after three tries), with the
        prefetcher's origin traffic charged to plan ``plan`` added; and that ledger row, with the
        in-flight target, latency and bandwidth estimates now (empty without a prefetcher or plan)."""
        now: dict = {}
        for _ in range(3):
            try:
                now = self.totals()
                break
            except RuntimeError:  # (a dict changed size during iteration)
                continue
        change = {k: v - before.get(k, 0) for k, v in now.items()}
        ledger = self.prefetcher.ledger(plan) if self.prefetcher is not None and plan is not None else {}
        for k in infl.LEDGER_FIELDS[1:]:
            change[k] = change.get(k, 0) + ledger.get(k, 0)
        return change, ledger

    def _epoch(self, run: int, epoch: int, start: int = 0, t_iter: float | None = None):
        t_start = time.perf_counter()
        t_iter = t_start if t_iter is None else t_iter
        self.state.begin()  # its first batch is asked for: a later iter() runs the next epoch
        stats = EpochStats(epoch=epoch)
        stats.pipeline_start_s, self._start_s = self._start_s, 0.0
        if self.workers is not None:  # num_workers > 0: start() made the pool and its dispatcher
            self.workers.new_epoch()
            if self.prefetcher is not None:
                self.prefetcher.new_epoch()
        carry = self.dispatch.take_pre(epoch, start) if self.dispatch is not None else None
        if carry is not None:
            run, ids, batches = carry["run"], carry["ids"], carry["batches"]
            stats.order_displacement = carry["displacement"]
        else:
            ids, stats.order_displacement = self.hooks.plan(epoch)
            bs = self.cfg.batch_size
            ids = ids[start * bs :]
            batches = [ids[i : i + bs] for i in range(0, len(ids), bs)]
        self.state.position = (epoch, start)
        if start == 0:
            self.state.carry = None  # a streaming collate's carry never crosses an epoch
        # the prefetcher's traffic for this epoch, also what it did while the previous one drained,
        # is in its ledger row of this plan; the workers' early replies count here (carry)
        before = self.totals()
        if carry is not None:  # workers' counters as of their early replies for this epoch
            assert self.dispatch is not None  # (a carry comes from the dispatcher)
            self.dispatch.worker_counters.update(carry["counters"])
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
            if self.inline is not None:  # num_workers=0: decoded here, on a watched thread
                yield from self.inline(epoch, start, batches, stats, delivered, t_resume, wait_box, t_iter)
            else:
                assert self.loop is not None  # (start() made it, with the workers)
                yield from self.loop(run, epoch, batches, stats, delivered, t_resume, wait_box, carry, t_iter)
        finally:
            stats.seconds = time.perf_counter() - t_start
            stats.worker_restarts, stats.prefetcher_restarts = self.restarts()
            stats.cpu_s = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in self._cpu().items()}
            d, ledger = self.since(before, run)
            fill_from_counters(stats, d, wait_box[0], ids, delivered, len(self.dataset))
            fill_origin_figures(stats, d, ledger, self.config.num_workers)
            self.hooks.record(stats)
            self.hooks.live.end(stats, d)
            if self.state.position[0] == epoch and self.state.epoch == epoch + 1:  # no later iter()/set_epoch/load
                done = self.state.position[1]
                if done == start + len(batches):  # every batch done (yielded or all skipped)
                    self._report_epoch(stats)
                self.state.cut = (epoch, done, start + len(batches)) if done < start + len(batches) else None
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
            cache.register(
                self.dataset.version, self.dataset.index.total_bytes, stats.seconds * len(self.dataset) / stats.samples
            )
        except OSError as exc:  # the policy's bookkeeping must never stop training
            log.warning("could not update the cache policy's job record: %s", exc)
