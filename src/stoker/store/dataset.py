"""`open_dataset`: a map-style dataset over a packed store, read through the node cache.

A sample costs one lookup in the in-memory index and one ranged read: from a
cached block on local disk when present, else one ranged GET of its block from
the origin (the block is verified and admitted to the cache), else, when the
cache would not admit the block, a ranged GET of just the sample.

Blocks are runs of consecutive samples of one shard, about ``block_bytes`` long
and cut at sample boundaries (a sample's whole range, primary payload and named
fields, lies in one block), so every block can be checked against the index's
per-sample xxh3-64 checksums when it is filled and every sample when it is read.
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from .._units import parse_size
from ..cache import DiskCache
from ..errors import ChecksumError, OriginError, OriginNotFoundError  # noqa: F401 - re-exported
from ..storage import Origin
from . import fill_failures
from .diagnose import why_no_index
from .index import INDEX_NAME, DatasetIndex, read_index

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 1 << 20
DEFAULT_CACHE_BYTES = 8 << 30


def plan_blocks(index: DatasetIndex, block_bytes: int) -> dict:
    """Cut each shard's samples into blocks of about ``block_bytes`` (at least one sample each).

    A sample belongs to the block of the ``block_bytes`` grid cell of its shard in which
    it starts; a block spans from its first sample's offset to the furthest ``span_end``
    (primary payload and named fields) of its samples, so a sample's range is never split.
    Vectorised (about 0.1 s for 1.28M samples). Offsets are int64 throughout (shards past
    8 GiB). Returns a dict of arrays: ``sample_block`` int32 (N,) block of each sample;
    ``shard`` int32 (B,); ``start``/``end`` int64 (B,), the block's shard bytes
    [start, end); ``order`` int64 (N,), sample ids sorted by (shard, offset);
    ``first``/``count`` int64 (B,), the block's samples are order[first:first+count].
    """
    if block_bytes < 1:
        raise ValueError("block_bytes must be >= 1")
    n = len(index)
    order = np.lexsort((index.offset, index.shard)).astype(np.int64)
    sample_block = np.empty(n, dtype=np.int32)
    if n == 0:
        z = np.zeros(0, np.int64)
        return {"sample_block": sample_block, "shard": np.zeros(0, np.int32), "start": z, "end": z,
                "order": order, "first": z, "count": z}
    sh = index.shard[order].astype(np.int64)
    off = index.offset[order]
    cell = off // int(block_bytes)
    new = np.ones(n, dtype=bool)
    new[1:] = (sh[1:] != sh[:-1]) | (cell[1:] != cell[:-1])
    first = np.flatnonzero(new).astype(np.int64)
    sample_block[order] = (np.cumsum(new) - 1).astype(np.int32)
    return {"sample_block": sample_block, "shard": sh[first].astype(np.int32), "start": off[first],
            "end": np.maximum.reduceat(index.span_end[order], first).astype(np.int64),
            "order": order, "first": first, "count": np.diff(np.append(first, n))}


@dataclass
class ReadStats:
    """Per-process sample read counters."""

    samples: int = 0
    cache_hits: int = 0
    staged_hits: int = 0     # samples read from blocks the prefetcher staged (not admitted to the cache)
    direct_reads: int = 0    # samples read from the origin without a block fill

    def snapshot(self) -> dict:
        return dict(self.__dict__)


class Dataset:
    """Map-style dataset of a packed store: ``ds[i] -> (payload bytes, label int)``.

    ``len(ds)`` samples; ``ds.key(i)`` the sample key; ``ds.labels`` int64 (N,).
    Picklable (worker processes get the in-memory index, not a re-download).
    Reads raise :class:`ChecksumError` when origin bytes do not match the index
    and :class:`stoker.storage.OriginError` when the origin fails after retries.
    """

    def __init__(self, url: str, index: DatasetIndex, origin: Origin, cache: DiskCache | None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.url = url
        self.index = index
        self.origin = origin
        self.cache = cache
        self.block_bytes = int(block_bytes)
        blocks = plan_blocks(index, self.block_bytes)
        self.sample_block = blocks["sample_block"]
        self.block_shard, self.block_start, self.block_end = blocks["shard"], blocks["start"], blocks["end"]
        self._block_order, self._block_first, self._block_count = blocks["order"], blocks["first"], blocks["count"]
        self.read_stats = ReadStats()
        self.staging = None  # a loader's StagingArea, set by the loader that owns it
        # Cluster mode (stoker.cluster.reader.BlockRouter): which blocks this node's cache holds
        # (caches(b) -> bool), where the others are read from (read(ds, b, start, stop) -> bytes:
        # the owning peer, else the origin), and local(nbytes) to count bytes the cache served.
        self.router = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["read_stats"] = ReadStats()
        return state

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        """(payload bytes, label) of sample ``i`` (negative ids count from the end).

        Raises TypeError for an id that is not an integer, IndexError (naming the dataset) for
        one out of range, and what :meth:`read` raises."""
        i = self._sample_id(i)
        return self.read(i), int(self.index.labels[i])

    def _sample_id(self, i) -> int:
        """``i`` as a sample id in ``0..len-1`` (negative counts from the end), or a clear error."""
        if isinstance(i, (str, bytes)):
            raise TypeError(f"samples of {self.url} are indexed by id (an int), not by key {i!r}; "
                            "`stoker ls URL KEY` prints a key's id")
        try:
            n = operator.index(i)
        except TypeError:
            raise TypeError(f"a sample id must be an integer, got {type(i).__name__} {i!r}") from None
        if not -len(self) <= n < len(self):
            raise IndexError(f"sample {n} out of range for {len(self)} samples in {self.url}")
        return n % len(self)

    @property
    def labels(self) -> np.ndarray:
        return self.index.labels

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def class_names(self) -> list[str]:
        """The class names in label order (``class_names[label]``), as recorded by ``pack``; a
        class with no samples (an empty class folder) keeps its label. Empty when the source
        had no classes."""
        return list(self.index.classes)

    def key(self, i: int) -> str:
        return self.index.key(i)

    @property
    def num_blocks(self) -> int:
        return len(self.block_shard)

    def block_name(self, b: int) -> str:
        """The cache name of block ``b``: ``<shard:06d>-<start>-<end>`` (shard bytes)."""
        return f"{int(self.block_shard[b]):06d}-{int(self.block_start[b])}-{int(self.block_end[b])}"

    def block_of_name(self, name: str) -> int | None:
        """The block that :meth:`block_name` names ``name``, or None (not a block of this dataset)."""
        try:
            shard, start, end = (int(x) for x in name.split("-"))
        except ValueError:
            return None
        lo, hi = (int(x) for x in np.searchsorted(self.block_shard, [shard, shard + 1]))  # (shard, offset) order
        k = lo + int(np.searchsorted(self.block_start[lo:hi], start))
        if k < hi and int(self.block_start[k]) == start and int(self.block_end[k]) == end:
            return k
        return None

    def block_bytes_of(self, b) -> np.ndarray:
        return self.block_end[b] - self.block_start[b]

    # -- reads ------------------------------------------------------------
    def _check(self, i: int, data) -> bool:
        return xxhash.xxh3_64_intdigest(data) == int(self.index.checksum[i])

    def _bad(self, i: int, what: str) -> ChecksumError:
        shard = self.index.shard_name(self.index.shard[i])
        err = ChecksumError(f"sample {self.key(i)!r} in shard {shard!r} of {self.url}: {what} "
                            "(the dataset changed under its index? re-pack or run `stoker verify`)")
        err.key = self.key(i)  # the sample at fault, which may not be the one being read (a shared block)
        return err

    def _range(self, i: int, start: int, stop: int, valid) -> bytes | memoryview:
        """Shard bytes ``[start, stop)`` of sample ``i``, checked by ``valid(data) -> bool``.

        Tiers in order: the node cache (a committed block), the loader's staging area
        (blocks the prefetcher fetched just in time but the cache did not admit), a block
        fetch from the origin (:meth:`_block_for_read`: single flight, into the cache or the
        staging area), and last a ranged GET of just this range. A cached or staged block
        that fails the check is dropped and the next tier is tried. An :class:`OriginError` after
        waiting for another process's failed fetch of the block lists that process's attempts too
        (:mod:`.fill_failures`).
        """
        since = time.time()
        try:
            return self._tiers(i, start, stop, valid)
        except OriginError as exc:
            if self.cache is None:
                raise
            err = fill_failures.after_others(self.cache, self.version, self.block_name(int(self.sample_block[i])),
                                             exc, since)
            if err is exc:
                raise
            raise err from exc.__cause__

    def _tiers(self, i: int, start: int, stop: int, valid) -> bytes | memoryview:
        cache = self.cache
        if cache is not None:
            b = int(self.sample_block[i])
            name = self.block_name(b)
            rel = start - int(self.block_start[b])
            data = cache.read(self.version, name, rel, stop - start)
            if data is not None:
                if valid(data):
                    cache.stats.hits += 1
                    self.read_stats.cache_hits += 1
                    if self.router is not None:
                        self.router.local(len(data), b)
                    return data
                cache.stats.corrupt += 1
                cache.remove(self.version, name)
            cache.stats.misses += 1
            if self.staging is not None:
                data = self._staged(name, rel, stop - start, valid)
                if data is not None:
                    if self.router is not None:
                        self.router.local(len(data), b)
                    return data
            where, block = self._block_for_read(b)
            if block is not None:
                view = memoryview(block)[rel:rel + stop - start]
                if valid(view):  # a fresh fetch was verified; a cached or staged copy is checked here
                    if where == "staged":
                        self.read_stats.staged_hits += 1
                    if self.router is not None:
                        self.router.local(stop - start, b)
                    return view
        self.read_stats.direct_reads += 1
        data = self._source_read(int(self.sample_block[i]), start, stop)
        if not valid(data):
            bad = self._bad_member(i, self.index.member_table(i), data, start) if self.index.members is not None else None
            raise self._bad(i, "checksum mismatch on read from the origin"
                            + (f" in field {bad!r}" if bad else ""))
        return data

    def _staged(self, name: str, rel: int, n: int, valid):
        data = self.staging.read(self.version, name, rel, n)
        if data is None:
            return None
        if not valid(data):
            self.staging.remove(self.version, name)
            return None
        self.read_stats.staged_hits += 1
        return data

    def read(self, i: int) -> bytes:
        """Payload bytes of sample ``i``, verified against its checksum."""
        i = int(i)
        self.read_stats.samples += 1
        start = int(self.index.offset[i])
        with self.origin.shared_budget():  # waiting for another process's fill spends it too
            return bytes(self._range(i, start, start + int(self.index.length[i]), lambda d: self._check(i, d)))

    def read_fields(self, i: int) -> dict[str, bytes]:
        """All members of sample ``i``: ``{field name: bytes}``, primary payload included.

        Each member is verified against its own checksum (:class:`ChecksumError`
        names the key and field). One ranged read of the sample's range (or one
        cached block). A format 1 index names the primary payload "". Raises TypeError /
        IndexError (naming the dataset) for an id that is not one of its samples.
        """
        i = self._sample_id(i)
        self.read_stats.samples += 1
        table = self.index.member_table(i)
        start, stop = int(self.index.offset[i]), int(self.index.span_end[i])
        with self.origin.shared_budget():
            data = self._range(i, start, stop, lambda d: self._bad_member(i, table, d, start) is None)
        view = memoryview(data)
        return {name: bytes(view[off - start:off - start + n]) for name, off, n, _ in table}

    def _bad_member(self, i: int, table, data, base: int) -> str | None:
        """Name of the first member of sample ``i`` whose bytes in ``data`` (at shard offset ``base``) are wrong."""
        view = memoryview(data)
        for name, off, n, ck in table:
            if xxhash.xxh3_64_intdigest(view[off - base:off - base + n]) != ck or off - base + n > len(view):
                return name
        return None

    def _admits(self, b: int) -> bool:
        """Whether this node's cache would take block ``b`` now (budget, and in cluster mode ownership)."""
        if self.router is not None and not self.router.caches(b):
            return False
        return self.cache.would_admit(int(self.block_end[b] - self.block_start[b]), self.version)

    def _source_read(self, b: int, start: int, stop: int, block: bool = False):
        """Shard bytes ``[start, stop)`` of block ``b`` from outside this node's cache: the
        origin, or in cluster mode whatever the router chooses (the owning peer, else the origin;
        ``block``: the whole block, for the cache or staging)."""
        if self.router is not None:
            return self.router.read(self, b, start, stop, block=block)
        return self.origin.read_range(self.index.shard_name(self.block_shard[b]), start, stop)

    def _fetch_block(self, b: int) -> bytes:
        """Block ``b`` from the origin (or its owning peer) with every member of every sample verified."""
        return self._verify_block(b, self._source_read(b, int(self.block_start[b]), int(self.block_end[b]), block=True))

    def _verify_block(self, b: int, data):
        """``data`` (the bytes of block ``b``, shard range [block_start, block_end)) after checking
        every member of every sample against the index; :class:`ChecksumError` naming the first
        sample that fails."""
        start = int(self.block_start[b])
        first, count = int(self._block_first[b]), int(self._block_count[b])
        members = self.index.members
        view = memoryview(data)
        for i in self._block_order[first:first + count]:
            off = int(self.index.offset[i]) - start
            if not self._check(i, view[off:off + int(self.index.length[i])]):
                raise self._bad(int(i), "checksum mismatch in a block read from the origin")
            if members is not None and members.start[i + 1] > members.start[i]:
                bad = self._bad_member(int(i), self.index.member_table(int(i))[1:], data, start)
                if bad is not None:
                    raise self._bad(int(i), f"checksum mismatch in field {bad!r} in a block read from the origin")
        return data

    def cached_blocks(self) -> np.ndarray:
        """bool (num_blocks,): which blocks the node cache holds now (False without a cache)."""
        if self.cache is None:
            return np.zeros(self.num_blocks, dtype=bool)
        return np.fromiter((self.cache.contains(self.version, self.block_name(b)) for b in range(self.num_blocks)),
                           dtype=bool, count=self.num_blocks)

    def _block_for_read(self, b: int) -> tuple[str | None, object]:
        """Block ``b`` for a sample read that found it neither in the cache nor in staging:
        ``(where, bytes)`` with ``where`` "cache", "staged" or "origin", or ``(None, None)``
        when only the sample is to be read from the origin.

        Under the block's fetch lock, so a fill of it in flight elsewhere (the prefetcher's,
        another worker's) is waited for, not repeated: the cache, then the staging area, then
        one GET of the whole block (verified), kept where the next reader finds it: in the cache
        when it admits the block, else in the loader's staging area when that has room
        (:meth:`stoker.cache.StagingArea.has_room`; the prefetcher takes it over and deletes it
        after its last use). A block that neither takes is not fetched, nor one of another node
        in cluster mode (the prefetcher stages those): ``(None, None)``."""
        cache, name = self.cache, self.block_name(b)
        size = int(self.block_end[b] - self.block_start[b])
        if self.staging is None and not self._admits(b):
            return None, None
        staging = self.staging if self.router is None else None
        since = time.time()
        with cache.fetch_lock(self.version, name, blocking=True):
            if cache.contains(self.version, name):
                data = cache.read(self.version, name, 0, size, count=False)  # the sample was a miss
                if data is not None:
                    return "cache", data
            if self.staging is not None:
                data = self.staging.read(self.version, name, 0, size)
                if data is not None:
                    return "staged", data
            admitted = self._admits(b)
            room = staging is not None and staging.has_room(self.version, size)
            if not (admitted or room):
                return None, None
            data = fill_failures.fetch(self, b, name, since)
            if not (admitted and cache.put(self.version, name, data)) and staging is not None and room:
                staging.put(self.version, name, data)  # False (disk full): nothing kept, still read
            return "origin", data

    def stage_block(self, b: int) -> str:
        """Fetch block ``b`` into the staging area (prefetch of a block the cache does not
        admit). Returns "staged" (fetched), "in_staging" (staged already, by a worker or for
        an earlier plan: nothing fetched), "cached", "busy" (another process is fetching it)
        or "unstaged" (the staging disk is full: the block's samples will be read from the origin)."""
        name = self.block_name(b)
        with self.cache.fetch_lock(self.version, name, blocking=False) as held:
            if not held:
                return "busy"
            if self.cache.contains(self.version, name):
                return "cached"
            if self.staging.contains(self.version, name):
                return "in_staging"
            if not self.staging.put(self.version, name, fill_failures.fetch(self, b, name, time.time())):
                return "unstaged"
            return "staged"

    def fill_block(self, b: int, blocking: bool = True, want_data: bool = True):
        """Fetch block ``b`` from the origin into the cache (single flight across processes).

        Returns the block bytes, or None when the cache would not admit it (the caller
        then reads just the sample) or, with ``blocking=False``, when another process
        is filling it. Every sample in the block is verified before it is admitted. A block
        fetched here that the cache then refuses (another fill took the room between the
        admission check and the write) goes to the loader's staging area when there is one,
        so that it is not fetched again.
        With ``want_data=False`` (prefetch) returns a status instead: "filled", "cached",
        "staged" (fetched, refused by the cache, staged), "in_staging" (staged already:
        nothing fetched), "unstaged" (fetched, refused, the staging disk full), "refused" or
        "busy".
        """
        cache = self.cache
        name = self.block_name(b)
        size = int(self.block_end[b] - self.block_start[b])
        if not self._admits(b):
            return None if want_data else "refused"
        since = time.time()
        with cache.fetch_lock(self.version, name, blocking=blocking) as held:
            if not held:
                return None if want_data else "busy"
            if cache.contains(self.version, name):
                if not want_data:
                    return "cached"
                data = cache.read(self.version, name, 0, size, count=False)  # the sample was a miss
                if data is not None:
                    return data
            staging = self.staging
            if not want_data and staging is not None and staging.contains(self.version, name):
                return "in_staging"
            data = fill_failures.fetch(self, b, name, since)
            if cache.put(self.version, name, data):
                return "filled" if not want_data else data
            staged = staging is not None and (staging.contains(self.version, name)
                                              or staging.put(self.version, name, data))
            if not want_data:
                return "staged" if staged else ("unstaged" if staging is not None else "refused")
            return data


def default_cache_dir() -> str:
    """``$STOKER_CACHE_DIR``, else a node-local scratch directory, else ``~/.cache/stoker``
    (:func:`stoker.cache.paths.default_cache_dir`, which logs the choice once)."""
    from ..cache.paths import default_cache_dir as choose
    return choose()


def open_dataset(url: str, cache_dir: str | None = None, cache_bytes: int | str | None = None, *,
                 storage_options: dict | None = None, block_bytes: int | str = DEFAULT_BLOCK_BYTES,
                 cache_policy: str = "future", cache: bool = True, check: bool = True,
                 memory_bytes: int | str = 0, memory_dir: str | None = None,
                 retry_budget_s: float | None = None, cache_mode: int | str | None = None) -> Dataset:
    """Open the packed dataset at ``url`` (any fsspec URL) as a map-style :class:`Dataset`.

    ``cache_dir``: node-local cache directory (default :func:`default_cache_dir`);
    ``cache_bytes``: its byte budget (default 8 GiB); ``cache=False`` reads every
    sample straight from the origin. ``block_bytes``: cache unit (default 1 MiB).
    ``storage_options``: fsspec options (S3: endpoint_url, key, secret, ...).
    ``cache_policy``: "future" (default: no eviction within a dataset, the node's budget
    split between the datasets of live jobs by epoch rate; :mod:`stoker.cache.policy`),
    "noevict" or "lru". The process registers its job with the cache (dataset bytes; the
    Loader adds its epoch time).
    ``memory_bytes``: budget of a shared-memory tier above the disk tier (0 = none; blocks
    go to memory first, see :mod:`stoker.cache.tiered`); ``memory_dir`` its directory
    (default: under /dev/shm, one per cache directory).
    ``cache_mode``: file mode of everything the cache creates (blocks, staging, derived
    samples, the memory tier, locks, job records): default ``$STOKER_CACHE_MODE`` or 0600
    (directories 0700), whatever the umask; e.g. ``"0640"`` for a cache that the directory's
    group may read on purpose (:mod:`stoker.cache.perms`). A cache made with another mode
    raises :class:`stoker.CacheModeError`; a cache or memory directory that is a symlink
    planted by someone else, another user's, or writable by others raises
    :class:`stoker.UnsafePathError` (both name the directory). The byte sizes (``cache_bytes``,
    ``block_bytes``, ``memory_bytes``) take ints or strings such as ``"500GiB"``
    (:func:`stoker.parse_size`; ValueError naming the argument for a bad one).
    ``retry_budget_s``: seconds each origin read keeps retrying throttling, 5xx, resets and
    timeouts (full-jitter back-off) before :class:`stoker.OriginError`; None:
    ``$STOKER_RETRY_BUDGET_S`` or 30 s (:mod:`stoker.storage.retry`). Kept by the loader's processes.
    ``check``: list the shards once and compare sizes (and ETags where recorded) with
    the index, so shards rewritten under an unchanged index are reported by name
    (:class:`stoker.DatasetChangedError`) before any sample is served.
    Raises :class:`stoker.OriginNotFoundError` (a FileNotFoundError) when ``url`` holds no
    index (e.g. an interrupted pack) and :class:`stoker.IndexFormatError` when the index is
    unreadable.
    """
    cache_bytes = DEFAULT_CACHE_BYTES if cache_bytes is None else parse_size(cache_bytes, "cache_bytes")
    block_bytes = parse_size(block_bytes, "block_bytes")
    memory_bytes = parse_size(memory_bytes, "memory_bytes")
    origin = Origin(url, storage_options or {}, retry_budget_s=retry_budget_s)
    try:
        data = origin.read(INDEX_NAME)
    except FileNotFoundError:
        raise OriginNotFoundError(origin.full_url(INDEX_NAME), f"not found: {why_no_index(origin)}") from None
    index = read_index(data, origin.full_url(INDEX_NAME))
    if check:
        from .verify import check_shards
        check_shards(origin, index)
    disk = None
    if cache:
        disk = DiskCache(cache_dir or default_cache_dir(), cache_bytes, cache_policy, mode=cache_mode)
        if memory_bytes > 0:
            from ..cache import TieredCache, default_memory_root
            disk = TieredCache(DiskCache(memory_dir or default_memory_root(disk.root), memory_bytes, cache_policy,
                                         mode=disk.mode), disk)
        disk.recover()
    ds = Dataset(url, index, origin, disk, block_bytes)
    if disk is not None:
        disk.register(ds.version, index.total_bytes)
        disk.describe(ds.version, url)
    return ds
