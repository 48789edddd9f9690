"""Block fetching and cache filling for a :class:`stoker.store.dataset.Dataset`: its block reader.

A :class:`BlockReader` is the collaborator that a Dataset's reads go through. It owns what one
reader of the dataset has and another does not:

* a *staging area* (:class:`stoker.cache.StagingArea`; a Loader's, for the blocks its prefetcher
  fetched just in time that the node cache did not admit), or none;
* a cluster *router* (:class:`Router`, e.g. :class:`stoker.cluster.service.reader.BlockRouter`: which
  blocks this node caches, and reads of the others from their owning peer), or none;
* its :class:`ReadStats`.

The Dataset itself (index, block metadata, checksums) is shared and never changed by a reader:
``ds.with_reader(BlockReader(ds, staging=..., router=...))`` is a view of ``ds`` whose reads go
through that reader, so two Loaders over one Dataset each have their own staging area. A
Dataset without one reads through a plain reader (no staging, no router), :attr:`Dataset.reader`.

Reads try, in order: the node cache (a committed block), the staging area, a fetch of the whole
block (single flight across processes under the cache's fetch lock, kept in the cache when it
admits the block, else in the staging area when that has room), and last a ranged GET of just
the sample (:meth:`BlockReader.read_range`). Fills for the prefetcher and the cluster's services
are :meth:`BlockReader.fill_block` and :meth:`BlockReader.stage_block`; a fill may name a
*first source* (``first_source``: e.g. the cluster's previous owner of the block) tried before
the origin, whose bytes are checked like the origin's. Every byte read from outside the node
cache (the origin, or a peer through the router) is checked against the index once, before it
is kept or delivered; in cluster mode a peer's bytes that fail are refused and the origin read
instead (:meth:`Router.read`). Picklable: a worker process gets a copy
with the same staging area and router and counters at zero.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import OriginError
from . import fill_failures
from .checks import checked_or_none, checksum_error, verify_block

log = logging.getLogger(__name__)

Check = Callable[[object], bool]  # valid(data) -> whether the bytes of a sample's range are right
#: verify(data) -> None; raises ChecksumError (naming the sample) when bytes read from outside the
#: node cache are wrong (:meth:`BlockReader.source_read`).
Verify = Callable[[object], object]
#: first_source(b) -> the bytes of block b (shard range [blocks.start, blocks.end)), or None when it
#: has none; it must not raise (a source that fails answers None).
FirstSource = Callable[[int], "bytes | memoryview | None"]


@dataclass
class ReadStats:
    """Per-process sample read counters of one reader (counts of samples)."""

    samples: int = 0
    cache_hits: int = 0
    staged_hits: int = 0  # samples read from blocks the prefetcher staged (not admitted to the cache)
    direct_reads: int = 0  # samples read from the origin without a block fill

    def snapshot(self) -> dict:
        """The counters as a plain dict (``{name: count}``)."""
        return dict(self.__dict__)


class Router(Protocol):
    """What a block reader asks of a cluster router (:class:`stoker.cluster.service.reader.BlockRouter`)."""

    def caches(self, b: int) -> bool:
        """Whether block ``b`` belongs in this node's cache."""

    def local(self, nbytes: int, b: int | None = None) -> None:
        """Count ``nbytes`` of block ``b`` served by this node's cache or staging area."""

    def read(self, ds, b: int, start: int, stop: int, block: bool = False, verify: Verify | None = None) -> bytes:
        """Shard bytes ``[start, stop)`` of block ``b`` of dataset ``ds``: from its owning peer,
        else the origin (``block``: the whole block, for the cache or staging). ``verify``
        (:data:`Verify`): every byte returned has passed it; a peer's bytes that fail it are
        refused and the origin read instead, the origin's that fail it raise its ChecksumError.
        None: unverified."""


class BlockSource(Protocol):
    """What a :class:`stoker.store.dataset.Dataset` and its users need from its reader.

    The Dataset reads through :meth:`read_range` and counts samples in :attr:`stats`; a Loader
    asks for the reader's :attr:`staging` and :attr:`router` (to keep the router in the reader it
    makes for its own run). The prefetcher's fills need a :class:`BlockReader`.
    """

    stats: ReadStats

    @property
    def staging(self):
        """The reader's staging area (:class:`stoker.cache.StagingArea`), or None."""

    @property
    def router(self) -> Router | None:
        """The reader's cluster router, or None."""

    def read_range(self, i: int, start: int, stop: int, valid: Check):
        """Shard bytes ``[start, stop)`` of sample ``i``, checked by ``valid(data) -> bool``
        (bytes or a memoryview; see :meth:`BlockReader.read_range` for the errors)."""


class BlockReader:
    """Reads of one dataset's blocks through the node cache, a staging area and a router.

    Args:
        dataset: the :class:`stoker.store.dataset.Dataset` whose blocks are read (its index,
            block metadata, cache and origin; never changed here).
        staging: a :class:`stoker.cache.StagingArea` that this reader's fills may use for blocks
            the cache does not admit, owned by whoever created it (a Loader's run); None: none.
        router: a :class:`Router` (cluster mode); None: blocks come from the origin.
        stats: the :class:`ReadStats` to count into; None: new ones.
    """

    def __init__(self, dataset, staging=None, router: Router | None = None, stats: ReadStats | None = None):
        self._ds, self._staging, self._router = dataset, staging, router
        self.stats = ReadStats() if stats is None else stats

    def __getstate__(self):
        state = dict(self.__dict__)
        state["stats"] = ReadStats()  # a copy in a worker process counts its own reads
        return state

    @property
    def dataset(self):
        """The dataset whose blocks this reader reads."""
        return self._ds

    @property
    def staging(self):
        """The staging area (:class:`stoker.cache.StagingArea`), or None."""
        return self._staging

    @property
    def router(self) -> Router | None:
        """The cluster router, or None."""
        return self._router

    # -- the sources of a block --------------------------------------------
    def admits(self, b: int) -> bool:
        """Whether this node's cache would take block ``b`` now (budget, and in cluster mode
        ownership). False without a cache."""
        ds = self._ds
        if ds.cache is None or (self._router is not None and not self._router.caches(b)):
            return False
        return ds.cache.would_admit(int(ds.blocks.nbytes(b)), ds.version)

    def source_read(self, b: int, start: int, stop: int, block: bool = False, verify: Verify | None = None):
        """Shard bytes ``[start, stop)`` of block ``b`` from outside this node's cache: the
        origin, or in cluster mode whatever the router chooses (the owning peer, else the
        origin; ``block``: the whole block, for the cache or staging). Raises
        :class:`stoker.errors.OriginError` when the origin fails after its retries.

        ``verify`` (:data:`Verify`; None: unverified): the bytes are checked with it once, and
        its ChecksumError raised when the origin's are wrong; a peer's that fail it are refused
        by the router, which reads the origin instead (:meth:`Router.read`)."""
        ds = self._ds
        if self._router is not None:
            return self._router.read(ds, b, start, stop, block=block, verify=verify)
        data = ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop)
        if verify is not None:
            verify(data)
        return data

    def fetch_block(self, b: int, first_source: FirstSource | None = None):
        """Block ``b`` from the origin (or its owning peer) with every member of every sample
        verified (:func:`stoker.store.checks.verify_block`: :class:`~stoker.errors.ChecksumError`).

        ``first_source``: tried first (:data:`FirstSource`); its bytes are verified the same way,
        and when it has none, or they fail the check (logged, naming the block), the block is
        read from the usual source."""
        ds = self._ds
        if first_source is not None:
            data = checked_or_none(ds, b, first_source(b), "its first source")
            if data is not None:
                return data
        start, end = int(ds.blocks.start[b]), int(ds.blocks.end[b])
        return self.source_read(b, start, end, block=True, verify=lambda data: verify_block(ds, b, data))

    # -- sample reads -------------------------------------------------------
    def read_range(self, i: int, start: int, stop: int, valid: Check):
        """Shard bytes ``[start, stop)`` of sample ``i``, checked by ``valid(data) -> bool``.

        Tiers in order: the node cache (a committed block), the staging area, a block fetch
        (:meth:`block_for_read`), and last a ranged GET of just this range. A cached or staged
        block that fails the check is dropped and the next tier is tried. Raises
        :class:`ChecksumError` (naming the sample and field) when the origin's bytes are wrong,
        and :class:`OriginError` when the origin fails; after waiting for another process's failed
        fetch of the block, that error lists that process's attempts too (:mod:`.fill_failures`).
        """
        since = time.time()
        try:
            return self._tiers(i, start, stop, valid)
        except OriginError as exc:
            ds = self._ds
            if ds.cache is None:
                raise
            err = fill_failures.after_others(
                ds.cache, ds.version, ds.blocks.name(int(ds.blocks.sample_block[i])), exc, since
            )
            if err is exc:
                raise
            raise err from exc.__cause__

    def _tiers(self, i: int, start: int, stop: int, valid: Check):
        ds, cache, router = self._ds, self._ds.cache, self._router
        b = int(ds.blocks.sample_block[i])
        if cache is not None:
            name = ds.blocks.name(b)
            rel = start - int(ds.blocks.start[b])
            data = cache.read(ds.version, name, rel, stop - start)
            if data is not None:
                if valid(data):
                    cache.stats.hits += 1
                    self.stats.cache_hits += 1
                    if router is not None:
                        router.local(len(data), b)
                    return data
                cache.stats.corrupt += 1
                cache.remove(ds.version, name)
            cache.stats.misses += 1
            if self._staging is not None:
                data = self._staged(name, rel, stop - start, valid)
                if data is not None:
                    if router is not None:
                        router.local(len(data), b)
                    return data
            where, view = self.block_for_read(b, rel, stop - start)
            if view is not None:
                if valid(view):  # a fresh fetch was verified; a cached or staged copy is checked here
                    if where == "staged":
                        self.stats.staged_hits += 1
                    if router is not None:
                        router.local(stop - start, b)
                    return view
        self.stats.direct_reads += 1

        def verify(data) -> None:
            if not valid(data):
                raise checksum_error(ds, i, "checksum mismatch on read from the origin", data=data, start=start)

        return self.source_read(b, start, stop, verify=verify)

    def _staged(self, name: str, rel: int, n: int, valid: Check):
        """``n`` bytes at ``rel`` of staged block ``name`` if staged and valid (an invalid one is removed)."""
        version = self._ds.version
        data = self._staging.read(version, name, rel, n)
        if data is None:
            return None
        if not valid(data):
            self._staging.remove(version, name)
            return None
        self.stats.staged_hits += 1
        return data

    def block_for_read(
        self, b: int, rel: int = 0, n: int | None = None
    ) -> tuple[str | None, bytes | memoryview | None]:
        """Bytes ``[rel, rel + n)`` of block ``b`` (``n`` None: the whole block) for a sample read
        that found it neither in the cache nor in staging: ``(where, bytes-like)`` with ``where``
        "cache", "staged" or "origin", or ``(None, None)`` when only the sample is to be read from
        the origin. After waiting for another process's fill only that range is read from the
        cache or staging area, not the whole block.

        Under the block's fetch lock, so a fill of it in flight elsewhere (the prefetcher's,
        another worker's) is waited for, not repeated: the cache, then the staging area (a copy
        that another loader on the node staged is linked into it first,
        :meth:`stoker.cache.StagingArea.adopt`), then
        one GET of the whole block (verified), kept where the next reader finds it: in the cache
        when it admits the block, else in the staging area when that has room
        (:meth:`stoker.cache.StagingArea.has_room`; the prefetcher takes it over and deletes it
        after its last use). A block that neither takes is not fetched, nor one of another node
        in cluster mode (the prefetcher stages those): ``(None, None)``."""
        ds, cache = self._ds, self._ds.cache
        name, version = ds.blocks.name(b), ds.version
        size = int(ds.blocks.nbytes(b))
        if self._staging is None and not self.admits(b):
            return None, None
        staging = self._staging if self._router is None else None
        since = time.time()
        n = size - rel if n is None else n
        with cache.fetch_lock(version, name, blocking=True):
            data = cache.read(version, name, rel, n, count=False)  # the sample was a miss
            if data is not None:
                return "cache", data
            if self._staging is not None:
                data = self._staging.read(version, name, rel, n)
                if data is None and self._staging.adopt(version, name):  # staged by another loader here
                    data = self._staging.read(version, name, rel, n)
                if data is not None:
                    return "staged", data
            admitted = self.admits(b)
            room = staging is not None and staging.has_room(version, size)
            if not (admitted or room):
                return None, None
            data = fill_failures.fetch(self, b, name, since)
            if not (admitted and cache.put(version, name, data)) and staging is not None and room:
                staging.put(version, name, data)  # False (disk full): nothing kept, still read
            return "origin", memoryview(data)[rel : rel + n]

    # -- fills (the prefetcher, warm-up, the cluster's services) -----------
    def stage_block(self, b: int) -> str:
        """Fetch block ``b`` into the staging area (prefetch of a block the cache does not
        admit). Returns "staged" (fetched), "in_staging" (staged already, by a worker or for
        an earlier plan, or linked from another loader's staging area on the node,
        :meth:`stoker.cache.StagingArea.adopt`: nothing fetched), "cached", "busy" (another process is fetching it)
        or "unstaged" (the staging disk is full: the block's samples will be read from the origin).
        Raises ValueError without a staging area."""
        if self._staging is None:
            raise ValueError(f"stage_block needs a staging area (this reader of {self._ds.url} has none)")
        ds = self._ds
        name, version = ds.blocks.name(b), ds.version
        with ds.cache.fetch_lock(version, name, blocking=False) as held:
            if not held:
                return "busy"
            if ds.cache.contains(version, name):
                return "cached"
            if self._staging.contains(version, name) or self._staging.adopt(version, name):
                return "in_staging"
            if not self._staging.put(version, name, fill_failures.fetch(self, b, name, time.time())):
                return "unstaged"
            return "staged"

    def fill_block(
        self, b: int, blocking: bool = True, want_data: bool = True, first_source: FirstSource | None = None
    ):
        """Fetch block ``b`` from the origin into the cache (single flight across processes).

        Every sample in the block is verified before it is admitted. A block fetched here that
        the cache then refuses (another fill took the room between the admission check and the
        write) goes to the staging area when there is one, so that it is not fetched again.

        With ``want_data=False`` (prefetch) returns a status: "filled", "cached" (another
        fill had brought it: nothing fetched), "staged" (fetched, refused by the cache, staged),
        "in_staging" (staged already: nothing fetched), "unstaged" (fetched, refused, the
        staging disk full), "refused" (the cache would not admit it) or "busy" (with
        ``blocking=False``, another process is filling it).

        With ``want_data=True`` returns ``(status, data)``: the block's bytes with "cached" when
        another fill brought it while this one waited for the block's lock (read from the cache,
        nothing fetched: a caller counting origin bytes must not count these), with "filled",
        "staged" or "unstaged" when fetched here, and ``("refused", None)`` or ``("busy", None)``
        (the caller then reads just the sample). Raises what :meth:`fetch_block` raises.

        ``first_source``: a source tried before the origin for a fetch here (:meth:`fetch_block`);
        with ``want_data=True`` the data returned is the very object it gave when its bytes were
        kept, so a caller can tell where a "filled" block came from.
        """
        ds, cache, staging = self._ds, self._ds.cache, self._staging
        name, version = ds.blocks.name(b), ds.version
        size = int(ds.blocks.nbytes(b))
        if not self.admits(b):
            return ("refused", None) if want_data else "refused"
        since = time.time()
        with cache.fetch_lock(version, name, blocking=blocking) as held:
            if not held:
                return ("busy", None) if want_data else "busy"
            if not want_data:
                if cache.contains(version, name):
                    return "cached"
            else:
                data = cache.read(version, name, 0, size, count=False)  # the sample was a miss
                if data is not None:
                    return "cached", data
            if not want_data and staging is not None and staging.contains(version, name):
                return "in_staging"
            data = fill_failures.fetch(self, b, name, since, first_source)
            if cache.put(version, name, data):
                return ("filled", data) if want_data else "filled"
            staged = staging is not None and (staging.contains(version, name) or staging.put(version, name, data))
            status = "staged" if staged else ("unstaged" if staging is not None else "refused")
            return (status, data) if want_data else status


__all__ = ["BlockReader", "BlockSource", "FirstSource", "ReadStats", "Router", "Verify"]
