"""`open_dataset`: a map-style dataset over a packed store, read through the node cache.

A sample costs one lookup in the in-memory index and one ranged read. Fetching blocks and
filling the cache is the dataset's reader's job (:mod:`.blocks`, which says where a read looks
first); the blocks themselves are ``ds.blocks`` (:class:`stoker.store.blockmap.BlockMap`), and the
checks of bytes against the index are :mod:`.checks`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import os
from typing import Any, Literal, overload

import numpy as np

from .._units import format_size, parse_size
from ..cache import DiskCache, ReadOnlyCache, TieredCache, default_memory_root
from ..cache.paths import default_cache_dir, warn_defaults
from ..cache.readonly import READ_ONLY_ENV
from ..cache.spec import DEFAULT_CACHE_BYTES, MOVED, CacheOptions, moved, with_shortcuts
from ..errors import ChecksumError, OriginError, OriginNotFoundError  # noqa: F401 - re-exported
from ..storage import Origin
from .blockmap import BlockMap
from .blocks import BlockReader, BlockSource, ReadStats
from .checks import bad_field, sample_ok
from .diagnose import why_no_index
from .index import INDEX_NAME, DatasetIndex, read_index, release_memory
from .subset import select, selection_digest, split_positions

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 1 << 20
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

    A subset (:meth:`subset`, :meth:`split`) is a Dataset over some of the samples of the same
    packed dataset: the same index, blocks, cache and version (nothing re-packed, no block cached
    twice). Its ``len()``, ``ds[i]``, :meth:`read`, :meth:`read_fields`, :meth:`key` and
    :attr:`labels` count its own samples, ``0..len(ds)-1`` in the packed order;
    :attr:`selection` maps them to the packed dataset's sample ids (the ids the index, a
    Loader's plan and ``decode=``'s ``"__id__"`` use), and :attr:`whole` is the dataset of every
    sample.
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
        #: the packed dataset's sample ids this dataset holds, int64 ascending, or None: all of them
        self.selection: np.ndarray | None = None

    def __getstate__(self):
        return {**self.__dict__, "_stats": ReadStats()}  # a copy in a worker process counts its own reads

    def __len__(self) -> int:
        return len(self.index) if self.selection is None else len(self.selection)

    @property
    def num_blocks(self) -> int:
        """How many cache blocks the dataset is cut into (``len(ds.blocks)``; the block plan is
        :attr:`blocks`, :class:`stoker.store.blockmap.BlockMap`)."""
        return len(self.blocks)

    def __repr__(self) -> str:
        """``Dataset('s3://b/train', version='3f2a9c0d11aa', samples=120, block_bytes='4MiB')``:
        the URL, the content version's first 12 characters (as ``stoker cache status`` prints
        it), the samples, the block size (the cache's unit) and ``cache=None`` when it reads
        without a cache; a subset says of how many: ``samples=30, subset_of=120``."""
        nocache = ", cache=None" if self.cache is None else ""
        part = "" if self.selection is None else f", subset_of={len(self.index)}"
        return (
            f"Dataset({self.url!r}, version={self.version[:12]!r}, samples={len(self)}{part}, "
            f"block_bytes={format_size(self.block_bytes)!r}{nocache})"
        )

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        """(payload bytes, label) of sample ``i`` (negative ids count from the end).

        Raises TypeError for an id that is not an integer, IndexError (naming the dataset) for
        one out of range, and what :meth:`read` raises. A subset's ``i`` counts its own samples."""
        i = self._sample_id(i)
        return self._read_id(i), int(self.index.labels[i])

    def _sample_id(self, i) -> int:
        """The packed dataset's sample id of this dataset's sample ``i`` (in ``0..len-1``;
        negative counts from the end), or a clear error."""
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
            of = "" if self.selection is None else f" of a subset of {len(self.index)}"
            raise IndexError(f"sample {n} out of range for {len(self)} samples{of} in {self.url}")
        n %= len(self)
        return n if self.selection is None else int(self.selection[n])

    # -- subsets ----------------------------------------------------------
    def subset(self, selection) -> Dataset:
        """A Dataset over the samples ``selection`` names, in this dataset's order.

        It shares this dataset's index, blocks, cache, version and reader (no re-pack, no copy
        of any block). ``selection`` is one of:

        - sample ids: ints (a list, a range, an integer numpy array), this dataset's own
          (``0..len-1``: the packed ids for a whole dataset, positions for a subset);
        - sample keys: strs (a list, a numpy or pyarrow string array);
        - a numpy bool mask of ``len(self)``;
        - a predicate ``fn(table) -> mask`` over the index columns, ``table`` a
          ``pyarrow.Table`` of one row per sample (``sample_id``, ``key``, ``label``,
          ``class_name``, ``shard``, ``length``: :func:`stoker.store.subset.columns`), ``mask``
          one bool per row (``lambda t: pyarrow.compute.equal(t["class_name"], "cat")``,
          ``lambda t: t["label"].to_numpy() < 2``).

        A Loader over the subset serves exactly its samples (each once per epoch), its resume
        state belongs to it (another subset's is refused), its ranks split it, and it reads
        only the blocks that hold its samples. Raises what :func:`stoker.store.subset.select`
        raises (TypeError, IndexError, KeyError naming an unknown key, ValueError)."""
        return self._with_selection(select(self, selection))

    def split(self, fractions, seed: int = 0) -> list[Dataset]:
        """Disjoint subsets that cover this dataset, one per fraction (``[0.9, 0.1]``: train and
        validation), in the order given: a random deal of its samples by ``seed``, each part
        within one sample of its fraction and in the dataset's order
        (:func:`stoker.store.subset.split_positions`). The same ``seed`` gives the same parts in
        every process and on every rank. Raises TypeError / ValueError for fractions that are
        not numbers in (0, 1] summing to 1, naming them."""
        return [self._with_selection(select(self, part)) for part in split_positions(len(self), fractions, seed)]

    @property
    def whole(self) -> Dataset:
        """The dataset of every sample of the packed dataset (this one, unless it is a subset)."""
        return self if self.selection is None else self._with_selection(None)

    @property
    def selection_digest(self) -> str | None:
        """What names this subset in a Loader's resume state (``"<count>:<xxh3-64 hex>"`` of
        :attr:`selection`), or None for the whole dataset."""
        return selection_digest(self.selection)

    def _with_selection(self, ids: np.ndarray | None) -> Dataset:
        view = copy.copy(self)
        view.selection = ids
        return view

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
        """int64 (len,): each sample's label (-1: none); a subset's are its own samples'."""
        return self.index.labels if self.selection is None else self.index.labels[self.selection]

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
        """The key of sample ``i`` (a subset's ``i`` counts its own samples)."""
        return self.index.key(i if self.selection is None else self._sample_id(i))

    # -- reads ------------------------------------------------------------
    def read(self, i: int) -> bytes:
        """Payload bytes of sample ``i``, verified against its checksum (through :attr:`reader`:
        the node cache, the staging area, else the origin). Raises :class:`ChecksumError` and
        :class:`stoker.storage.OriginError` (see the class). A subset's ``i`` counts its own
        samples (IndexError out of range)."""
        return self._read_id(int(i) if self.selection is None else self._sample_id(i))

    def _read_id(self, i: int) -> bytes:
        """Payload bytes of the packed dataset's sample ``i`` (see :meth:`read`)."""
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
        ``i``; a subset's: the packed dataset's id, ``ds.selection[i]``) and :data:`LABEL_FIELD`
        (``"__label__"``, int: the class index, ``ds.labels[i]``;
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
        if len(table) == 1 and type(data) is bytes and table[0][1] == start and table[0][2] == len(data):
            out: dict[str, Any] = {table[0][0]: data}  # one member, read alone: its bytes as they came, no copy
        else:
            view = memoryview(data)
            out = {name: bytes(view[off - start : off - start + n]) for name, off, n, _ in table}
        if meta:
            out[KEY_FIELD] = self.index.key(i)
            out[ID_FIELD] = i
            label = int(self.index.labels[i])
            if label >= 0:
                out[LABEL_FIELD] = label
        return out


def open_dataset(
    url: str,
    cache_dir: str | None = None,
    cache_bytes: int | str | None = None,
    *,
    cache: CacheOptions | bool | None = None,
    storage_options: dict | None = None,
    block_bytes: int | str = DEFAULT_BLOCK_BYTES,
    check: bool = True,
    retry_budget_s: float | None = None,
    **deprecated,
) -> Dataset:
    """Open the packed dataset at ``url`` (any fsspec URL) as a map-style :class:`Dataset`.

    ``cache``: the node cache (:class:`stoker.CacheOptions`: directory, budget, memory tier,
    policy, file mode, read-only; default ``CacheOptions()``), or False: none, every sample from
    the origin; ``cache_dir``/``cache_bytes`` are the shortcut for its first two fields, and its
    other fields' old keywords (``memory_bytes=`` ...) still work with a DeprecationWarning. The
    process registers its job with the cache (dataset bytes; the Loader adds its epoch time).
    ``storage_options``: fsspec options (S3: endpoint_url, key, secret, ...). ``block_bytes``: the
    cache's unit (bytes or a size string; default 1 MiB). ``check``: list the shards once (a fresh
    listing, or a HEAD per shard where it has no sizes) and compare sizes and recorded ETags with
    the index, so shards rewritten under it are named before any sample is served.
    ``retry_budget_s``: seconds each origin read retries throttling, 5xx, resets and timeouts
    before :class:`stoker.OriginError`; None: ``$STOKER_RETRY_BUDGET_S`` or 30 s
    (:mod:`stoker.storage.retry`).

    Raises TypeError / ValueError for a bad setting (naming it), :class:`stoker.OriginNotFoundError`
    (no index at ``url``, e.g. an interrupted pack), :class:`stoker.IndexFormatError`,
    :class:`stoker.DatasetChangedError` (with ``check``), :class:`stoker.OriginError`, and for a
    cache directory made with another mode, planted or writable by others, that cannot be written
    or (read-only) holds no cache: :class:`stoker.CacheModeError`, :class:`stoker.UnsafePathError`,
    :class:`stoker.CacheUnwritableError`, :class:`stoker.NotACacheError` (each naming it).
    """
    if isinstance(cache_dir, CacheOptions):
        raise TypeError("open_dataset: pass a CacheOptions as cache=..., not in the place of cache_dir")
    given = None if isinstance(cache, bool) else cache
    spec = with_shortcuts(
        moved("open_dataset", deprecated, "cache", given, CacheOptions, MOVED, 3), cache_dir, cache_bytes
    )
    if cache is False and spec != CacheOptions():
        set_ = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != f.default]
        raise TypeError(f"open_dataset: cache=False reads no node cache, but {', '.join(set_)} was given too")
    block_bytes = parse_size(block_bytes, "block_bytes")
    origin = Origin(url, storage_options or {}, retry_budget_s=retry_budget_s)
    try:
        data = origin.read(INDEX_NAME)
    except FileNotFoundError:
        raise OriginNotFoundError(origin.full_url(INDEX_NAME), f"not found: {why_no_index(origin)}") from None
    index = read_index(data, origin.full_url(INDEX_NAME))
    del data
    if check:
        from .verify import check_shards

        check_shards(origin, index)
    disk = None if cache is False else _node_cache(spec)
    ds = Dataset(url, index, origin, disk, block_bytes)
    release_memory()  # the index file's bytes and the block plan's temporaries
    if disk is not None:
        disk.register(ds.version, index.total_bytes)
        disk.describe(ds.version, url)
    return ds


def _node_cache(cache: CacheOptions) -> DiskCache | TieredCache | ReadOnlyCache:
    """The node cache that ``cache`` describes, recovered from a crash of an earlier job."""
    assert isinstance(cache.memory_bytes, int) and not isinstance(cache.cache_bytes, str)  # parsed by CacheOptions
    root = cache.cache_dir or default_cache_dir()
    if _read_only(cache.cache_read_only):
        if cache.memory_bytes > 0:
            raise ValueError(
                "cache_read_only=True cannot have a memory tier (memory_bytes > 0): the memory tier is written"
            )
        return ReadOnlyCache(root, cache.cache_policy)
    if isinstance(cache.cache_bytes, dict):
        raise TypeError("CacheOptions.cache_bytes by node id is for stoker.cluster; open_dataset takes one budget")
    disk = DiskCache(
        root,
        DEFAULT_CACHE_BYTES if cache.cache_bytes is None else cache.cache_bytes,
        cache.cache_policy,
        mode=cache.cache_mode,
    )
    dir_given = bool(cache.cache_dir or os.environ.get("STOKER_CACHE_DIR"))
    warn_defaults(disk.root, disk.capacity_bytes, dir_given, cache.cache_bytes is not None)
    node: DiskCache | TieredCache = disk
    if cache.memory_bytes > 0:
        memory_root = cache.memory_dir or default_memory_root(disk.root)
        node = TieredCache(DiskCache(memory_root, cache.memory_bytes, cache.cache_policy, mode=disk.mode), disk)
    node.recover()
    return node


def _read_only(value: bool | None) -> bool:
    """``CacheOptions.cache_read_only``, else ``$STOKER_CACHE_READ_ONLY`` ("1", "true", "yes" on;
    "", "0", "false", "no" off). ValueError naming the variable for anything else."""
    if value is not None:
        return value
    env = os.environ.get(READ_ONLY_ENV, "").strip().lower()
    if env in ("", "0", "false", "no"):
        return False
    if env in ("1", "true", "yes"):
        return True
    raise ValueError(f"${READ_ONLY_ENV} must be 1 or 0, got {env!r}")
