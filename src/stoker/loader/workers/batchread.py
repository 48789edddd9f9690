"""A batch's samples read as a batch: each cached block's byte ranges read straight into a buffer.

Read one at a time (:meth:`stoker.store.dataset.Dataset.read`), a sample costs the cache's
bookkeeping (the block's descriptor looked up, its size checked), a new ``bytes`` object and a
copy. :func:`read_batch` reads a whole batch's payloads into places of one buffer the caller
owns (the batch's shared-memory slot for raw batches, :mod:`.rawbatch`; a worker's reused scratch
buffer for the built-in decode, :mod:`.worker`):

1. the samples are grouped by cache block; each block's byte ranges are read with one
   ``os.preadv`` per run of samples that lie end to end in it, through the cache's open
   descriptor of the block (``cache.with_fd``), straight into memoryviews of the buffer;
2. each sample is checked in place against its xxh3-64 checksum in the index;
3. a sample whose block is not in the node cache (staged, being filled, evicted, or no cache
   at all), whose read came back short, or whose bytes fail the check, is read the ordinary way
   instead (:meth:`stoker.store.dataset.Dataset.read`: staging area, block fetch, origin; a damaged
   cached block is dropped there) and copied into its place; its errors
   (:class:`stoker.errors.ChecksumError`, :class:`stoker.errors.OriginError`) name its key as on
   every path.

The counters (the reader's ``samples`` and ``cache_hits``, the cache's ``hits``, a cluster router's
local bytes) are those the samples' reads one by one would have counted.
"""

from __future__ import annotations

import os

import numpy as np
import xxhash

__all__ = ["read_batch"]


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


def read_batch(ds, sids: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, view: memoryview, current=None) -> None:
    """Every sample's payload into ``view[offsets[k]:offsets[k] + lengths[k]]``: from the cache's
    block files where it can, checked in place; the others read the ordinary way and copied.

    Args:
        ds: the :class:`stoker.store.dataset.Dataset` (its reader, cache, blocks and index).
        sids: the samples' ids, int64 (N,).
        lengths: their payload lengths in bytes, int64 (N,) (``ds.index.length[sids]``).
        offsets: where each goes in ``view``, in bytes, int64 (N,) or more (only the first N are read).
        view: a writable byte memoryview holding every place.
        current: the worker's shared cell of the sample being read (set per sample checked or
            read again), or None.

    Raises:
        ChecksumError: a sample's bytes are wrong at their source too (names its key).
        OriginError: the origin failed for a sample that had to be read there (names it).
    """
    reader = ds.reader
    from_cache = _cached(ds, sids, lengths, offsets, view, reader)
    ids, at, size = sids.tolist(), offsets.tolist(), lengths.tolist()
    want = ds.index.checksum[sids].tolist()
    again = []
    for k in np.flatnonzero(from_cache).tolist():
        if current is not None:
            current.value = ids[k]
        if xxhash.xxh3_64_intdigest(view[at[k] : at[k] + size[k]]) != want[k]:
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
        view[at[k] : at[k] + size[k]] = ds.read(ids[k])


def _cached(ds, sids: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, view: memoryview, reader) -> np.ndarray:
    """Read every sample whose block the node cache holds into its place in ``view``, one
    ``os.preadv`` per run of adjacent samples of a block; bool (N,): which were read whole."""
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
