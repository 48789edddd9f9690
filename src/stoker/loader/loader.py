"""The Loader: configuration, epoch plans and resume state; each ``iter()`` serves one epoch
through the started pipeline (:mod:`stoker.loader.pipeline.run`). The data flow is drawn in
this package's README.md.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import multiprocessing as mp
import multiprocessing.util
import numbers
import os
import sys
import time
import warnings
import weakref
from typing import TYPE_CHECKING

import numpy as np

from .._procs import check_main_for, pick_start_method
from ..errors import NotADatasetError
from ..order import EpochShares, interleaved_shares, permutation, rank_plan
from .adapters import CopiedSampler, ReadAhead, batch_sampler_of, read_ahead, sampler_for
from .device.device_decode import DeviceBatchDecoder
from .epoch_stats import EpochStats, why_empty
from .iterator import EpochIterator
from .live import LiveTotals
from .mixed import MixLoader
from .mixture import Mixture
from .options import (
    ImageOptions,
    ReadOptions,
    RunConfig,
    RunOptions,
    WorkerConfig,
    batch_device,
    order_of,
    settle,
    user_stacklevel,
)
from .pipeline.run import Processes, Run, RunHooks
from .state import IDENTITY_KEYS, LoaderState
from .workers.interrupts import held
from .world import resolve

if TYPE_CHECKING:
    from ..metrics import LoaderExport

log = logging.getLogger(__name__)

TRANSFORMS = ("train", "eval")


def _weak(method):
    """``method`` (a bound method of a Loader) called without keeping its Loader alive: the
    pipeline holds these, and a Loader dropped without ``close()`` must be collected, not kept
    in a reference cycle through its pipeline. None once the Loader is gone (only its finalizer
    runs then, and it asks nothing of the Loader)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


class _Started:
    """What a Loader started and must stop: its pipeline, its metrics server and its
    live-figures file. Kept apart from the Loader so that the finalizer that stops them when the
    Loader is dropped without ``close()``, or at interpreter exit, holds these and never the
    Loader (``weakref.finalize``).

    Args:
        live: the Loader's :class:`LiveTotals` (its dataset and rank name the metrics).
        metrics_port: ``RunOptions.metrics_port``; None: ``$STOKER_METRICS_PORT`` (ValueError
            naming the variable when it is not a port), else no metrics.
    """

    def __init__(self, live: LiveTotals, metrics_port: int | None):
        self.run: Run | None = None
        self.metrics: LoaderExport | None = None
        self.live = live
        self.pid = os.getpid()  #: the process they belong to (set again when a pipeline starts)
        self.from_env = metrics_port is None
        if metrics_port is None:
            from ..metrics import metrics_port_from_env

            metrics_port = metrics_port_from_env()  # ValueError naming the variable
        self.port = metrics_port  #: the metrics port asked for (None: none, or every port tried was taken)

    def export_metrics(self) -> None:
        """Serve the loader's metrics on :attr:`port`, unless served already; a busy port is
        handled as ``RunOptions.metrics_port`` says (:func:`stoker.metrics.export_loader`).

        Raises:
            OSError: an explicit ``metrics_port`` that cannot be served for another reason (names it).
        """
        if self.port is None or self.metrics is not None:
            return
        from ..metrics import export_loader, local_rank_from_env

        source = "$STOKER_METRICS_PORT" if self.from_env else "metrics_port"
        ds = self.live.dataset
        try:
            self.metrics = export_loader(
                self.live.snapshot,
                self.port,
                dataset=ds.url,
                version=ds.version,
                rank=self.live.rank,
                local_rank=None if self.from_env else local_rank_from_env(),
            )
        except OSError as exc:
            if not self.from_env and exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise OSError(exc.errno, f"metrics_port={self.port}: {exc.strerror or exc}") from exc
            log.warning("no Prometheus metrics for this loader: %s=%s: %s", source, self.port, exc.strerror or exc)
            self.port = None
            return
        if self.metrics.taken:
            log.warning(
                "Prometheus metrics of this loader on port %d (loader.metrics_port), not %s=%s: %s held by "
                "another program (%s)",
                self.metrics.port,
                source,
                self.port,
                "port " + ", ".join(str(p) for p in self.metrics.taken),
                next(iter(self.metrics.taken.values())),
            )

    def close(self, deliver_interrupt: bool = False) -> None:
        """Stop the pipeline, unpublish the live figures, stop serving metrics. Idempotent. In a
        process forked from their owner (its exit runs the finalizers it inherited) nothing is
        touched: they are the parent's. A Ctrl-C meanwhile waits until it is done, then is raised
        with ``deliver_interrupt`` and dropped without (:func:`.interrupts.held`; the finalizers
        run it without)."""
        if os.getpid() != self.pid:
            return
        with held(deliver=deliver_interrupt):
            self._stop()

    def _stop(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.close()
        self.live.unpublish()
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            metrics.close()


#: every Loader's :class:`_Started` while the Loader lives (its finalizer holds it until then)
_OPEN: weakref.WeakSet[_Started] = weakref.WeakSet()


def _close_open() -> None:
    """Close every open Loader of this process: run by multiprocessing's own exit function before
    it terminates and joins the children still alive (registered below), so a job that never calls
    ``close()`` (a Lightning or accelerate script) stops its workers the ordinary way first,
    whatever order the interpreter's other exit hooks run in."""
    for started in list(_OPEN):
        started.close()


# multiprocessing's exit function (util._exit_function, an atexit hook) runs the finalizers that
# have an exit priority before it terminates and joins the live children; the callback skips
# processes other than the one that registered it (a forked child).
multiprocessing.util.Finalize(None, _close_open, exitpriority=100)


def _check_args(batch_size: object, num_workers: int, transform: str, decode, collate, image: ImageOptions) -> None:
    """Check the Loader's common arguments (``batch_size`` typed ``object``: for what callers
    really pass). TypeError: ``batch_size`` not an integer (a numpy one is, a bool is not),
    ``decode``/``collate`` not callable. ValueError: ``transform`` not in :data:`TRANSFORMS`,
    ``batch_size`` < 1, ``num_workers`` < 0, decode/collate with the image path's ``image`` options.
    TypeError: ``transform`` a function (saying to pass it as ``decode=``)."""
    if callable(transform):
        raise TypeError(
            f"transform= names a built-in image recipe, one of {TRANSFORMS}; a function of your own "
            f"({getattr(transform, '__name__', type(transform).__name__)}) goes in decode=: decode(fields, rng) "
            "runs in the workers on each sample (docs/guide.md, 'Any kind of sample')"
        )
    if transform not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(
            f"batch_size must be an integer number of samples, got {type(batch_size).__name__} {batch_size!r}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    for role, fn in (("decode", decode), ("collate", collate)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{role} must be a function, got {type(fn).__name__} {fn!r}")
    if (decode is not None or collate is not None) and (
        image.cache_form is not None or image.decode_device is not None
    ):
        raise ValueError(
            "decode/collate (the user's samples) cannot be used with cache_form or decode_device "
            "(the built-in image paths)"
        )


def _check_dataset(dataset) -> None:
    """Refuse a torch dataset (:class:`stoker.errors.NotADatasetError`, naming what to pass): a
    ``torch.utils.data.Subset`` over a stoker Dataset, or any other ``torch.utils.data.Dataset``.
    The Loader reads a packed dataset block by block in its own order, so it cannot take a
    torch dataset's ``__getitem__``. Anything else passes here (checked where it is used)."""
    tud = sys.modules.get("torch.utils.data")  # no torch imported: no torch dataset to refuse
    if tud is None or not isinstance(dataset, tud.Dataset) or hasattr(dataset, "blocks"):
        return
    name = type(dataset).__name__
    if isinstance(dataset, tud.Subset) and hasattr(dataset.dataset, "blocks"):
        raise NotADatasetError(
            f"Loader() takes a stoker Dataset, not a torch.utils.data.Subset over one ({len(dataset)} of "
            f"{len(dataset.dataset)} samples of {dataset.dataset.url}): the Loader reads the packed dataset "
            "itself, in its own order; for part of it pass ds.subset(ids, keys or a predicate) or one of "
            "ds.split([0.9, 0.1], seed=...), which share its cache and index"
        )
    raise NotADatasetError(
        f"Loader() takes a packed stoker Dataset (stoker.open_dataset(url)), not a torch {name}: "
        "pack the data once with stoker.pack (or `stoker pack SRC DST`), then open it"
    )


@functools.cache
def _own_keywords() -> tuple[str, ...]:
    """The Loader's keyword names, suggested for a misspelled one."""
    return tuple(p for p in inspect.signature(Loader.__init__).parameters if p not in ("self", "deprecated"))


def _warn_small_staging(dataset, shuffle: bool, read: ReadOptions) -> None:
    """Log when ``read.staging_bytes`` is below two blockwise shuffle windows of blocks."""
    window = 2 * read.order_window * getattr(dataset, "block_bytes", 0) if read.order == "blockwise" else 0
    if shuffle and 0 < read.staging_bytes < window:  # type: ignore[operator]  # an int once ReadOptions is made
        log.warning(
            "staging_bytes=%d is below two shuffle windows of blocks (%d bytes): every batch of the "
            "blockwise order reads every block of its window, so blocks the cache does not admit "
            "will be read sample by sample from the origin",
            read.staging_bytes,
            window,
        )


def _whole(dataset):
    """The dataset a loader's pipeline reads: the whole packed dataset of a subset
    (``Dataset.subset``; read by the packed sample ids of ``Loader.plan``), else ``dataset``."""
    return getattr(dataset, "whole", dataset)


def _packed(selection: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """The packed dataset's sample ids of ``ids``, positions in a loader's dataset: the same ids
    unless it is a subset (``selection``: its ``Dataset.selection``)."""
    return ids if selection is None else selection[ids]


def _empty_reason(loader: Loader) -> str:
    """Why the epochs of ``loader`` deliver no sample ("" when they deliver some): :func:`why_empty`."""
    return why_empty(len(loader.dataset), loader.world_size, loader.read.even, loader.batch_size, loader.drop_last)


def _identity(loader: Loader) -> dict:
    """What a saved state of ``loader`` must agree on (:data:`stoker.loader.state.IDENTITY_KEYS`)."""
    ident = {
        "seed": loader.seed,
        "order": order_of(loader.read, loader.shuffle),
        "order_window": loader.read.order_window,
        "batch_size": loader.batch_size,
        "even": loader.read.even,
        "drop_last": loader.drop_last,
        "transform": loader.cfg.transform,
        "dataset_version": loader.dataset.version,
        "num_samples": len(loader.dataset),
        "subset": getattr(loader.dataset, "selection_digest", None),
        "cache_aware_window": loader.read.cache_aware_window,
        # a streaming collate's carry only means something to the same collate
        "carry_from": repr(loader.cfg.collate) if hasattr(loader.cfg.collate, "cut") else None,
    }
    assert tuple(ident) == IDENTITY_KEYS
    return ident


def _warn_cut_epoch(loader) -> None:
    """One RuntimeWarning per Loader when its state is taken right after an epoch whose iteration
    ended early (:attr:`stoker.loader.state.LoaderState.cut`): that state starts the next epoch,
    so a resume from it never trains the rest of the cut one (a checkpoint saved after a caught
    Ctrl-C). Intended by a loop that breaks on purpose (fewer batches per epoch); a checkpoint
    meant to resume where training stopped is saved inside the loop."""
    cut, st = loader.state.cut, loader.state
    if cut is None or st.position != (cut[0] + 1, 0) or st.cut_said:
        return
    st.cut_said = True
    warnings.warn(
        f"epoch {cut[0]} ended early, after {cut[1]} of its {cut[2]} batches (a break, a caught Ctrl-C or an "
        f"error ended its iteration): this state starts epoch {cut[0] + 1} at batch 0, and a resume from it "
        f"does not train the rest of epoch {cut[0]}. To resume where training stopped, take state_dict() "
        "inside the loop, before leaving it (docs/guide.md, Resume). Said once per Loader.",
        RuntimeWarning,
        stacklevel=3,
    )


class Loader:
    """Batches of decoded, augmented images (or of the user's samples) from a
    :class:`stoker.store.dataset.Dataset`.

    Iterating yields ``(images, labels)``: torch uint8 tensor (N, 3, S, S) and int64 tensor (N,),
    N = ``batch_size`` except maybe the last batch (or, with ``decode``/``collate``, the user's
    batches). Each ``iter()`` runs one epoch (``self.epoch``) and advances ``self.epoch`` by one
    when it starts, so an epoch cut short by ``break`` is not replayed (:meth:`set_epoch` chooses
    one); an ``iter()`` never asked for a batch gives its epoch back to the next ``iter()``. The
    images of a batch live in shared memory; the slot is reused only after every reference to the
    batch tensor is dropped.

    Args:
        dataset: the :class:`~stoker.store.dataset.Dataset` to read.
        batch_size: samples per batch (int >= 1; TypeError / ValueError otherwise).
        shuffle: use the permutation ``read.order`` of (``seed``, epoch); False: the identity.
        seed: seeds the permutation and each sample's augmentation (from (seed, epoch, sample id)).
        rank: this process's rank in [0, ``world_size``); None: from the environment
            (:mod:`stoker.loader.world`: an initialised ``torch.distributed`` group, else
            ``$RANK``), else 0.
        world_size: ranks; every rank gets the same count (``read.even``, :func:`stoker.order.rank_plan`).
            None: from the environment (the group's size, else ``$WORLD_SIZE``), else 1. A loader of
            one rank in a job of several warns once (every rank would read the whole dataset).
        num_workers: decode processes (0 = decode in this process; >= 0).
        drop_last: drop the last batch of an epoch when it is short.
        transform: ``"train"`` (RandomResizedCrop(S) + flip, per-sample RNG) or ``"eval"``
            (resize 256 + center crop S). ValueError otherwise.
        decode: the user's ``decode(fields, rng) -> sample``, run in the workers on every sample:
            ``fields`` is ``{field name: bytes}`` followed by ``"__key__"`` (str), ``"__id__"``
            (int, the sample id) and, where the sample has a label, ``"__label__"`` (int)
            (:meth:`stoker.store.dataset.Dataset.read_fields` with ``meta=True``), ``rng`` a
            ``numpy.random.Generator`` seeded by (seed, epoch, sample id). A decode that
            raises or returns None fails the batch with a WorkerError naming the sample's key
            (``run.on_error="skip"``: skipped and counted; a batch left with none gets substitutes,
            marked ``"__padding__"``: :class:`~stoker.loader.options.RunOptions`).
            :mod:`stoker.loader.workers.batches` says how
            the batches travel (shared memory for arrays, pickled otherwise).
        collate: the user's ``collate(samples) -> batch``, run in the workers too (default
            :func:`stoker.collate.default`; also :func:`stoker.collate.pad`,
            :func:`stoker.collate.pack_tokens`, :func:`stoker.collate.raw_bytes`, which without
            ``decode`` the workers read as a batch, straight into its slot, and
            :func:`stoker.collate.on_raw`, a user function of that raw batch, once per batch). Under
            ``spawn``/``forkserver`` both must pickle: TypeError naming the function otherwise.
            ``image`` options do not apply then.
        read: :class:`~stoker.loader.options.ReadOptions`: order, rank split, read-ahead.
        image: :class:`~stoker.loader.options.ImageOptions`: image size, EXIF, derived-form
            cache (``self.cache_form_report`` holds the rates of ``"auto"``), GPU decode
            (``self.device_decode_stats`` counts its samples per path).
            ``read``, ``image`` and ``run`` are kept as given (``self.read``, ``self.image``,
            ``self.run``; a group not given: its defaults) and handed whole to the parts that
            read them.
        run: :class:`~stoker.loader.options.RunOptions`: device, errors, timeout, start method,
            metrics port (``self.metrics_port`` and ``self.metrics_url`` say where they are
            served; the live figures also go, every second, beside the node cache's job records,
            where ``stoker top`` reads them, :mod:`stoker.loader.live`).
        **deprecated: the old flat keywords (``prefetch_bytes=...``, ``image_size=...``, ...),
            accepted for one release with a DeprecationWarning naming the new place
            (:data:`stoker.loader.options.DEPRECATED`); TypeError for an unknown keyword, and for
            an old keyword together with the group it belongs to.

    Raises:
        ForkUnsafeError: ``run.start_method="fork"`` (with workers) where fork is unsafe.
        WorkerStartError: ``run.start_method`` spawn/forkserver (with workers) from code whose
            main module such workers cannot import again (code fed on stdin).
        TypeError: ``decode``/``collate`` cannot reach workers started with spawn/forkserver.
        ValueError: ``rank``/``world_size`` out of range ($RANK/$WORLD_SIZE not integers; a
            ``world_size`` above 1 without ``rank`` in a job of another size), or decode/collate
            with ``image`` options that only the built-in image path uses.

    Origin bytes are charged to the epoch whose samples they serve, so warm epochs show only
    their own reads. Attributes besides the arguments: ``state``
    (:class:`stoker.loader.state.LoaderState`, where the stream stands), ``cfg`` (the frozen
    :class:`stoker.loader.options.WorkerConfig` the workers receive; ``batch_size`` is stored
    there and read from it), ``stats`` (the last epoch's
    :class:`~stoker.loader.epoch_stats.EpochStats`, whose docstring lists its fields),
    ``history`` (every epoch's) and ``live`` (the :class:`~stoker.loader.live.LiveTotals` that
    its metrics and ``stoker top`` read; ``live.snapshot()``: the figures now). The processes live
    in a :class:`stoker.loader.pipeline.run.Run` (:attr:`pipeline`), started by the first
    ``iter()`` and stopped by :meth:`close`. ``sampler`` and ``batch_sampler`` are what training
    frameworks look for (:func:`stoker.loader.adapters.sampler_for`,
    :func:`~stoker.loader.adapters.batch_sampler_of`).
    """

    #: what a training framework takes for this Loader's sampler (:func:`stoker.loader.adapters.sampler_for`)
    sampler = property(sampler_for, doc=sampler_for.__doc__)
    #: not there: raises NotADataLoaderError (:func:`stoker.loader.adapters.batch_sampler_of`)
    batch_sampler = property(batch_sampler_of, doc=batch_sampler_of.__doc__)

    def __new__(cls, *args, **kwargs):
        """A Loader, or a :class:`stoker.loader.mixed.MixLoader` over a mixture.

        Over a :class:`stoker.loader.mixture.Mixture` (:func:`stoker.mix`), a MixLoader with the
        same arguments, one Loader of ``cls`` per source. The dataset is the first argument or
        ``dataset=``; a subclass whose first argument is something else (the context of
        :class:`stoker.cluster.jobs.job.ClusterLoader`) makes a Loader."""
        dataset = args[0] if args else kwargs.get("dataset")
        if isinstance(dataset, Mixture):
            rest = {k: v for k, v in kwargs.items() if k != "dataset"}
            return MixLoader(cls, dataset, *args[1:], **rest)
        return super().__new__(cls)

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 2,
        drop_last: bool = False,
        transform: str = "train",
        decode=None,
        collate=None,
        read: ReadOptions | None = None,
        image: ImageOptions | None = None,
        run: RunOptions | None = None,
        **deprecated,
    ):
        # old keywords: warned, moved into groups; a torch DataLoader keyword: what to use instead
        read, image, run, epoch = settle(read, image, run, deprecated, _own_keywords() if deprecated else ())
        _check_args(batch_size, num_workers, transform, decode, collate, image)
        _check_dataset(dataset)
        device = batch_device(run, image)
        if isinstance(device, str) and device != "cpu":  # (not a stand-in runtime object)
            from .._torch import check_device

            check_device(device)  # RuntimeError (no CUDA) now, not at the first batch
        self.read, self.image, self.run = read, image, run
        self.dataset, self.shuffle, self.seed, self.drop_last = dataset, shuffle, int(seed), drop_last
        # a subset (Dataset.subset): the pipeline reads the whole packed dataset by its sample ids,
        # and the order, rank split and resume state count the subset's own samples
        whole = getattr(dataset, "whole", dataset)
        selection = getattr(dataset, "selection", None)
        self.num_workers = int(num_workers)
        self.state = LoaderState(epoch=epoch, position=(epoch, 0))
        self.rank, self.world_size = resolve(rank, world_size, stacklevel=user_stacklevel() + 1)
        _warn_small_staging(dataset, shuffle, read)
        # ForkUnsafeError now for start_method="fork" in a process where fork is unsafe (chosen again at start)
        self.start_method = (
            pick_start_method(run.start_method, mp.get_all_start_methods())[0]
            if num_workers
            else run.start_method or "fork"
        )
        self.cfg = WorkerConfig(
            transform=transform,
            seed=self.seed,
            image_size=image.image_size,
            on_error=run.on_error,
            exif_orientation=image.exif_orientation,
            batch_size=int(batch_size),
            decode_on="cpu" if image.decode_device is None else "device",
            decode=decode,
            collate=collate,
            substitutes=self.world_size > 1,  # only DDP needs every rank's batch count equal
            sample_ids=selection,
        )
        if num_workers:
            check_main_for(self.start_method)  # WorkerStartError: spawn children cannot start from here
            self.cfg.check_picklable(self.start_method)  # TypeError naming the function, now
        # the decoder of decode_device, made by the first iter() (after the workers are forked)
        self._device_decoder = (
            DeviceBatchDecoder(image.decode_device, whole, self.cfg) if image.decode_device is not None else None
        )
        self.cache_form_report: dict | None = None  # the derived form used and, for "auto", its measured rates
        self._derived_ready = False
        self.stats: EpochStats | None = None
        self.history: list[EpochStats] = []
        self._warned_empty = False  # the one warning that this loader's epochs deliver nothing
        self._ahead: ReadAhead | None = None  # the last iter()'s consumer, when it reads a batch ahead (Ray Train's)
        rank_plan(np.zeros(0, np.int64), self.rank, self.world_size, read.even)  # validates rank/world/even
        self.live = LiveTotals(dataset, self.cfg, rank=self.rank, world_size=self.world_size)
        # the pipeline (from the first iter() to close()), metrics, live figures: stopped by close(),
        # or by this finalizer when the loader is dropped without close() or the interpreter exits
        self._started = _Started(self.live, run.metrics_port)
        _OPEN.add(self._started)
        self._finalizer = weakref.finalize(self, self._started.close)
        self._started.export_metrics()
        # shadowed here by the class property; what a wrapper that copies __dict__ finds (Ray Train's)
        self.__dict__["sampler"] = CopiedSampler(self)

    @property
    def batch_size(self) -> int:
        """Samples per batch (int >= 1), as given: stored once, in :attr:`cfg` (the
        :class:`~stoker.loader.options.WorkerConfig` every part of the pipeline reads it from)."""
        return self.cfg.batch_size

    @property
    def metrics_port(self) -> int | None:
        """The port this loader's Prometheus metrics are served on (the one asked for, or the
        next free one where another program held it: logged), or None."""
        return self._started.metrics.port if self._started.metrics is not None else None

    @property
    def metrics_url(self) -> str | None:
        """``http://addr:port/metrics`` where this loader's metrics are served, or None."""
        metrics = self._started.metrics
        return metrics.url if metrics is not None else None

    # -- plan -------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> np.ndarray:
        """This rank's sample ids for ``epoch`` (default: the next epoch), in order (after a resume
        at another split of that epoch: this rank's share of its rest, ``state.offset``). Over a
        subset, the packed dataset's ids of its samples (``dataset.selection``)."""
        e = self.epoch if epoch is None else epoch
        return _packed(self.cfg.sample_ids, self._shares(e, self.state.served_before(e)).plan(self.rank))

    def _shares(self, epoch: int, served: np.ndarray | None, world_size: int | None = None) -> EpochShares:
        """Every rank's share of ``epoch`` over ``world_size`` ranks (default this loader's) when
        the samples ``served`` (bool by sample id) were served before: the interleaved split of
        :func:`stoker.order.rank_plan`, cut to whole batches with ``drop_last``. The resume state
        asks it what the ranks have served; a loader with a split of its own (the cluster's
        co-located one) overrides it."""
        order, window = order_of(self.read, self.shuffle), self.read.order_window
        groups = self.dataset.blocks.sample_block
        if self.cfg.sample_ids is not None:  # a subset: its samples' blocks (its order counts its own samples)
            groups = groups[self.cfg.sample_ids]
        perm = permutation(len(self.dataset), self.seed, epoch, order, groups=groups, window=window)
        shares = interleaved_shares(perm, world_size or self.world_size, self.read.even, served)
        return shares.whole_batches(self.batch_size) if self.drop_last else shares

    def padding_mask(self, epoch: int | None = None) -> np.ndarray:
        """Which samples of this rank's ``epoch`` (default: the next epoch) only repeat another to
        give every rank the same number (``read.even="pad"``): a bool array in the order the
        batches deliver them, so batch ``i`` holds ``mask[i * batch_size:(i + 1) * batch_size]``
        (:meth:`stoker.order.EpochShares.padding`); an epoch resumed at batch k of this plan
        delivers its batches from k on, whose samples are the mask's last ones. All False with
        ``even="drop"`` or when the ranks' shares are even. For evaluation over ranks: drop these
        samples before gathering metrics and every sample counts exactly once. Call it after the
        epoch's ``iter()`` (pass ``epoch=loader.epoch - 1`` then), or before it: the cache-aware
        order is fixed when the epoch starts."""
        e = self.epoch if epoch is None else epoch
        shares = self._shares(e, self.state.served_before(e))
        mask = shares.padding(self.rank)
        if self.read.cache_aware_window > 0 and self.dataset.cache is not None and e in self.state.hit_maps:
            from ..order import cache_aware

            ids = _packed(self.cfg.sample_ids, shares.plan(self.rank))
            where = cache_aware(
                np.arange(len(ids)),
                self.state.hit_maps[e][self.dataset.blocks.sample_block[ids]],
                self.read.cache_aware_window,
            )
            mask = mask[where]
        return mask

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, float]:
        """The order actually served in ``epoch``: :meth:`plan`, made cache-aware if
        ``read.cache_aware_window`` asks (then the cache state seen is kept in ``state``).

        Returns:
            (sample ids int64 (n,), mean displacement in positions from the plain plan; NaN
            over several ranks).
        """
        ids = self.plan(epoch)
        if self.read.cache_aware_window <= 0 or self.dataset.cache is None:
            return ids, 0.0
        from ..order import cache_aware, mean_displacement

        cached = self.state.hit_maps.get(epoch)
        if cached is None:
            cached = self.dataset.blocks.cached(self.dataset.cache, self.dataset.version)
            self.state.hit_maps = {e: m for e, m in self.state.hit_maps.items() if e >= epoch - 1}
            self.state.hit_maps[epoch] = cached
        out = cache_aware(ids, cached[self.dataset.blocks.sample_block[ids]], self.read.cache_aware_window)
        return out, (mean_displacement(ids, out) if self.world_size == 1 else float("nan"))

    def __len__(self) -> int:
        return -(-len(self.plan()) // self.batch_size)

    def __repr__(self) -> str:
        """``Loader('s3://b/train', batch_size=256, num_workers=8, epoch=0, rank=0, world_size=1)``
        (over a subset, ``samples=30, subset_of=120`` after the URL) and the option groups that
        differ from their defaults (their own reprs); nothing is
        started or planned for it."""
        groups = "".join(
            f", {name}={opt!r}"
            for name, opt in (("read", self.read), ("image", self.image), ("run", self.run))
            if opt != type(opt)()
        )
        url = getattr(self.dataset, "url", type(self.dataset).__name__)
        if self.cfg.sample_ids is not None:  # a subset: of how many
            url = f"{url!r}, samples={len(self.dataset)}, subset_of={len(_whole(self.dataset))}"
        else:
            url = repr(url)
        return (
            f"Loader({url}, batch_size={self.batch_size}, num_workers={self.num_workers}, epoch={self.epoch}, "
            f"rank={self.rank}, world_size={self.world_size}{groups})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at ``epoch``, batch 0. After :meth:`load_state_dict`, until a
        batch is taken, naming the loaded epoch keeps the loaded position (the Hugging Face Trainer
        calls ``set_epoch(epoch)`` before every ``iter()``, a resumed one too): the epoch continues
        where the checkpoint left it (:meth:`stoker.loader.state.LoaderState.set_epoch`).

        Raises:
            ValueError: a loaded position is pending and ``epoch`` is not its epoch (moving would
                serve samples twice or never); the message names both. Nothing changes then.
        """
        self.state.set_epoch(epoch)
        self._ahead = None  # a batch a consumer holds belongs to the position left
        if self._started.run is not None:
            self._started.run.drop_pre()

    @property
    def epoch(self) -> int:
        """The epoch after the last ``iter()``'s (``state.epoch``): the one the next ``iter()`` runs,
        unless the last ``iter()`` was never asked for a batch (then it runs that one again).
        Setting it is :meth:`set_epoch` (the same ValueError after a resume)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    # -- resume -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the job's stream stands: the epoch and ``samples_done``, how many of its samples
        all ranks together have been served, and ``served``, which ones when they are not the
        first ids of its permutation (a compressed bitmap; a split of its own, a resumed epoch)
        (once an epoch's iteration has ended early, by ``break``, ``close()`` or an error, the
        next epoch at 0: the next ``iter()`` runs that one, a cut epoch is not replayed).

        The state is the job's, not the rank's: with synchronous data-parallel training (DDP),
        where every rank has taken the same number of batches, every rank's state is the same, so
        saving rank 0's (as Lightning and accelerate do) is enough. Everything else is a pure
        function of the configuration (order of (seed, epoch); augmentation of (seed, epoch,
        sample id)), so a loader built with the same arguments in a new process and given this
        state yields the rest of the stream (batch for batch at the same world size; at another
        world size see :meth:`load_state_dict`). Plain ints and strings (JSON-serialisable); the
        format is :meth:`stoker.loader.state.LoaderState.to_dict`.

        Under Ray Train's ``prepare_data_loader`` wrapper (``move_to_device=True``), which takes
        each batch one ahead of the training loop, the batch it holds is not counted: the state
        says what the wrapper has handed to the loop (:class:`stoker.loader.adapters.ReadAhead`).

        Raises:
            RuntimeError: the Loader is iterated by a Ray Train wrapper of a shape stoker does not
                know (:meth:`stoker.loader.adapters.ReadAhead.held`).
        """
        ident, bs = _identity(self), self.batch_size
        _warn_cut_epoch(self)
        held = self._ahead is not None and self._ahead.held(self.state.position)
        return self.state.to_dict(
            ident, rank=self.rank, world_size=self.world_size, batch_size=bs, shares=self._shares, held=held
        )

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume from :meth:`state_dict`, saved on any rank at any world size (and, in cluster
        mode, placement): the next ``iter()`` continues that epoch with this rank's share of the
        samples not yet served, split again over this loader's ``world_size`` ranks, each served
        exactly once, the ranks even as ``read.even`` says (or starts the next epoch if that one
        was finished; an epoch with no batches, saved before its ``iter()``, is still run,
        yielding nothing, so ``epoch`` and ``history`` advance exactly as in the saved run). At
        the world size (and placement) that saved it the rest is the saved run's, batch for
        batch. This is the elastic deterministic resumption Mosaic Streaming documents. The
        per-rank state of earlier releases is still read (a DeprecationWarning). Loaded while an
        epoch is being iterated (a loop left by an exception, restored in the same process), that
        epoch's iterator is ended first: its next ``next()`` raises
        :class:`~stoker.errors.StaleIteratorError`, so it cannot serve its epoch beside the
        resumed stream.

        Raises ValueError when the state belongs to another dataset version or to a
        different seed, order, batch size, split mode or transform (the rest of the stream
        would not be the same; the message names the key), or cannot continue on this rank
        (:meth:`stoker.loader.state.LoaderState.load`), and, with ``strict`` (the default), when
        it lacks the keys that say which loader saved it (a trimmed ``{"epoch", "samples_done"}``;
        the message names them). ``strict=False`` resumes such a state with a ``RuntimeWarning``
        naming what it lacks. Nothing is changed then.
        """
        if isinstance(state, dict) and isinstance(state.get("mixture"), dict):  # a MixLoader's (loader/mixed.py)
            names = [src.get("name") for src in state["mixture"].get("sources", [])]
            raise ValueError(
                f"cannot resume: this state was saved by a loader over a mixture of {names} (it has 'mixture'); "
                "this Loader reads one dataset. Resume it with a Loader over the same stoker.mix(...)"
            )
        if self.state.iterating() and self._started.run is not None:
            # the resume takes that epoch's place: its iterator would otherwise go on serving its own
            # epoch, and the loaded position after it (samples twice)
            self._started.run.end_live(
                "load_state_dict(): the loaded position takes the place of the epoch being iterated; "
                "iterate the Loader again (a new iter()) for the resumed stream"
            )
        self.state.load(
            state,
            _identity(self),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            num_blocks=len(self.dataset.blocks),
            shares=self._shares,
            # a split of its own (the cluster's) cannot take a bare samples_done as the first ids
            interleaved=type(self)._shares is Loader._shares,
            resplit=type(self).plan is Loader.plan,  # a plan of its own (not from _shares) is not split again
            strict=strict,
        )
        self._ahead = None  # a batch a consumer holds belongs to the position left
        if self._started.run is not None:
            self._started.run.drop_pre()

    # -- the pipeline -----------------------------------------------------
    def _start(self) -> Run:
        """The started pipeline, started now if there is none (the derived-sample cache is set
        up first, once per loader). Raises what :meth:`stoker.loader.pipeline.run.Run.start` raises."""
        if self._started.run is not None:
            return self._started.run
        self._started.export_metrics()  # again after a close()
        if self.image.cache_form not in (None, "raw") and not self._derived_ready:
            from dataclasses import replace

            from .derived import setup

            derived, self.cache_form_report = setup(
                _whole(self.dataset), self.image, workers=self.num_workers, mode=self.cfg.transform
            )
            self.cfg, self._derived_ready = replace(self.cfg, derived=derived), True
            log.info("derived-sample cache: %s", self.cache_form_report)
        config = RunConfig(_whole(self.dataset), self.cfg, self.num_workers, self.read, self.image, self.run)
        hooks = RunHooks(  # weak: the pipeline never keeps its loader alive (no reference cycle)
            state=self.state,
            plan=_weak(self.epoch_plan),
            record=_weak(self._record),
            live=self.live,
            device_decoder=self._device_decoder,  # (holds the dataset and cfg, not the loader)
        )
        run = Run(config, hooks)
        try:
            run.start()
        except BaseException:
            run.close()
            raise
        self.start_method = run.start_method
        self._started.run, self._started.pid = run, os.getpid()
        return run

    def close(self) -> None:
        """Stop workers and the prefetcher, unlink shared memory. Idempotent; a later
        ``iter()`` starts a new pipeline. Also stops serving its metrics and removes its live
        figures (a later ``iter()`` serves them again).

        A Loader dropped without ``close()`` is closed when it is collected (it is in no
        reference cycle, so at once in CPython once no name and no epoch's iterator holds it),
        and every Loader still open is closed at interpreter exit (``weakref.finalize``)."""
        started = getattr(self, "_started", None)
        if started is not None:
            # a close run by a KeyboardInterrupt (except/with) drops a second Ctrl-C: one traceback
            started.close(deliver_interrupt=not isinstance(sys.exc_info()[1], KeyboardInterrupt))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self) -> EpochIterator:
        """The next epoch's batches (see the class doc). An earlier epoch's iterator still open
        is ended at once, and its next ``next()`` raises
        :class:`~stoker.errors.StaleIteratorError` (a Loader serves one epoch at a time); if no batch
        was asked of it, this ``iter()`` serves that epoch, from the same place (a framework's look
        at the loader, or a resumed position, is not used up). An
        epoch that will deliver no sample of a dataset that has some (``drop_last``, more ranks
        than samples with ``even="drop"``) warns once per loader, naming why."""
        reason = _empty_reason(self)
        if reason and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                f"epoch {self.state.epoch} of rank {self.rank} delivers no sample of {len(self.dataset)}, nor will "
                f"the later ones: {reason}",
                RuntimeWarning,
                stacklevel=2,
            )
        t_iter = time.perf_counter()
        started = self._started.run is not None
        run = self._start()
        start_s = 0.0 if started else time.perf_counter() - t_iter  # stats.pipeline_start_s
        # the next iter() is the next epoch, even if this one is cut short (or this one again, if
        # no batch of it is asked for before: LoaderState.open_epoch)
        epoch, start = self.state.open_epoch()
        it = run.epoch(epoch, start, start_s=start_s, owner=self)
        self._ahead = read_ahead(self, it)  # Ray Train's wrapper: the state leaves out the batch it holds
        return it

    @property
    def device_decode_stats(self):
        """Samples decoded on the device / by the CPU fallback (``GpuDecodeStats``), or None
        without ``decode_device``."""
        return getattr(self._device_decoder.decoder, "stats", None) if self._device_decoder is not None else None

    @property
    def pipeline(self) -> Run | None:
        """The started pipeline (:class:`stoker.loader.pipeline.run.Run`: its ``ring``, ``transfer``,
        ``start_method``, ``check_processes()``), or None before the first ``iter()`` and after
        :meth:`close`. For inspection (tests, benchmarks)."""
        return self._started.run

    @property
    def processes(self) -> Processes:
        """The started pipeline's worker and prefetch processes, read-only
        (:class:`stoker.loader.pipeline.run.Processes`; empty before the first ``iter()``)."""
        run = self._started.run
        return run.processes() if run is not None else Processes()

    def _record(self, stats: EpochStats) -> None:
        """An epoch ended (the pipeline's call): its stats become ``stats`` and join ``history``.
        An epoch that delivered nothing because of the configuration does not claim to be
        exactly once (``stats.empty_reason`` says why)."""
        reason = _empty_reason(self)
        if reason and stats.samples == 0:
            stats.exactly_once, stats.empty_reason = False, reason
        self.stats = stats
        self.history.append(stats)
