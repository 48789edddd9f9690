"""Raw batches read as batches: a worker's side of ``collate=stoker.collate.raw_bytes``.

A Loader without ``decode`` whose collate is :func:`stoker.collate.raw_bytes` yields
:class:`stoker.collate.RawBatch` batches: the samples' payload bytes as stored. Built sample by
sample, such a batch costs a ``bytes`` object, a dict and two copies per sample in the worker
(:class:`stoker.loader.workers.batches.GenericDecoder`). Here a worker builds it as one batch
(:class:`RawBatchReader`):

1. the batch's sample ids become one array of payload offsets and lengths from the index, and
   the batch's layout in its slot (:func:`stoker.collate.raw_layout`: data, offsets, ids, labels);
2. the samples' payloads are read straight into memoryviews of the batch's shared-memory slot by
   :func:`stoker.loader.workers.batchread.read_batch`: one ``os.preadv`` per run of adjacent samples
   of a cached block, through the cache's open descriptor of the block (``cache.with_fd``), no
   ``bytes`` per sample, no copy after the read, each sample checked in place against its xxh3-64
   checksum; a sample not in the cache, short or failing the check is read the ordinary way
   (:meth:`stoker.store.dataset.Dataset.read`) and copied into its place, its errors naming its key.

The reply is the one :func:`stoker.loader.workers.batches.pack_reply` makes for a batch through the
slot (``("shm", tree, specs, slot bytes, rest)``), so the training process receives it unchanged
(:func:`stoker.loader.workers.batches.receive`): tensors over the slot, the slot held until every
view of the batch is dropped.

Without workers (``num_workers=0``) the training process reads each batch the same way into a
buffer of the batch's own (:class:`RawBatchesHere`).

With ``collate=stoker.collate.on_raw(fn)`` (a batch-level user function) the same layout is read
into a buffer the worker keeps instead of the slot, ``fn`` is called once with the
:class:`stoker.collate.RawBatch` over it, and what ``fn`` returns goes through the slot as any
collate's batch (:func:`stoker.loader.workers.batches.pack_reply`).
"""

from __future__ import annotations

import pickle

import numpy as np

from ...collate import OnRaw, RawBatch, one_size, raw_bytes, raw_layout
from ...errors import SampleFnError
from .batches import ALIGN_BYTES, SlotWriter, fn_name
from .batchread import read_batch

__all__ = ["RawBatchReader", "RawBatchesHere", "reads_raw"]

_I8 = np.dtype(np.int64)


def reads_raw(cfg) -> bool:
    """Whether a worker of ``cfg`` (a :class:`stoker.loader.options.WorkerConfig`) reads raw batches
    itself: no ``decode`` and ``collate`` is :func:`stoker.collate.raw_bytes` or a
    :func:`stoker.collate.on_raw`."""
    return cfg.decode is None and (cfg.collate is raw_bytes or isinstance(cfg.collate, OnRaw))


def _view(buf: np.ndarray, dtype: str, shape: tuple, at: int) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` at byte ``at`` of ``buf`` (uint8): a view, no copy."""
    dt = np.dtype(dtype)
    return buf[at : at + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class RawBatchReader:
    """Reads a batch of raw samples into its slot (see the module's docstring).

    Args:
        ds: the worker's :class:`stoker.store.dataset.Dataset` (its reader, cache and index).
        cfg: the :class:`stoker.loader.options.WorkerConfig` (for :func:`reads_raw`).
    """

    def __init__(self, ds, cfg):
        self.ds, self.cfg = ds, cfg
        self._tree = ("named", 0, [("pt", k) for k in range(4)])
        self._rest = pickle.dumps([RawBatch], protocol=pickle.HIGHEST_PROTOCOL)
        collate = getattr(cfg, "collate", None)
        self._on_raw = collate if isinstance(collate, OnRaw) else None
        self._buf: bytearray | None = None
        # the batches' form, decided once for every sample this loader reads (a subset's own):
        # (N, L) when they all have one size, else flat, whatever sizes one batch happens to hold
        ids = getattr(cfg, "sample_ids", None)
        self._fixed = one_size(ds.index.length if ids is None else ds.index.length[ids])

    def run(self, ids, path: str, writer: SlotWriter, current=None) -> tuple[int, tuple]:
        """Read the samples ``ids`` (int64 (N,)) into the slot at ``path``: ``(N, reply)`` with the
        reply of :func:`stoker.loader.workers.batches.pack_reply`; a batch the slot cannot grow to
        hold (``/dev/shm`` full) is built by :func:`stoker.collate.raw_bytes` and pickled instead.
        With a :func:`stoker.collate.on_raw` collate the batch is read into this worker's own
        buffer, given to its function once, and what that returns goes into the slot.

        Raises:
            ChecksumError: a sample's bytes are wrong at their source too (names its key).
            OriginError: the origin failed for a sample that had to be read there (names it).
            SampleFnError: an ``on_raw`` function raised (names it and the batch's first keys).
        """
        from .batches import pack_reply

        sids = np.asarray(ids, dtype=np.int64)
        layout = self._layout(sids)
        specs, nbytes = layout[0], layout[1]
        if self._on_raw is not None:
            raw = self._read(sids, layout, self._scratch(nbytes), current)
            return len(sids), pack_reply(writer, path, self._call(raw, sids, current))
        mm = writer.reserve(path, nbytes)
        if mm is None:
            samples = [self.ds.read_fields(int(s), meta=True) for s in sids]
            return len(sids), pack_reply(writer, None, raw_bytes(samples))
        self._read(sids, layout, mm, current, tensors=False)
        return len(sids), ("shm", self._tree, specs, len(mm), self._rest)

    def run_here(self, epoch: int, ids, current=None) -> tuple:
        """The batch of ``ids`` read in the training process (``num_workers=0``), as
        :meth:`stoker.loader.workers.batches.GenericDecoder.run` returns it: ``(N, [], [], batch,
        [])``. Each batch gets a buffer of its own (a kept batch is never overwritten); ``epoch``
        is not used (raw reads draw nothing). Raises as :meth:`run`."""
        sids = np.asarray(ids, dtype=np.int64)
        layout = self._layout(sids)
        raw = self._read(sids, layout, bytearray(layout[1]), current)
        return len(sids), [], [], raw if self._on_raw is None else self._call(raw, sids, current), []

    def _layout(self, sids: np.ndarray) -> tuple[list[tuple], int, np.ndarray, np.ndarray]:
        """``(specs, size, lengths, offsets)``: the batch's arrays (dtype, shape, byte offset) in
        its buffer, data first, then offsets, ids and labels at aligned offsets; the buffer's size
        in bytes; the samples' payload lengths (int64 (N,)) and offsets (int64 (N + 1,))."""
        n = len(sids)
        lengths = self.ds.index.length[sids].astype(np.int64)
        offsets, shape = raw_layout(lengths, self._fixed)
        at1 = _align(int(offsets[-1]))
        at2 = _align(at1 + (n + 1) * 8)
        at3 = _align(at2 + n * 8)
        specs = [
            (np.dtype(np.uint8).str, shape, 0),
            (_I8.str, (n + 1,), at1),
            (_I8.str, (n,), at2),
            (_I8.str, (n,), at3),
        ]
        return specs, at3 + n * 8, lengths, offsets

    def _read(self, sids: np.ndarray, layout: tuple, mm, current, tensors: bool = True):
        """Write the batch's offsets, ids and labels into ``mm`` where ``layout`` (:meth:`_layout`)
        puts them and read its samples' payloads into ``mm[0:]``
        (:func:`stoker.loader.workers.batchread.read_batch`); the :class:`~stoker.collate.RawBatch`
        of torch tensors over ``mm`` when ``tensors``."""
        buf = np.frombuffer(mm, dtype=np.uint8)
        specs, _, lengths, at = layout
        data, offsets, ids, labels = (_view(buf, dt, sh, o) for dt, sh, o in specs)
        offsets[:] = at
        ids[:] = sids
        labels[:] = self.ds.index.labels[sids]
        labels[labels < 0] = -1
        view = memoryview(mm)
        try:
            read_batch(self.ds, sids, lengths, at, view, current)
        finally:
            view.release()
        if not tensors:
            return None
        import torch

        return RawBatch(*(torch.from_numpy(a) for a in (data, offsets, ids, labels)))

    def _call(self, raw: RawBatch, sids: np.ndarray, current):
        """The ``on_raw`` function's batch of ``raw``; its failure names it and the batch."""
        assert self._on_raw is not None
        if current is not None:
            current.value = -1  # a failure of fn is the batch's, not the last sample read's
        try:
            return self._on_raw.fn(raw)
        except Exception as exc:  # noqa: BLE001 - named with the batch's samples, as a collate's
            keys = [self.ds.key(int(s)) for s in sids[:3]]
            raise SampleFnError(
                None,
                f"on_raw function {fn_name(self._on_raw.fn)} failed on the batch of samples "
                f"{keys}{'...' if len(sids) > 3 else ''}: {type(exc).__name__}: {exc}",
            ) from exc

    def _scratch(self, nbytes: int) -> bytearray:
        """This worker's buffer for :func:`stoker.collate.on_raw` batches, at least ``nbytes`` long
        (grown by doubling, kept for the next batch)."""
        buf = self._buf
        if buf is None or len(buf) < nbytes:
            buf = self._buf = bytearray(max(nbytes, 2 * len(buf) if buf is not None else 0))
        return buf


class RawBatchesHere:
    """The decoder of ``num_workers=0`` (:class:`stoker.loader.workers.inline.InlineLoop`) for raw
    batches: :meth:`RawBatchReader.run_here` as its ``run(epoch, ids, current)``, so a Loader
    without workers reads a batch as a batch too (one ``os.preadv`` per run of cached samples)
    rather than through :func:`stoker.collate.raw_bytes` sample by sample.

    Args: as :class:`RawBatchReader`.
    """

    def __init__(self, ds, cfg):
        self.reader = RawBatchReader(ds, cfg)
        self.ds = ds

    def run(self, epoch: int, ids, current=None) -> tuple:
        """:meth:`RawBatchReader.run_here`."""
        return self.reader.run_here(epoch, ids, current)
