"""`open_dataset`: a map-style dataset over a packed store, read through the node cache.

A sample costs one lookup in the in-memory index and one ranged read: from a
cached block on local disk when present, else one ranged GET of its block from
the origin (the block is verified and admitted to the cache), else, when the
cache would not admit the block, a ranged GET of just the sample.

Blocks are runs of consecutive samples of one shard, about ``block_bytes`` long
and cut at sample boundaries (a sample's whole range, primary payload and named
fields, lies in one block), so every block can be checked against the index's
per-sample xxh3-64 checksums when it is filled and every sample when it is read.

Fetching blocks and filling the cache is the dataset's reader's job (:mod:`.blocks`); the
blocks themselves are ``ds.blocks`` (:class:`stoker.store.blockmap.BlockMap`), and the checks of
bytes against the index are :mod:`.checks`.
"""

from __future__ import annotations

import copy
import logging
import operator
import os
from typing import Any, Literal, overload

import numpy as np

from .._units import parse_size
from ..cache import DiskCache, ReadOnlyCache, TieredCache, default_memory_root
from ..cache.paths import warn_defaults
from ..cache.readonly import READ_ONLY_ENV
from ..errors import ChecksumError, OriginError, OriginNotFoundError  # noqa: F401 - re-exported
from ..storage import Origin
from .blockmap import BlockMap
from .blocks import BlockReader, BlockSource, ReadStats
from .checks import bad_field, sample_ok
from .diagnose import why_no_index
from .index import INDEX_NAME, DatasetIndex, read_index

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 1 << 20
DEFAULT_CACHE_BYTES = 8 << 30
#: The names of a sample's facts in ``read_fields(i, meta=True)``, the dict a Loader's ``decode=``
#: gets: its key (str), its id (int) and its label (int; only where the sample has one). Dunder
#: names, as WebDataset's ``__key__``, which tar members and file names do not take in practice.
KEY_FIELD, ID_FIELD, LABEL_FIELD = "__key__", "__id__", "__label__"


class Dataset:
    """Map-style dataset of a packed store: ``ds[i] -> (payload bytes, label int)``.

    ``len(ds)`` samples; ``ds.key(i)`` the sample key; ``ds.labels`` int64 (N,).
    Picklable (worker processes get the in-memory index, not a re-download).
    Reads raise :class:`ChecksumError` when origin bytes do not match the index
    and :class:`stoker.storage.OriginError` when the origin fails after retries.

    Reads of blocks (cache, staging area, origin or cluster peers) go through its
    :attr:`reader` (:mod:`stoker.store.blocks`); :meth:`with_reader` makes a view with
    another one. Nothing else about a Dataset changes after it is made, so one Dataset may be
    shared by several Loaders, each with its own staging area. Its blocks (the cache's unit) are
    :attr:`blocks`, a :class:`stoker.store.blockmap.BlockMap`.
    """

    def __init__(
        self,
        url: str,
        index: DatasetIndex,
        origin: Origin,
        cache: DiskCache | TieredCache | ReadOnlyCache | None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ):
        self.url = url
        self.index = index
        self.origin = origin
        self.cache = cache
        self.block_bytes = int(block_bytes)
        self.blocks = BlockMap(index, self.block_bytes)
        self._reader: BlockSource | None = None  # None: a plain reader, made per use (no reference cycle)
        self._stats = ReadStats()  # the plain reader's counters

    def __getstate__(self):
        return {**self.__dict__, "_stats": ReadStats()}  # a copy in a worker process counts its own reads

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
            raise TypeError(
                f"samples of {self.url} are indexed by id (an int), not by key {i!r}; "
                "`stoker ls URL KEY` prints a key's id"
            )
        try:
            n = operator.index(i)
        except TypeError:
            raise TypeError(f"a sample id must be an integer, got {type(i).__name__} {i!r}") from None
        if not -len(self) <= n < len(self):
            raise IndexError(f"sample {n} out of range for {len(self)} samples in {self.url}")
        return n % len(self)

    # -- the reader -------------------------------------------------------
    @property
    def reader(self) -> BlockSource:
        """The block reader this dataset's reads go through (:class:`stoker.store.blocks.BlockReader`:
        its staging area, router and :class:`ReadStats`): the one given to :meth:`with_reader`,
        else a plain one (no staging area, no router) that counts into :attr:`read_stats`."""
        reader = self._reader
        return reader if reader is not None else BlockReader(self, stats=self._stats)

    def with_reader(self, reader: BlockSource) -> Dataset:
        """A view of this dataset whose reads go through ``reader``; this one is unchanged.

        The view shares the index, block metadata, cache and origin (no copy); only the reader
        differs. A Loader's run makes one with its own staging area
        (``ds.with_reader(BlockReader(ds, staging=area, router=ds.reader.router))``), cluster
        mode one with a router. Raises ValueError when ``reader`` reads another dataset."""
        other = getattr(reader, "dataset", self)
        if other.index is not self.index:
            raise ValueError(
                f"the reader reads {other.url} (version {other.version}), not this dataset "
                f"({self.url}, version {self.version})"
            )
        view = copy.copy(self)
        view._reader = reader
        return view

    @property
    def read_stats(self) -> ReadStats:
        """This process's sample read counters (its reader's)."""
        return self._stats if self._reader is None else self._reader.stats

    # -- metadata ---------------------------------------------------------
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

    # -- reads ------------------------------------------------------------
    def read(self, i: int) -> bytes:
        """Payload bytes of sample ``i``, verified against its checksum (through :attr:`reader`:
        the node cache, the staging area, else the origin). Raises :class:`ChecksumError` and
        :class:`stoker.storage.OriginError` (see the class)."""
        i = int(i)
        reader = self.reader
        reader.stats.samples += 1
        start = int(self.index.offset[i])
        with self.origin.shared_budget():  # waiting for another process's fill spends it too
            return bytes(
                reader.read_range(i, start, start + int(self.index.length[i]), lambda d: sample_ok(self, i, d))
            )

    @overload
    def read_fields(self, i: int, *, meta: Literal[False] = False) -> dict[str, bytes]: ...
    @overload
    def read_fields(self, i: int, *, meta: Literal[True]) -> dict[str, Any]: ...
    @overload
    def read_fields(self, i: int, *, meta: bool) -> dict[str, Any]: ...

    def read_fields(self, i: int, *, meta: bool = False) -> dict[str, Any]:
        """All members of sample ``i``: ``{field name: bytes}``, primary payload first, then its
        other members in source order (WebDataset ``cls``, ``json``, ... byte-exact).

        With ``meta=True`` (what a Loader's ``decode=`` gets), the same dict followed by the
        sample's facts from the index, the same for every source: :data:`KEY_FIELD` (``"__key__"``,
        str: the sample key, ``ds.key(i)``), :data:`ID_FIELD` (``"__id__"``, int: the sample id
        ``i``) and :data:`LABEL_FIELD` (``"__label__"``, int: the class index, ``ds.labels[i]``;
        only when the sample has a label: an ImageFolder class folder, a WebDataset or file tree
        ``cls``/``json`` label, a file list's or Parquet table's ``label`` column). A member
        stored under one of these names (a Parquet column ``__key__``) is replaced by the fact;
        ``meta=False`` reads it.

        Each member is verified against its own checksum (:class:`ChecksumError`
        names the key and field). One ranged read of the sample's range (or one
        cached block). A format 1 index names the primary payload "". Raises TypeError /
        IndexError (naming the dataset) for an id that is not one of its samples.
        """
        i = self._sample_id(i)
        reader = self.reader
        reader.stats.samples += 1
        table = self.index.member_table(i)
        span_end = self.index.span_end
        assert span_end is not None  # set by DatasetIndex.__post_init__
        start, stop = int(self.index.offset[i]), int(span_end[i])
        with self.origin.shared_budget():
            data = reader.read_range(i, start, stop, lambda d: bad_field(table, d, start) is None)
        view = memoryview(data)
        out: dict[str, Any] = {name: bytes(view[off - start : off - start + n]) for name, off, n, _ in table}
        if meta:
            out[KEY_FIELD] = self.key(i)
            out[ID_FIELD] = i
            label = int(self.index.labels[i])
            if label >= 0:
                out[LABEL_FIELD] = label
        return out


def default_cache_dir() -> str:
    """``$STOKER_CACHE_DIR``, else a node-local scratch directory, else ``~/.cache/stoker``
    (:func:`stoker.cache.paths.default_cache_dir`, which logs the choice once)."""
    from ..cache.paths import default_cache_dir as choose

    return choose()


def open_dataset(
    url: str,
    cache_dir: str | None = None,
    cache_bytes: int | str | None = None,
    *,
    storage_options: dict | None = None,
    block_bytes: int | str = DEFAULT_BLOCK_BYTES,
    cache_policy: str = "future",
    cache: bool = True,
    check: bool = True,
    memory_bytes: int | str = 0,
    memory_dir: str | None = None,
    retry_budget_s: float | None = None,
    cache_mode: int | str | None = None,
    cache_read_only: bool | None = None,
) -> Dataset:
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
    ``cache_read_only``: serve the cache in ``cache_dir`` as it is, writing nothing there (a cache
    filled earlier, e.g. baked into an image or mounted read-only into many jobs): cached blocks
    are read, every other sample comes from the origin and is not kept
    (:class:`stoker.cache.readonly.ReadOnlyCache`); None: ``$STOKER_CACHE_READ_ONLY`` ("1" turns
    it on), else False. ValueError with ``memory_bytes`` (a memory tier is written);
    :class:`stoker.NotACacheError` when ``cache_dir`` holds no stoker cache. A cache directory
    that cannot be written, opened without it, raises :class:`stoker.CacheUnwritableError`
    naming it and why (a read-only filesystem, no permission).
    ``check``: list the shards once and compare sizes (and ETags where recorded) with
    the index, so shards rewritten under an unchanged index are reported by name
    (:class:`stoker.DatasetChangedError`) before any sample is served. The listing is made
    then (never one fsspec cached earlier in the process); an origin whose listing has no
    sizes (``http://``) is asked with a HEAD per shard.
    Raises :class:`stoker.OriginNotFoundError` (a FileNotFoundError) when ``url`` holds no
    index (e.g. an interrupted pack) and :class:`stoker.IndexFormatError` when the index is
    unreadable.
    """
    budget_given = cache_bytes is not None
    cache_bytes = DEFAULT_CACHE_BYTES if cache_bytes is None else parse_size(cache_bytes, "cache_bytes")
    block_bytes = parse_size(block_bytes, "block_bytes")
    memory_bytes = parse_size(memory_bytes, "memory_bytes")
    read_only = _read_only(cache_read_only)
    if read_only and cache and memory_bytes > 0:
        raise ValueError(
            "cache_read_only=True cannot have a memory tier (memory_bytes > 0): the memory tier is written"
        )
    origin = Origin(url, storage_options or {}, retry_budget_s=retry_budget_s)
    try:
        data = origin.read(INDEX_NAME)
    except FileNotFoundError:
        raise OriginNotFoundError(origin.full_url(INDEX_NAME), f"not found: {why_no_index(origin)}") from None
    index = read_index(data, origin.full_url(INDEX_NAME))
    if check:
        from .verify import check_shards

        check_shards(origin, index)
    disk: DiskCache | TieredCache | ReadOnlyCache | None = None
    if cache and read_only:
        disk = ReadOnlyCache(cache_dir or default_cache_dir(), cache_policy)
    elif cache:
        root = cache_dir or default_cache_dir()
        disk = DiskCache(root, cache_bytes, cache_policy, mode=cache_mode)
        dir_given = bool(cache_dir or os.environ.get("STOKER_CACHE_DIR"))
        warn_defaults(disk.root, cache_bytes, dir_given, budget_given)
        if memory_bytes > 0:
            disk = TieredCache(
                DiskCache(memory_dir or default_memory_root(disk.root), memory_bytes, cache_policy, mode=disk.mode),
                disk,
            )
        disk.recover()
    ds = Dataset(url, index, origin, disk, block_bytes)
    if disk is not None:
        disk.register(ds.version, index.total_bytes)
        disk.describe(ds.version, url)
    return ds


def _read_only(value: bool | None) -> bool:
    """``cache_read_only``, else ``$STOKER_CACHE_READ_ONLY`` ("1", "true", "yes" on; "", "0",
    "false", "no" off). ValueError naming the setting for anything else."""
    if value is not None:
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"cache_read_only must be True or False, got {type(value).__name__} {value!r}")
        return bool(value)
    env = os.environ.get(READ_ONLY_ENV, "").strip().lower()
    if env in ("", "0", "false", "no"):
        return False
    if env in ("1", "true", "yes"):
        return True
    raise ValueError(f"${READ_ONLY_ENV} must be 1 or 0, got {env!r}")
