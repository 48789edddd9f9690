"""The loader: epoch plans, worker pool, prefetch, batches, and the statistics every benchmark reads.

Data flow (one direction): the epoch's permutation -> this rank's plan -> batches
dispatched to decode workers (each writes into a shared-memory slot) -> batches
yielded in plan order as ``(images uint8 [N,3,S,S], labels int64 [N])`` torch
tensors. A prefetch process fills the node cache ahead of the workers in the
order the plan will need the blocks.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time

import numpy as np

from ..order import permutation, rank_plan
from ..procs import pick_start_method
from .epoch_stats import EpochStats, account, fill_from_counters, process_cpu_s
from .prefetch import block_schedule
from .procs import ProcessesMixin, WorkerError
from .shm import SlotRing
from .state import ResumableMixin
from .workers import BatchDecoder, counters

log = logging.getLogger(__name__)

TRANSFORMS = ("train", "eval")


class Loader(ResumableMixin, ProcessesMixin):
    """Batches of decoded, augmented images from a :class:`stoker.store.dataset.Dataset`.

    Iterating yields ``(images, labels)``: torch uint8 tensor (N, 3, S, S) and int64
    tensor (N,), N = ``batch_size`` except maybe the last batch. Each ``iter()`` runs
    one epoch (``self.epoch``) and advances ``self.epoch`` by one when it starts, so an
    epoch cut short by ``break`` is not replayed (use :meth:`set_epoch` to choose one).

    Order: the permutation named ``order`` of (``seed``, epoch) (identity if
    ``shuffle=False``), split over ``world_size`` ranks with equal counts
    (``even="pad"`` or ``"drop"``, see :func:`stoker.order.rank_plan`). The default,
    ``"blockwise"``, shuffles the cache blocks and the samples inside windows of
    ``order_window`` blocks (quasi-random, streams well from a cold origin);
    ``"uniform"`` is a uniform permutation (see :mod:`stoker.order`).
    ``transform``: ``"train"`` (RandomResizedCrop(S) + flip, per-sample RNG from
    (seed, epoch, sample id)) or ``"eval"`` (resize 256 + center crop S).
    ``num_workers`` decode processes (0 = decode in this process).
    ``on_error``: ``"raise"`` (a sample no decoder reads raises WorkerError naming
    its key) or ``"skip"`` (logged, counted in stats, batch is shorter; a batch whose
    samples were all skipped is not yielded).
    ``prefetch_batches`` batches in flight; ``prefetch_bytes`` how far the block
    prefetcher runs ahead; ``fetch_concurrency`` its concurrent ranged GETs;
    ``staging_bytes`` the most it holds in blocks fetched just in time that the cache
    did not admit (:mod:`stoker.cache.staging`).
    ``cache_aware_window``: if > 0, within each window of that many samples the samples
    whose blocks are cached when the epoch starts come first and the misses follow
    (:func:`stoker.order.cache_aware`; off by default). Every sample still comes exactly
    once; ``stats.order_displacement`` reports the mean move in positions. The cache state
    used is kept in ``state_dict()``, so resume stays batch-for-batch identical.
    ``prefetch_next_epoch``: when the last batches of an epoch are in flight, start the
    first batches of the next epoch, so the pipeline never drains at the boundary (their
    work is counted in the epoch that started them).
    ``timeout_s``: longest wait for one batch before WorkerError (never a hang).
    ``start_method``: multiprocessing start method (default ``fork`` where available, as
    torch's DataLoader; each child re-creates its storage clients, so no connection or
    event loop is shared; ``spawn``/``forkserver`` need the usual ``__main__`` guard). By
    default ``forkserver`` is used instead of ``fork`` when the training process runs threads
    that a forked child cannot survive (a tokio runtime, e.g. from obstore; see
    :func:`stoker.procs.pick_start_method`); an explicit ``"fork"`` there raises ForkUnsafeError.
    Slots that ``/dev/shm`` cannot hold: :mod:`stoker.loader.shm` (a smaller ring, or SharedMemoryError).
    ``cache_form``: keep each sample's cheaper derived form in a node-local store of
    ``cache_form_bytes`` (default ``<node cache>/.derived``) and decode from it from the
    second epoch (:mod:`stoker.loader.derived`): ``"jpeg"`` (re-encoded, shorter side capped
    at 320 px for 224), ``"jpeg256"``, ``"rgb256"``, ``"rgb"`` (decoded pixels), or ``"auto"``
    (measured choice, :mod:`stoker.decode.choose`; ``self.cache_form_report`` holds the rates).
    ``device``: ``None``/``"cpu"`` yield the shared-memory tensors; ``"cuda"`` copies each
    batch through pinned memory on a side stream (:mod:`stoker.loader.transfer`; RuntimeError at
    construction when CUDA is not available).
    ``decode_device``: ``"cuda"`` decodes the JPEGs on the GPU in the training process (nvJPEG,
    per-sample CPU fallback; :mod:`stoker.loader.device_decode`): the workers only read and verify
    bytes, and batches arrive on that device (``device`` defaults to it). Not with
    ``cache_form``. ``loader.device_decode_stats`` counts the samples per path.
    The images of a batch live in shared memory; the slot is reused only after
    every reference to the batch tensor is dropped.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                 rank: int = 0, world_size: int = 1, num_workers: int = 2, transform: str = "train",
                 image_size: int = 224, on_error: str = "raise", even: str = "pad", drop_last: bool = False,
                 prefetch_batches: int | None = None, prefetch_bytes: int = 512 << 20,
                 staging_bytes: int = 64 << 20,
                 fetch_concurrency: int = 8, timeout_s: float = 120.0, exif_orientation: bool = False,
                 order: str = "blockwise", order_window: int = 16, start_method: str | None = None,
                 prefetch_next_epoch: bool = True, cache_aware_window: int = 0,
                 cache_form: str | None = None, cache_form_bytes: int = 16 << 30, cache_form_dir: str | None = None,
                 device: str | None = None, decode_device=None):
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if cache_form not in (None, "auto"):
            from ..decode.forms import parse_form
            parse_form(cache_form, image_size)  # ValueError now, not in a worker
        if decode_device is not None:
            if not isinstance(decode_device, str) and type(decode_device).__name__ == "device":
                decode_device = str(decode_device)  # a torch.device
            if isinstance(decode_device, str):
                if not decode_device.startswith("cuda"):
                    raise ValueError(f"decode_device must be 'cuda' or 'cuda:N' (or a decoder object), "
                                     f"got {decode_device!r}")
            elif not all(hasattr(decode_device, a) for a in ("decode", "transform_batch", "device")):
                raise ValueError(f"decode_device must be a CUDA device name or a decoder with decode(), "
                                 f"transform_batch() and device, got {type(decode_device).__name__}")
            if cache_form is not None:
                raise ValueError("cache_form (derived forms decoded on the CPU) cannot be used with decode_device")
            if device is None:
                device = decode_device if isinstance(decode_device, str) else None
        if device not in (None, "cpu"):
            from .transfer import check_device
            check_device(device)  # ValueError / RuntimeError (no CUDA) now, not at the first batch
        from ..order import PERMUTATIONS
        if shuffle and order not in PERMUTATIONS:
            raise ValueError(f"unknown order {order!r}; registered: {sorted(PERMUTATIONS)}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), int(epoch)
        self.rank, self.world_size, self.even, self.drop_last = rank, world_size, even, drop_last
        self.num_workers = int(num_workers)
        self.prefetch_batches = prefetch_batches or max(2, 2 * self.num_workers)
        self.prefetch_bytes, self.fetch_concurrency = int(prefetch_bytes), int(fetch_concurrency)
        self.staging_bytes = int(staging_bytes)
        window = 2 * int(order_window) * getattr(dataset, "block_bytes", 0) if order == "blockwise" else 0
        if shuffle and 0 < self.staging_bytes < window:
            log.warning("staging_bytes=%d is below two shuffle windows of blocks (%d bytes): every batch of the "
                        "blockwise order reads every block of its window, so blocks the cache does not admit "
                        "will be read sample by sample from the origin", self.staging_bytes, window)
        self.timeout_s = timeout_s
        self.order = order if shuffle else "sequential"
        self.order_window = int(order_window)
        self._start_method_asked = start_method  # None: chosen again when the processes start
        # ForkUnsafeError now for start_method="fork" in a process where fork is unsafe
        self.start_method = (pick_start_method(start_method, mp.get_all_start_methods())[0] if num_workers
                             else start_method or "fork")
        self.cfg = {"transform": transform, "seed": self.seed, "image_size": int(image_size),
                    "on_error": on_error, "exif_orientation": exif_orientation, "batch_size": self.batch_size,
                    "decode_on": "cpu" if decode_device is None else "device"}
        self.decode_device, self._device_decoder = decode_device, None
        self.cache_form, self.cache_form_bytes, self.cache_form_dir = cache_form, int(cache_form_bytes), cache_form_dir
        self.cache_form_report: dict | None = None  # the derived form used and, for "auto", its measured rates
        self.device = device
        self._transfer = None
        self.stats: EpochStats | None = None
        self.history: list[EpochStats] = []
        self._started = False
        self._run = 0
        self._pre = None
        self.prefetch_next_epoch = prefetch_next_epoch
        self.cache_aware_window = int(cache_aware_window)
        self._hit_maps: dict[int, np.ndarray] = {}  # epoch -> cached-block bitmap used for its order
        self._resume_batch = 0
        self._position = (self.epoch, 0)
        self._workers: list = []
        self._ring: SlotRing | None = None
        rank_plan(np.zeros(0, np.int64), rank, world_size, even)  # validates rank/world/even

    # -- plan -------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample ids for ``epoch`` (default: the next epoch), in order."""
        e = self.epoch if epoch is None else epoch
        perm = permutation(len(self.dataset), self.seed, e, self.order, groups=self.dataset.sample_block,
                           window=self.order_window)
        ids = rank_plan(perm, self.rank, self.world_size, self.even)
        if self.drop_last:
            ids = ids[: len(ids) // self.batch_size * self.batch_size]
        return ids

    def _epoch_plan(self, epoch: int) -> tuple[np.ndarray, float]:
        """The order actually served in ``epoch``: :meth:`plan`, made cache-aware if asked.
        Returns (sample ids, mean displacement from the plain plan)."""
        ids = self.plan(epoch)
        if self.cache_aware_window <= 0 or self.dataset.cache is None:
            return ids, 0.0
        from ..order import cache_aware, mean_displacement
        cached = self._hit_maps.get(epoch)
        if cached is None:
            cached = self.dataset.cached_blocks()
            self._hit_maps = {e: m for e, m in self._hit_maps.items() if e >= epoch - 1}
            self._hit_maps[epoch] = cached
        out = cache_aware(ids, cached[self.dataset.sample_block[ids]], self.cache_aware_window)
        return out, (mean_displacement(ids, out) if self.world_size == 1 else float("nan"))

    def __len__(self) -> int:
        return -(-len(self.plan()) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch``, batch 0."""
        self.epoch = int(epoch)
        self._resume_batch = 0
        self._position = (self.epoch, 0)
        self._pre = None

    # -- processes --------------------------------------------------------
    def _start(self) -> None:
        if self._started:
            return
        from .. import decode  # noqa: F401 - imported once here, inherited by forked workers
        from .. import (
            torch as _torch_adapter,  # pay torch's import before the first batch
        )
        _torch_adapter.load()
        if self.device not in (None, "cpu"):
            from .transfer import DeviceTransfer
            self._transfer = DeviceTransfer(self.device)
        if self.cache_form not in (None, "raw") and "derived" not in self.cfg:
            from .derived import setup
            self.cfg["derived"], self.cache_form_report = setup(
                self.dataset, self.cache_form, capacity_bytes=self.cache_form_bytes, root=self.cache_form_dir,
                workers=self.num_workers, mode=self.cfg["transform"], size=self.cfg["image_size"],
                exif_orientation=self.cfg["exif_orientation"])
            log.info("derived-sample cache: %s", self.cache_form_report)
        self._ring = SlotRing(self.batch_size, self.cfg["image_size"], self.prefetch_batches + 2,
                              shared=self.num_workers > 0)  # SharedMemoryError: not one slot fits
        if self.dataset.cache is not None and self.num_workers > 0 and self.dataset.staging is None:
            from ..cache import StagingArea
            self.dataset.staging = StagingArea.create(self.dataset.cache.root)
            self._own_staging = True
        self._prefetcher = None
        if self.num_workers > 0:
            self._start_processes()  # ForkUnsafeError: start_method="fork" where fork is unsafe
        else:
            self._decoder = BatchDecoder(self.dataset, self.cfg)
        self._worker_counters: dict[int, dict] = {}
        if self.decode_device is not None and self._device_decoder is None:  # after the forks (CUDA)
            from .device_decode import DeviceBatchDecoder
            self._device_decoder = DeviceBatchDecoder.create(self.decode_device, self.dataset, self.cfg)
        self._started = True

    def close(self) -> None:
        """Stop workers and the prefetcher, unlink shared memory. Idempotent."""
        if not self._started:
            return
        self._started = False
        if self._workers:
            self._stop.set()  # workers drop queued tasks instead of finishing them
        for _ in self._workers:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                pass
        if self._prefetcher is not None:
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
        if getattr(self, "_own_staging", False):
            self.dataset.staging.clear()
            self.dataset.staging = None
            self._own_staging = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

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
                   else [counters(self.dataset, self.cfg.get("derived"))])
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

    # -- iteration --------------------------------------------------------
    def __iter__(self):
        self._start()
        self._run += 1
        start, self._resume_batch = self._resume_batch, 0
        epoch = self.epoch
        self.epoch = epoch + 1  # the next iter() is the next epoch, even if this one is cut short
        return self._epoch(self._run, epoch, start)

    def _epoch(self, run: int, epoch: int, start: int = 0):
        t_start = time.perf_counter()
        stats = EpochStats(epoch=epoch)
        carry = self._take_pre(epoch, start) if self.num_workers > 0 else None
        if carry is not None:
            run, ids, batches = carry["run"], carry["ids"], carry["batches"]
            stats.order_displacement = carry["displacement"]
        else:
            ids, stats.order_displacement = self._epoch_plan(epoch)
            ids = ids[start * self.batch_size:]
            batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        self._position = (epoch, start)
        # prefetch work for this epoch done while the previous one drained counts here
        before = self._totals(carry.get("pf_boundary") if carry is not None else None)
        if carry is not None:  # workers' counters as of their early replies for this epoch
            self._worker_counters.update(carry["counters"])
        cpu_before = self._cpu()
        delivered: list = []  # the sample ids of each delivered batch (counted at the end)
        if self._prefetcher is not None and carry is None:  # (a pre-dispatched epoch sent its plan)
            self._pf_pos.value = 0
            self._pf_done.value = 0
            self._pf_cmds.put((run, *block_schedule(self.dataset, ids)))
        wait_box = [0.0]  # seconds blocked in next(), also when the epoch is cut short
        t_resume = time.perf_counter()
        try:
            if self.num_workers == 0:
                for seq, bids in enumerate(batches):
                    slot = self._ring.acquire()
                    out = self._deliver(epoch, slot, bids, *self._decoder.run(epoch, bids, *self._ring.views(slot)),
                                        stats=stats, delivered=delivered)
                    if out is None:  # every sample of the batch was skipped: yield nothing for it
                        self._position = (epoch, start + seq + 1)
                        continue
                    wait_box[0] += time.perf_counter() - t_resume
                    self._position = (epoch, start + seq + 1)
                    yield out
                    t_resume = time.perf_counter()
            else:
                yield from self._parallel(run, epoch, batches, stats, delivered, t_resume, wait_box, carry)
        finally:
            stats.seconds = time.perf_counter() - t_start
            stats.cpu_s = {k: round(v - cpu_before.get(k, 0.0), 3) for k, v in self._cpu().items()}
            pre = self._pre if self._pre is not None and self._pre["epoch"] != epoch else None
            after = self._totals(pre.get("pf_boundary") if pre is not None else None)
            fill_from_counters(stats, {k: after.get(k, 0) - before.get(k, 0) for k in after}, wait_box[0], ids,
                               delivered, len(self.dataset))
            self.stats = stats
            self.history.append(stats)
            if self._position[0] == epoch and self.epoch == epoch + 1:  # no later iter()/set_epoch/load
                if self._position[1] == start + len(batches):  # every batch done (yielded or all skipped)
                    self._report_epoch(stats)
                self._position = (epoch + 1, 0)  # done or cut short: the next iter() (and a resume) runs epoch + 1

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
            images, labels, more, more_keys = self._device_decoder(epoch, payloads, labels)
            account(stats, bids, list(skipped) + more, list(skipped_keys) + more_keys, delivered)
            return None if images is None else (images, labels)
        account(stats, bids, skipped, skipped_keys, delivered)
        if n == 0:
            self._ring.release(slot)
            return None
        imgs, labels = self._ring.batch(slot, n)
        return self._as_batch(imgs, labels)

    @property
    def device_decode_stats(self):
        """Samples decoded on the device / by the CPU fallback (``GpuDecodeStats``), or None
        without ``decode_device``."""
        return getattr(self._device_decoder.decoder, "stats", None) if self._device_decoder is not None else None

    def _as_batch(self, imgs, labels):
        """Tensors over the slot (no copy), or on ``device`` through :mod:`stoker.loader.transfer`."""
        from ..torch import as_tensors
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
        self._tasks.put((run, seq, epoch, slot, self._ring.paths[slot], bids))
        inflight[seq] = (slot, bids)
        return True

    def _predispatch(self, epoch: int) -> None:
        """Start the first batches of the next epoch while this one drains (its plan is a pure
        function of the epoch), so the pipeline does not run dry at the epoch boundary. Kept
        in ``self._pre`` and adopted by the next ``iter()`` if it starts that epoch at batch 0;
        otherwise dropped (its replies are recognised by their run id)."""
        self._run += 1
        ids, displacement = self._epoch_plan(epoch)
        batches = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        pre = {"run": self._run, "epoch": epoch, "ids": ids, "batches": batches, "inflight": {},
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
            self._pf_cmds.put((pre["run"], *block_schedule(self.dataset, ids)))

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
                if (next_dispatch == len(batches) and self._pre is None and self._resume_batch == 0
                        and self.epoch == epoch + 1 and self.prefetch_next_epoch):
                    self._predispatch(epoch + 1)
                if seq in pending:
                    break
                try:
                    msg = self._results.get(timeout=0.25)
                except queue.Empty:
                    self._check_workers()
                    if time.monotonic() > deadline:
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
                raise WorkerError(f"worker {wid} failed on sample {key!r} (epoch {epoch}, batch {self._position[1]}): {err}\n{tb}")
            slot, n, skipped, skipped_keys = msg[4:8]
            bids = inflight.pop(seq)[1]
            if seq % 8 == 7 or seq == len(batches) - 1:  # a syscall: not on every batch
                self._check_prefetcher()
            out = self._deliver(epoch, slot, bids, n, skipped, skipped_keys, msg[9], stats=stats, delivered=delivered)
            if out is None:  # every sample of the batch was skipped: yield nothing for it
                self._position = (epoch, self._position[1] + 1)
                continue
            wait_box[0] += time.perf_counter() - t_resume
            self._position = (epoch, self._position[1] + 1)
            if self._prefetcher is not None:  # positions in this epoch's plan
                if self._pre is None:
                    self._pf_done.value = (seq + 1) * self.batch_size
                else:  # the prefetcher is on the next plan already: this one's progress is "previous"
                    self._pf_prev_done.value = (seq + 1) * self.batch_size
            yield out
            t_resume = time.perf_counter()
