"""Raw batches read as batches: a worker's side of ``collate=stoker.collate.raw_bytes``.

A Loader without ``decode`` whose collate is :func:`stoker.collate.raw_bytes` yields
:class:`stoker.collate.RawBatch` batches: the samples' payload bytes as stored. Built sample by
sample, such a batch costs a ``bytes`` object, a dict and two copies per sample in the worker
(:class:`stoker.loader.workers.batches.GenericDecoder`). Here a worker builds it as one batch
(:class:`RawBatchReader`):

1. the batch's sample ids become one array of payload offsets and lengths from the index, and
   the batch's layout in its slot (:func:`stoker.collate.raw_layout`: data, offsets, ids, labels);
2. the samples are grouped by cache block; each block's byte ranges are read with one
   ``os.preadv`` per run of adjacent samples, through the cache's open descriptor of the block
   (``cache.with_fd``), straight into memoryviews of the batch's shared-memory slot: no ``bytes``
   per sample, no copy after the read;
3. each sample is checked in place against its xxh3-64 checksum in the index
   (:func:`stoker.store.checks.sample_ok`).

A sample whose block is not in the node cache (staged, being filled, evicted, or no cache at all),
whose read came back short, or whose bytes fail the check, is read the ordinary way instead
(:meth:`stoker.store.dataset.Dataset.read`: staging area, block fetch, origin; a damaged cached
block is dropped there) and copied into its place; its errors (:class:`stoker.errors.ChecksumError`,
:class:`stoker.errors.OriginError`) name its key as they do on every path.

The reply is the one :func:`stoker.loader.workers.batches.pack_reply` makes for a batch through the
slot (``("shm", tree, specs, slot bytes, rest)``), so the training process receives it unchanged
(:func:`stoker.loader.workers.batches.receive`): tensors over the slot, the slot held until every
view of the batch is dropped.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import xxhash

from ...collate import RawBatch, raw_bytes, raw_layout
from .batches import ALIGN_BYTES, SlotWriter

__all__ = ["RawBatchReader", "reads_raw"]

_I8 = np.dtype(np.int64)


def reads_raw(cfg) -> bool:
    """Whether a worker of ``cfg`` (a :class:`stoker.loader.options.WorkerConfig`) reads raw batches
    itself: no ``decode`` and ``collate`` is :func:`stoker.collate.raw_bytes`."""
    return cfg.decode is None and cfg.collate is raw_bytes


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _runs(group: list[int], rel: list[int], lengths: list[int]) -> list[list[int]]:
    """``group`` (positions in the batch, sorted by their block offsets ``rel``) cut into runs of
    samples that lie end to end in the block (one ``preadv`` each)."""
    runs = [[group[0]]]
    for k in group[1:]:
        last = runs[-1][-1]
        if rel[k] == rel[last] + lengths[last]:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


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
            self._fill(sids, lengths, offsets, view, current)
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

    def _fill(self, sids: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, view: memoryview, current) -> None:
        """Every sample's payload into ``view[offsets[k]:offsets[k+1]]``: from the cache's block files
        where it can, checked in place; the others read the ordinary way and copied."""
        ds = self.ds
        reader = ds.reader
        from_cache = self._cached(sids, lengths, offsets, view, reader)
        ids, at, want = sids.tolist(), offsets.tolist(), ds.index.checksum[sids].tolist()
        again = []
        for k in np.flatnonzero(from_cache).tolist():
            if current is not None:
                current.value = ids[k]
            if xxhash.xxh3_64_intdigest(view[at[k] : at[k + 1]]) != want[k]:
                again.append(k)  # its read below drops the damaged block (BlockReader.read_range)
        hits = int(from_cache.sum()) - len(again)
        reader.stats.samples += hits
        reader.stats.cache_hits += hits
        if ds.cache is not None:
            ds.cache.stats.hits += hits
        again.extend(np.flatnonzero(~from_cache).tolist())
        for k in again:
            if current is not None:
                current.value = ids[k]
            view[at[k] : at[k + 1]] = ds.read(ids[k])

    def _cached(
        self, sids: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, view: memoryview, reader
    ) -> np.ndarray:
        """Read every sample whose block the node cache holds into its place in ``view``, one
        ``os.preadv`` per run of adjacent samples of a block; bool (N,): which were read whole."""
        ds = self.ds
        got = [False] * len(sids)  # a list: numpy's item assignment costs ~2 us a call here
        with_fd = getattr(ds.cache, "with_fd", None)  # a read-only cache has none: read the ordinary way
        if with_fd is None:
            return np.zeros(len(sids), dtype=bool)
        blocks = ds.blocks
        bids = blocks.sample_block[sids].astype(np.int64)
        rel_a = ds.index.offset[sids].astype(np.int64) - blocks.start[bids]
        order = np.lexsort((rel_a, bids)).tolist()
        # plain ints from here: a group is one or a few samples, where numpy's per-call cost dominates
        rel, size, at, block = rel_a.tolist(), lengths.tolist(), offsets.tolist(), bids.tolist()
        groups: list[list[int]] = []
        for k in order:
            if groups and block[groups[-1][0]] == block[k]:
                groups[-1].append(k)
            else:
                groups.append([k])
        router = reader.router
        for group in groups:

            def use(fd, group=group):
                for run in _runs(group, rel, size):
                    bufs = [view[at[k] : at[k] + size[k]] for k in run]
                    if os.preadv(fd, bufs, rel[run[0]]) == sum(size[k] for k in run):
                        for k in run:
                            got[k] = True
                return True

            # count: the samples a tiered cache adds to the hits of the tier that served them
            b = block[group[0]]
            if with_fd(ds.version, blocks.name(b), use, count=len(group)) and router is not None:
                router.local(sum(size[k] for k in group if got[k]), b)
        return np.array(got, dtype=bool)
