"""The Loader: configuration, epoch plans and resume state; each ``iter()`` serves one epoch
through the started pipeline (:mod:`stoker.loader._run`).

Data flow (one direction): the epoch's permutation -> this rank's plan -> batches
dispatched to decode workers (each writes into a shared-memory slot) -> batches
yielded in plan order as ``(images uint8 [N,3,S,S], labels int64 [N])`` torch
tensors. A prefetch process fills the node cache ahead of the workers in the
order the plan will need the blocks.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import numbers
import time

import numpy as np

from .._procs import pick_start_method
from .._units import parse_size
from ..order import permutation, rank_plan
from ._run import Run
from .config import WorkerConfig
from .epoch_stats import EpochStats
from .live import LiveTotals
from .state import IDENTITY_KEYS, LoaderState

log = logging.getLogger(__name__)

TRANSFORMS = ("train", "eval")


class Loader:
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
    did not admit (:mod:`stoker.cache.staging`; on the cache's disk, beside ``cache_bytes``;
    each is deleted once the last batch that needs it is delivered). The byte budgets (``prefetch_bytes``,
    ``staging_bytes``, ``cache_form_bytes``) take ints or strings such as ``"512MiB"``
    (:func:`stoker.parse_size`; ValueError naming the argument for a bad one).
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
    :func:`stoker._procs.pick_start_method`); an explicit ``"fork"`` there raises ForkUnsafeError.
    Slots that ``/dev/shm`` cannot hold: :mod:`stoker.loader.shm` (a smaller ring, or SharedMemoryError).
    ``cache_form``: keep each sample's cheaper derived form in a node-local store of
    ``cache_form_bytes`` (default ``<node cache>/.derived``) and decode from it from the
    second epoch (:mod:`stoker.loader.derived`): ``"jpeg"`` (re-encoded, shorter side capped
    at 320 px for 224), ``"jpeg256"``, ``"rgb256"``, ``"rgb"`` (decoded pixels), or ``"auto"``
    (measured choice, :mod:`stoker.decode.choose`; ``self.cache_form_report`` holds the rates).
    ``decode`` / ``collate``: any kind of sample (tokens, audio, features), see
    :mod:`stoker.loader.batches`. ``decode(fields, rng) -> sample`` runs in the workers on every
    sample: ``fields`` is ``{field name: bytes}`` (:meth:`stoker.store.dataset.Dataset.read_fields`),
    ``rng`` a ``numpy.random.Generator`` seeded by (seed, epoch, sample id), so augmentation is
    reproducible and resumable. ``collate(samples) -> batch`` runs there too (default
    :func:`stoker.collate.default`; also :func:`stoker.collate.pad`, :func:`stoker.collate.pack_tokens`).
    Iterating then yields ``collate``'s batches, same structure and types: their numpy arrays and
    CPU tensors (alone or in dicts, tuples, lists, nested) come through shared memory without
    pickling, their other leaves (strings, numbers, objects) pickled beside them; a batch with no
    array at all is pickled whole (``stats.shm_batches``, ``stats.pickled_batches``,
    ``stats.pickled_bytes``). A decode that raises or returns None fails the batch with a
    WorkerError naming the sample's key (``on_error="skip"``: skipped and counted). Under
    ``spawn``/``forkserver`` both must pickle: TypeError naming the function otherwise.
    ``transform``/``image_size`` do not apply then.
    ``device``: ``None``/``"cpu"`` yield the shared-memory tensors; ``"cuda"`` copies each
    batch through pinned memory on a side stream (:mod:`stoker.loader.transfer`; RuntimeError at
    construction when CUDA is not available).
    ``decode_device``: ``"cuda"`` decodes the JPEGs on the GPU in the training process (nvJPEG,
    per-sample CPU fallback; :mod:`stoker.loader.device_decode`): the workers only read and verify
    bytes, and batches arrive on that device (``device`` defaults to it). Not with
    ``cache_form``. ``loader.device_decode_stats`` counts the samples per path.
    The images of a batch live in shared memory; the slot is reused only after
    every reference to the batch tensor is dropped.
    ``metrics_port``: serve Prometheus metrics of this loader on that port (0: any free one;
    default ``$STOKER_METRICS_PORT`` plus ``$LOCAL_RANK`` when set, so the ranks of a node
    serve on consecutive ports; none when unset; :mod:`stoker.metrics` lists them; needs
    the ``metrics`` extra: ImportError without it, OSError when the port is taken; a port from
    the environment that is taken is logged and training goes on). ``metrics_url`` is where.
    The live figures also go, every second, beside the node cache's job records, where
    ``stoker top`` reads them (:mod:`stoker.loader.live`).

    ``fetch_concurrency`` is the least number of ranged GETs the prefetcher keeps in flight; it
    keeps more (up to :data:`stoker.loader.inflight.MAX_INFLIGHT`) while the measured latency x
    bandwidth / block size asks for them (:mod:`stoker.loader.inflight`).

    Origin bytes are charged to the epoch whose samples they serve, so warm epochs show only
    their own reads.

    Attributes besides the arguments: ``state`` (:class:`stoker.loader.state.LoaderState`,
    where the stream stands), ``cfg`` (the frozen :class:`stoker.loader.config.WorkerConfig`
    the workers receive), ``stats`` (the last epoch's :class:`EpochStats`) and ``history``
    (every epoch's). The processes live in a :class:`stoker.loader._run.Run`, started by the
    first ``iter()`` and stopped by :meth:`close`.

    ``stats`` fields (:class:`stoker.loader.epoch_stats.EpochStats`; one rank, one epoch;
    ``stats.as_dict()`` gives a dict): ``epoch`` (index); ``samples`` and ``batches``
    delivered (skipped samples not counted); ``seconds`` (s, wall time from the epoch's
    ``iter()`` to its last batch); ``wait_s`` (s blocked in ``next()``); ``stall_fraction``
    (``wait_s / seconds``, 0-1); ``samples_per_s`` (samples/s); ``origin_bytes`` (bytes
    received from the origin by every process of the loader), ``origin_requests`` (ranged
    GETs) and ``origin_retries`` (requests that failed and were sent again); ``cache_hits`` /
    ``cache_misses`` (sample reads served by the node cache / not), ``cache_hit_ratio``
    (0-1), ``memory_hits`` (hits served by the shared-memory tier);
    ``prefetch_fills`` (blocks the prefetcher admitted to the cache), ``prefetch_staged``
    (blocks it fetched from the origin just in time into staging), ``staged_reused`` (blocks
    still staged for the previous epoch's last batches, used instead of fetched again),
    ``prefetch_depth_bytes`` (mean bytes ready
    ahead of the consumer), ``staged_hits`` (samples read from staged blocks),
    ``direct_reads`` (samples read from the origin one by one); ``evictions`` (blocks),
    ``corrupt_blocks`` (cached blocks that failed a checksum, dropped and fetched again);
    ``skipped`` (samples) and ``skipped_keys`` (their keys, the first 100); ``exactly_once``
    (bool: the delivered ids equal the rank's plan); ``cpu_s`` (dict of CPU seconds: ``main``,
    ``workers``, ``prefetch``; Linux); ``order_displacement`` (mean move in positions of
    ``cache_aware_window``); ``derived_hits`` / ``derived_fills`` (samples decoded from /
    written to the derived-sample cache) and ``derived_same`` (samples whose entry says "use
    the raw sample": already within a JPEG form's cap); ``worker_restarts`` / ``prefetcher_restarts``
    (dead processes replaced); ``shm_batches`` / ``pickled_batches`` (user-collated batches
    whose arrays moved through shared memory / pickled whole through a pipe, having no array) and
    ``pickled_bytes`` (bytes pickled: the whole batches, and the non-array leaves, such as
    strings, of the batches through shared memory).
    Cold starts and overlap (stable names, for metrics exporters): ``first_batch_s`` (s,
    ``iter()`` to the first batch delivered, the pipeline's one-time start not included: that is
    ``pipeline_start_s``, s); ``overlap_efficiency`` (0-1: max(bytes / origin bandwidth,
    samples / decode bound) / seconds); ``origin_busy_fraction`` (0-1, share of the epoch with a
    request in flight); ``inflight_requests`` (mean prefetch requests in flight while busy) and
    ``inflight_target`` (requests the prefetcher aims for, from the bandwidth-delay product);
    ``origin_latency_s`` (s, shortest request seen) and ``origin_bandwidth_Bps`` (bytes/s,
    highest aggregate rate measured).
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                 rank: int = 0, world_size: int = 1, num_workers: int = 2, transform: str = "train",
                 image_size: int = 224, on_error: str = "raise", even: str = "pad", drop_last: bool = False,
                 prefetch_batches: int | None = None, prefetch_bytes: int | str = 512 << 20,
                 staging_bytes: int | str = 64 << 20,
                 fetch_concurrency: int = 8, timeout_s: float = 120.0, exif_orientation: bool = False,
                 order: str = "blockwise", order_window: int = 16, start_method: str | None = None,
                 prefetch_next_epoch: bool = True, cache_aware_window: int = 0,
                 cache_form: str | None = None, cache_form_bytes: int | str = 16 << 30, cache_form_dir: str | None = None,
                 device: str | None = None, decode_device=None, decode=None, collate=None,
                 metrics_port: int | None = None):
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(f"batch_size must be an integer number of samples, got {type(batch_size).__name__} "
                            f"{batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        for role, fn in (("decode", decode), ("collate", collate)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{role} must be a function, got {type(fn).__name__} {fn!r}")
        if (decode is not None or collate is not None) and (cache_form is not None or decode_device is not None):
            raise ValueError("decode/collate (the user's samples) cannot be used with cache_form or decode_device "
                             "(the built-in image paths)")
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
            from .._torch import check_device
            check_device(device)  # ValueError / RuntimeError (no CUDA) now, not at the first batch
        from ..order import PERMUTATIONS
        if shuffle and order not in PERMUTATIONS:
            raise ValueError(f"unknown order {order!r}; registered: {sorted(PERMUTATIONS)}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle, self.seed = shuffle, int(seed)
        self.state = LoaderState(epoch=int(epoch), position=(int(epoch), 0))
        self.rank, self.world_size, self.even, self.drop_last = rank, world_size, even, drop_last
        self.num_workers = int(num_workers)
        self.prefetch_batches = prefetch_batches or max(2, 2 * self.num_workers)
        self.prefetch_bytes = parse_size(prefetch_bytes, "prefetch_bytes")
        self.fetch_concurrency = int(fetch_concurrency)
        self.staging_bytes = parse_size(staging_bytes, "staging_bytes")
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
        self.cfg = WorkerConfig(transform=transform, seed=self.seed, image_size=int(image_size), on_error=on_error,
                                exif_orientation=exif_orientation, batch_size=self.batch_size,
                                decode_on="cpu" if decode_device is None else "device", decode=decode,
                                collate=collate)
        if num_workers:
            self.cfg.check_picklable(self.start_method)  # TypeError naming the function, now
        self.decode_device, self._device_decoder = decode_device, None
        self.cache_form, self.cache_form_dir = cache_form, cache_form_dir
        self.cache_form_bytes = parse_size(cache_form_bytes, "cache_form_bytes")
        self.cache_form_report: dict | None = None  # the derived form used and, for "auto", its measured rates
        self._derived_ready = False
        self.device = device
        self.stats: EpochStats | None = None
        self.history: list[EpochStats] = []
        self.prefetch_next_epoch = prefetch_next_epoch
        self.cache_aware_window = int(cache_aware_window)
        self._pipeline: Run | None = None  # the started pipeline, from the first iter() to close()
        rank_plan(np.zeros(0, np.int64), rank, world_size, even)  # validates rank/world/even
        self._live = LiveTotals(self)
        self._metrics = None
        self._metrics_port, self._metrics_from_env = metrics_port, metrics_port is None
        if metrics_port is None:
            from ..metrics import metrics_port_from_env
            self._metrics_port = metrics_port_from_env()  # ValueError naming the variable
        self._export_metrics()

    def _export_metrics(self) -> None:
        """Serve this loader's metrics on ``metrics_port`` (see the class doc), unless served already."""
        if self._metrics_port is None or self._metrics is not None:
            return
        from ..metrics import export_loader
        try:
            self._metrics = export_loader(self._live.snapshot, self._metrics_port, dataset=self.dataset.version,
                                          rank=self.rank)
        except OSError as exc:
            if not self._metrics_from_env:
                raise OSError(f"metrics_port={self._metrics_port}: {exc}") from exc
            log.warning("no Prometheus metrics for this loader: port %s ($STOKER_METRICS_PORT) is taken (%s)",
                        self._metrics_port, exc)
            self._metrics_port = None

    @property
    def metrics_url(self) -> str | None:
        """``http://addr:port/metrics`` where this loader's metrics are served, or None."""
        return self._metrics.url if self._metrics is not None else None

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
        cached = self.state.hit_maps.get(epoch)
        if cached is None:
            cached = self.dataset.cached_blocks()
            self.state.hit_maps = {e: m for e, m in self.state.hit_maps.items() if e >= epoch - 1}
            self.state.hit_maps[epoch] = cached
        out = cache_aware(ids, cached[self.dataset.sample_block[ids]], self.cache_aware_window)
        return out, (mean_displacement(ids, out) if self.world_size == 1 else float("nan"))

    def __len__(self) -> int:
        return -(-len(self.plan()) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch``, batch 0."""
        self.state.set_epoch(epoch)
        if self._pipeline is not None:
            self._pipeline.drop_pre()

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` runs (``state.epoch``)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.state.epoch = int(value)

    # -- resume -----------------------------------------------------------
    def _identity(self) -> dict:
        """What a saved state must agree on (:data:`stoker.loader.state.IDENTITY_KEYS`)."""
        ident = {"seed": self.seed, "order": self.order, "order_window": self.order_window, "rank": self.rank,
                 "world_size": self.world_size, "batch_size": self.batch_size, "even": self.even,
                 "drop_last": self.drop_last, "transform": self.cfg.transform,
                 "dataset_version": self.dataset.version, "num_samples": len(self.dataset),
                 "cache_aware_window": self.cache_aware_window,
                 # a streaming collate's carry only means something to the same collate
                 "carry_from": repr(self.cfg.collate) if hasattr(self.cfg.collate, "cut") else None}
        assert tuple(ident) == IDENTITY_KEYS
        return ident

    def state_dict(self) -> dict:
        """Where the stream stands: the epoch and the batches of it already yielded (once an
        epoch's iteration has ended early, by ``break``, ``close()`` or an error, the next
        epoch at batch 0: the next ``iter()`` runs that one, a cut epoch is not replayed).

        Everything else is a pure function of the configuration (order of (seed, epoch,
        rank, world size); augmentation of (seed, epoch, sample id)), so a loader built
        with the same arguments in a new process and given this state yields the rest of
        the stream batch for batch. Plain ints and strings (JSON-serialisable); the format is
        :meth:`stoker.loader.state.LoaderState.to_dict`.
        """
        return self.state.to_dict(self._identity())

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch after its
        ``batches_done`` batches (or starts the next epoch if that one was finished; an epoch
        with no batches for this rank, saved before its ``iter()``, is still run, yielding
        nothing, so ``epoch`` and ``history`` advance exactly as in the saved run).

        Raises ValueError when the state belongs to another dataset version or to a
        different order, batch size, rank split or transform (the rest of the stream
        would not be the same).
        """
        self.state.load(state, self._identity(), lambda e: -(-len(self.plan(e)) // self.batch_size),
                        self.dataset.num_blocks)
        if self._pipeline is not None:
            self._pipeline.drop_pre()

    # -- the pipeline -----------------------------------------------------
    def _start(self) -> Run:
        """The started pipeline, started now if there is none (the derived-sample cache is set
        up first, once per loader). Raises what :meth:`stoker.loader._run.Run.start` raises."""
        if self._pipeline is not None:
            return self._pipeline
        self._export_metrics()  # again after a close()
        if self.cache_form not in (None, "raw") and not self._derived_ready:
            from dataclasses import replace

            from .derived import setup
            derived, self.cache_form_report = setup(
                self.dataset, self.cache_form, capacity_bytes=self.cache_form_bytes, root=self.cache_form_dir,
                workers=self.num_workers, mode=self.cfg.transform, size=self.cfg.image_size,
                exif_orientation=self.cfg.exif_orientation)
            self.cfg, self._derived_ready = replace(self.cfg, derived=derived), True
            log.info("derived-sample cache: %s", self.cache_form_report)
        run = Run(self)
        try:
            run.start()
        except BaseException:
            run.close()
            raise
        self.start_method = run.start_method
        self._pipeline = run
        return run

    def close(self) -> None:
        """Stop workers and the prefetcher, unlink shared memory. Idempotent; a later
        ``iter()`` starts a new pipeline. Also stops serving its metrics and removes its live
        figures (a later ``iter()`` serves them again)."""
        run, self._pipeline = getattr(self, "_pipeline", None), None
        if run is not None:
            run.close()
        live, metrics, self._metrics = getattr(self, "_live", None), getattr(self, "_metrics", None), None
        if live is not None:
            live.unpublish()
        if metrics is not None:
            metrics.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __iter__(self):
        t_iter = time.perf_counter()
        started = self._pipeline is not None
        run = self._start()
        start_s = 0.0 if started else time.perf_counter() - t_iter  # stats.pipeline_start_s
        start, self.state.resume_batch = self.state.resume_batch, 0
        epoch = self.state.epoch
        self.state.epoch = epoch + 1  # the next iter() is the next epoch, even if this one is cut short
        return run.epoch(epoch, start, start_s=start_s)

    @property
    def device_decode_stats(self):
        """Samples decoded on the device / by the CPU fallback (``GpuDecodeStats``), or None
        without ``decode_device``."""
        return getattr(self._device_decoder.decoder, "stats", None) if self._device_decoder is not None else None

    # The started pipeline's parts, for inspection (tests, benchmarks); empty before iter().
    @property
    def _workers(self) -> list:
        return self._pipeline._workers if self._pipeline is not None else []

    @property
    def _prefetcher(self):
        return self._pipeline._prefetcher if self._pipeline is not None else None

    @property
    def _ring(self):
        return self._pipeline._ring if self._pipeline is not None else None

    @property
    def _transfer(self):
        return self._pipeline._transfer if self._pipeline is not None else None
