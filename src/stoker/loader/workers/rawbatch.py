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
"""

from __future__ import annotations

import pickle

import numpy as np

from ...collate import RawBatch, raw_bytes, raw_layout
from .batches import ALIGN_BYTES, SlotWriter
from .batchread import read_batch

__all__ = ["RawBatchReader", "reads_raw"]

_I8 = np.dtype(np.int64)


def reads_raw(cfg) -> bool:
    """Whether a worker of ``cfg`` (a :class:`stoker.loader.options.WorkerConfig`) reads raw batches
    itself: no ``decode`` and ``collate`` is :func:`stoker.collate.raw_bytes`."""
    return cfg.decode is None and cfg.collate is raw_bytes


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

    def run(self, ids, path: str, writer: SlotWriter, current=None) -> tuple[int, tuple]:
        """Read the samples ``ids`` (int64 (N,)) into the slot at ``path``: ``(N, reply)`` with the
        reply of :func:`stoker.loader.workers.batches.pack_reply`; a batch the slot cannot grow to
        hold (``/dev/shm`` full) is built by :func:`stoker.collate.raw_bytes` and pickled instead.

        Raises:
            ChecksumError: a sample's bytes are wrong at their source too (names its key).
            OriginError: the origin failed for a sample that had to be read there (names it).
        """
        from .batches import pack_reply

        ds = self.ds
        index = ds.index
        sids = np.asarray(ids, dtype=np.int64)
        n = len(sids)
        lengths = index.length[sids].astype(np.int64)
        offsets, shape = raw_layout(lengths)
        at = [0, _align(int(offsets[-1]))]
        at += [_align(at[1] + (n + 1) * 8), 0]
        at[3] = _align(at[2] + n * 8)
        mm = writer.reserve(path, at[3] + n * 8)
        if mm is None:
            samples = [ds.read_fields(int(s), meta=True) for s in sids]
            return n, pack_reply(writer, None, raw_bytes(samples))
        slot = np.frombuffer(mm, dtype=np.uint8)
        slot[at[1] : at[1] + (n + 1) * 8].view(_I8)[:] = offsets
        slot[at[2] : at[2] + n * 8].view(_I8)[:] = sids
        labels = slot[at[3] : at[3] + n * 8].view(_I8)
        labels[:] = index.labels[sids]
        labels[labels < 0] = -1
        view = memoryview(mm)
        try:
            read_batch(self.ds, sids, lengths, offsets, view, current)
        finally:
            view.release()
            del slot, labels
        specs = [
            (np.dtype(np.uint8).str, shape, 0),
            (_I8.str, (n + 1,), at[1]),
            (_I8.str, (n,), at[2]),
            (_I8.str, (n,), at[3]),
        ]
        return n, ("shm", self._tree, specs, len(mm), self._rest)
