"""Runs of adjacent blocks fetched with one ranged GET (merged GETs).

Against a far origin every request pays the round trip, whatever its size: at 100 ms and
1,000 MB/s a 1 MiB block spends 1 ms on the wire and 100 ms waiting. Blocks ``b, b+1, ...``
of one shard lie next to each other in it (:func:`stoker.store.blockmap.plan_blocks` numbers
them by (shard, offset)), so when the epoch's order wants several of them soon, one GET of
``[start(b), end(b+k))`` brings them all for one round trip. The run is split into its
blocks, each verified against the index's per-sample checksums and admitted to the cache (or
the loader's staging area) on its own, exactly as a block-by-block fill would leave them.

A run is capped at ``cap_bytes``; the prefetcher sizes the cap to the origin's measured
bandwidth-delay product (:func:`merge_cap_bytes`), past which a bigger GET no longer saves a
round trip worth its bytes and only delays the first of its blocks.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack

from ..errors import ChecksumError, OriginError
from . import fill_failures
from .checks import verify_block

log = logging.getLogger(__name__)

#: Most bytes one merged GET reads (8 MiB), whatever the bandwidth-delay product says.
MAX_MERGE_BYTES = 8 << 20


def merge_cap_bytes(
    latency_s: float, bandwidth_Bps: float, block_bytes: int, ceiling_bytes: int = MAX_MERGE_BYTES
) -> int:
    """Largest merged GET (bytes) for an origin of per-request ``latency_s`` (s) and
    ``bandwidth_Bps`` (bytes/s): the bandwidth-delay product ``latency_s * bandwidth_Bps``
    (the bytes the link carries in one round trip), at least ``block_bytes`` and at most
    ``ceiling_bytes``. Before both are measured (latency not finite or > 0, bandwidth 0) it is
    ``block_bytes``: no merging until the origin's figures are known."""
    if not (0 < latency_s < float("inf")) or bandwidth_Bps <= 0:
        return int(block_bytes)
    return int(max(block_bytes, min(ceiling_bytes, latency_s * bandwidth_Bps)))


def adjacent_run(ds, b: int, wanted, cap_bytes: int) -> list[int]:
    """Block ``b`` and the blocks next to it in its shard for which ``wanted(block id)`` is true
    (the caller would fetch them soon; asked only about the neighbours the run reaches), as an
    ascending list of consecutive block ids
    whose byte span (``blocks.start`` of the first to ``blocks.end`` of the last) is at most
    ``cap_bytes``. It grows upward first (the shard's read direction), then downward; ``[b]``
    when no neighbour qualifies."""
    shard = int(ds.blocks.shard[b])
    lo = hi = int(b)
    n = len(ds.blocks)
    while (
        hi + 1 < n
        and wanted(hi + 1)
        and int(ds.blocks.shard[hi + 1]) == shard
        and int(ds.blocks.end[hi + 1]) - int(ds.blocks.start[lo]) <= cap_bytes
    ):
        hi += 1
    while (
        lo - 1 >= 0
        and wanted(lo - 1)
        and int(ds.blocks.shard[lo - 1]) == shard
        and int(ds.blocks.end[hi]) - int(ds.blocks.start[lo - 1]) <= cap_bytes
    ):
        lo -= 1
    return list(range(lo, hi + 1))


def _destination(ds, b: int) -> str | None:
    """Where a fetched block ``b`` goes: "cache" (admitted), "staging" (not admitted, the
    dataset's reader has a staging area) or None (neither: its samples are read on demand)."""
    if ds.reader.admits(b):
        return "cache"
    return "staging" if ds.reader.staging is not None else None


def _store(ds, b: int, data, dest: str) -> str:
    """Put the verified bytes of block ``b`` where ``dest`` says; returns its status."""
    name, staging = ds.blocks.name(b), ds.reader.staging
    if dest == "cache":
        if ds.cache.put(ds.version, name, data):
            return "filled"
        if staging is None:
            return "refused"
    if staging.contains(ds.version, name) or staging.put(ds.version, name, data):
        return "staged"
    return "unstaged"


def fill_run(ds, blocks: list[int]) -> dict:
    """Fetch the consecutive blocks ``blocks`` (ascending ids of one shard) from the origin with
    as few ranged GETs as possible and put each into the node cache, or into the staging area of
    ``ds``'s reader (:attr:`stoker.store.dataset.Dataset.reader`) when the cache does not admit it.

    Returns ``{block: status}`` with, per block, what :meth:`stoker.store.blocks.BlockReader.fill_block`
    (``want_data=False``) and :meth:`~stoker.store.blocks.BlockReader.stage_block` return: "filled",
    "staged" (fetched into staging), "in_staging" (staged already, not fetched), "cached" (present already),
    "busy" (another process holds its fetch lock), "refused" (not admitted, no staging area) or
    "unstaged" (the staging disk is full); or the exception that block's own fetch raised
    (:class:`stoker.errors.ChecksumError`, :class:`stoker.errors.OriginError`, ...): one block
    failing does not lose the others.

    The blocks still to fetch (not cached, lock held, somewhere to put them) are read in
    maximal gap-free stretches, one GET each. When such a GET fails after its retries, or one
    of its blocks fails its checksums, each of its blocks is fetched again on its own (one GET
    each, retried), so a failed merged GET costs requests but loses and duplicates no block.
    Cluster mode (a block router) and a dataset without a cache fetch block by block.
    """
    blocks = [int(b) for b in blocks]
    if ds.cache is None:
        raise ValueError(f"fill_run needs a node cache ({ds.url} was opened without one)")
    status: dict = {}
    with ExitStack() as locks:
        todo: list[tuple[int, str]] = []
        for b in blocks:
            name = ds.blocks.name(b)
            if ds.cache.contains(ds.version, name):
                status[b] = "cached"
                continue
            dest = _destination(ds, b)
            if dest is None:
                status[b] = "refused"
                continue
            if not locks.enter_context(ds.cache.fetch_lock(ds.version, name, blocking=False)):
                status[b] = "busy"
                continue
            if ds.cache.contains(ds.version, name):  # filled while we took the lock
                status[b] = "cached"
                continue
            staging = ds.reader.staging
            # staged already (a worker's fetch, an earlier plan's, another loader's on the node): not fetched
            if dest == "staging" and (staging.contains(ds.version, name) or staging.adopt(ds.version, name)):
                status[b] = "in_staging"
                continue
            todo.append((b, dest))
        for stretch in _stretches(todo):
            status.update(_fetch_stretch(ds, stretch))
    return status


def _stretches(todo: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """``todo`` cut where block ids are not consecutive."""
    out: list[list[tuple[int, str]]] = []
    for item in todo:
        if out and item[0] == out[-1][-1][0] + 1:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _fetch_stretch(ds, stretch: list[tuple[int, str]]) -> dict:
    """One GET for the consecutive blocks of ``stretch`` (locks held), split, verified, stored;
    block by block when that GET or a checksum fails, or in cluster mode."""
    first, last = stretch[0][0], stretch[-1][0]
    reader = ds.reader
    out: dict = {}
    if len(stretch) > 1 and reader.router is None:
        start, end = int(ds.blocks.start[first]), int(ds.blocks.end[last])
        try:
            data = memoryview(reader.source_read(first, start, end, block=True))
            parts = [
                (b, dest, verify_block(ds, b, data[int(ds.blocks.start[b]) - start : int(ds.blocks.end[b]) - start]))
                for b, dest in stretch
            ]
        except (OriginError, ChecksumError, OSError) as exc:
            log.info("merged GET of blocks %d-%d of %s failed (%s); fetching them one by one", first, last, ds.url, exc)
        else:
            for b, dest, part in parts:
                out[b] = _store(ds, b, part, dest)  # a view of the GET's buffer: no copy
            return out
    for b, dest in stretch:
        try:  # a failure is noted in the block's lock for a read waiting on it (store/fill_failures.py)
            out[b] = _store(ds, b, fill_failures.fetch(reader, b, ds.blocks.name(b), time.time()), dest)
        except Exception as exc:  # noqa: BLE001 - reported per block; the others are kept
            out[b] = exc
    return out


__all__ = ["MAX_MERGE_BYTES", "adjacent_run", "fill_run", "merge_cap_bytes"]
