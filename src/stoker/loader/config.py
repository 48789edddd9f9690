"""Frozen records of a loader's configuration: what the decode workers (and the device decoder)
need to know (:class:`WorkerConfig`), and what one started pipeline needs (:class:`RunConfig`).

A :class:`WorkerConfig` is built once from the :class:`stoker.loader.Loader` arguments and pickled
to every worker process with its first task queue; being frozen, no process can change it under
another. A :class:`RunConfig` is built by the Loader each time it starts a pipeline
(:class:`stoker.loader.pipeline.run.Run`), which reads nothing else of the Loader's configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Processes", "RunConfig", "RunHooks", "WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """How a batch's samples are decoded and augmented.

    Attributes:
        transform: ``"train"`` (RandomResizedCrop + flip, per-sample RNG) or ``"eval"``
            (resize 256 + center crop), see :mod:`stoker.decode.transforms`.
        seed: the loader's seed; each sample's RNG is seeded from (seed, epoch, sample id)
            (:func:`stoker.order.sample_seed`).
        image_size: output side S in pixels; images are uint8 (3, S, S).
        on_error: ``"raise"`` (a sample no decoder reads fails the batch) or ``"skip"``.
        exif_orientation: apply the EXIF orientation tag when decoding.
        batch_size: samples per batch (the slot layout, :mod:`stoker.loader.shm`).
        decode_on: ``"cpu"`` (the workers decode) or ``"device"`` (the workers only read and
            verify bytes; the training process decodes, :mod:`stoker.loader.device.device_decode`).
        derived: the derived-sample cache (:class:`stoker.loader.derived.DerivedCache`) the
            workers read from and fill, or None (set when the pipeline starts, with
            :func:`dataclasses.replace`).
        decode: the user's ``decode(fields, rng) -> sample``, or None (:mod:`stoker.loader.workers.batches`).
        collate: the user's ``collate(samples) -> batch``, or None (:func:`stoker.collate.default`
            when ``decode`` is set).
    """

    transform: str
    seed: int
    image_size: int
    on_error: str
    exif_orientation: bool
    batch_size: int
    decode_on: str = "cpu"
    derived: Any = None
    decode: Any = None
    collate: Any = None

    @property
    def generic(self) -> bool:
        """True when the user's decode/collate make the batches (not the built-in image recipes)."""
        return self.decode is not None or self.collate is not None

    def check_picklable(self, start_method: str) -> None:
        """Check that ``decode`` and ``collate`` can be sent to workers started with
        ``start_method`` (``fork`` sends nothing: a child inherits them).

        Raises:
            TypeError: one of them cannot be pickled, or is defined in a ``__main__`` that such a
                worker cannot import (code fed on stdin, ``python -c``, an interactive session, a
                notebook); names the function and says what to do.
        """
        if start_method == "fork":
            return
        import pickle

        from .._procs import main_importable, main_module_name

        for role, fn in (("decode", self.decode), ("collate", self.collate)):
            if fn is None:
                continue
            if getattr(fn, "__module__", None) == "__main__" and not main_importable():
                raise TypeError(
                    f"{role}=__main__.{getattr(fn, '__qualname__', type(fn).__qualname__)} cannot be sent to worker "
                    f"processes started with {start_method!r}: it is defined in {main_module_name()}, which they "
                    "cannot import. Define it in a module file the workers can import, or pass start_method='fork'"
                )
            try:
                pickle.dumps(fn)
            except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
                name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
                raise TypeError(
                    f"{role}={name} cannot be sent to worker processes started with {start_method!r}: it does not "
                    f"pickle ({type(exc).__name__}: {exc}). Define it at the top level of a module the workers can "
                    f"import (not a lambda or a nested function), or pass start_method='fork'"
                ) from exc


@dataclass(frozen=True)
class RunConfig:
    """What one started pipeline (:class:`stoker.loader.pipeline.run.Run`) is built from.

    Attributes:
        dataset: the :class:`~stoker.store.dataset.Dataset` read.
        cfg: the :class:`WorkerConfig` the workers get (its ``derived`` set when the pipeline starts).
        num_workers: decode processes (0: decode in the training process).
        batch_size: samples per batch.
        prefetch_batches: batches in flight at the workers (>= 1, resolved).
        prefetch_bytes: bytes the prefetcher runs ahead.
        staging_bytes: most bytes of staged blocks.
        fetch_concurrency: least ranged GETs in flight.
        timeout_s: longest wait in seconds for one batch before WorkerError.
        start_method: the start method asked for (None: chosen at start).
        device: where batches are delivered (None/"cpu": shared-memory tensors; "cuda[:N]").
        prefetch_next_epoch: dispatch the next epoch's first batches while this one drains.
        epochs: the epochs the job runs (``RunOptions.epochs``; None: no bound): no head start
            past epoch ``epochs - 1``.
    """

    dataset: Any
    cfg: WorkerConfig
    num_workers: int
    batch_size: int
    prefetch_batches: int
    prefetch_bytes: int
    staging_bytes: int
    fetch_concurrency: int
    timeout_s: float
    start_method: str | None
    device: Any
    prefetch_next_epoch: bool
    epochs: int | None = None


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
