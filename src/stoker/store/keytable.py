"""Lookups by key and key-prefix listings over the sample directory (the index, DLFS's
in-memory directory): "which sample is key k", "what lies under prefix p", answered from memory.

:class:`KeyTable` wraps a :class:`~stoker.store.index.DatasetIndex` without
copying it and without creating per-sample Python objects. It adds:

- **lookups by id**: :meth:`KeyTable.sample` (one record) and
  :meth:`KeyTable.lookup` (vectorised, numpy gathers);
- **lookups by key**: :meth:`KeyTable.id_of` and the vectorised
  :meth:`KeyTable.ids_of`, through a key hash table built on first use:
  a 64-bit hash of every key's UTF-8 bytes, computed with numpy straight from
  the Arrow string buffers (8 bytes per step, no Python loop over samples),
  sorted (``uint64``, 8 B/sample) with the permutation that sorts it
  (``int32``, 4 B/sample). A probe is one ``np.searchsorted``; every hit is
  verified against the key bytes, so hash collisions cost time, never a wrong
  answer;
- **a tree of key prefixes** (``/``-separated, ImageFolder ``class/stem``):
  sorted keys make every prefix a contiguous run, so a prefix maps to a range
  ``[start, stop)`` found by two binary searches over the Arrow buffers, and a
  directory listing jumps from one child's range to the next (one binary search
  per child directory, one step per leaf). Nothing is built at open; listings
  are cached.

Sample ids are positions in the index. The pack writes them in sorted key order
(byte order of the UTF-8 keys, which is also Python's ``str`` order); this is
checked at construction. If an index is not in key order, the directory keeps
one more array, ``order`` (int32/int64, (N,)), the ids in key order; ranges are
then positions in key order and :meth:`KeyTable.ids` maps them to ids.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import IndexFormatError
from .arrownp import from_numpy, from_strings, to_numpy
from .index import DatasetIndex, index_array_bytes

__all__ = ["KeyTable", "SampleRecord", "hash_keys"]

from .keyhash import (  # noqa: E402,F401 - hashing lives in keyhash; names re-exported
    _MASKS,  # noqa: F401
    _SLASH,
    _gather_words,
    _hash_one,
    _KeyTable,
    _string_buffers,
    hash_keys,
)


class SampleRecord(NamedTuple):
    """One sample's directory entry: where its payload lies and how to check it.

    ``id`` sample id; ``key`` str; ``label`` int; ``shard`` the shard's name (path
    relative to the dataset root); ``offset``/``length`` payload bytes inside the
    shard; ``checksum`` xxh3-64 of the payload (int).
    """

    id: int
    key: str
    label: int
    shard: str
    offset: int
    length: int
    checksum: int


class KeyTable:
    """In-memory sample directory over a :class:`DatasetIndex` (shares its arrays).

    ``len(d)`` samples. Resident cost beyond the index: nothing at construction
    (plus ``order``, 4 B/sample, only for an index whose ids are not in key order);
    the key table (12 B/sample) is built on the first key lookup or by
    :meth:`prepare`. Thread-safe for concurrent readers.

    Raises :class:`IndexFormatError` when the index has null or duplicate keys (the
    message names the duplicated key and its ids).
    """

    def __init__(self, index: DatasetIndex):
        self.index = index
        self.keys, self._offsets, self._data = _string_buffers(index.keys)
        self._mv = self._data.data  # a memoryview of the uint8 buffer
        n = len(self.keys)
        if n != len(index):
            raise IndexFormatError(f"the index has {n} keys for {len(index)} samples")
        self.order: np.ndarray | None = None
        if n > 1:
            ascending = pc.less(self.keys.slice(0, n - 1), self.keys.slice(1))
            if not pc.all(ascending).as_py():
                self._check_unique_and_order()
        self._table: _KeyTable | None = None
        self._lock = threading.Lock()
        self._listing_cache: OrderedDict = OrderedDict()

    def _check_unique_and_order(self) -> None:
        n = len(self.keys)
        order = to_numpy(pc.sort_indices(self.keys)).astype(np.int64)
        sk = self.keys.take(from_numpy(order))
        same = to_numpy(pc.equal(sk.slice(0, n - 1), sk.slice(1)), null=False)
        if same.any():
            j = int(np.argmax(same))
            a, b = sorted((int(order[j]), int(order[j + 1])))
            raise IndexFormatError(f"duplicate key {sk[j].as_py()!r} (sample ids {a} and {b})")
        self.order = order.astype(np.int32) if n < 2**31 else order

    # -- basics -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.keys)

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_offsets", "_data", "_mv", "_lock", "_table", "_listing_cache"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        _, self._offsets, self._data = _string_buffers(self.keys)
        self._mv = self._data.data  # a memoryview of the uint8 buffer
        self._table, self._lock, self._listing_cache = None, threading.Lock(), OrderedDict()

    @property
    def keys_sorted(self) -> bool:
        """True when sample ids are in key order (ranges are then id ranges)."""
        return self.order is None

    @property
    def nbytes(self) -> int:
        """Resident bytes of the directory's arrays: the index's keys and columns (named fields
        included, :func:`.index.index_array_bytes`), plus ``order`` and the key table when present
        (Python object overhead not counted)."""
        total = self.keys.nbytes + index_array_bytes(self.index)
        if self.order is not None:
            total += self.order.nbytes
        t = self._table
        if t is not None:
            total += t.hashes.nbytes + t.ids.nbytes
        return int(total)

    def _key_bytes(self, i: int) -> bytes:
        """UTF-8 bytes of the key of sample id ``i`` (no bounds check)."""
        o = self._offsets
        return self._mv[o[i] : o[i + 1]].tobytes()

    def _ranked_bytes(self, pos: int) -> bytes:
        """Key bytes of the ``pos``-th key in key order."""
        return self._key_bytes(pos if self.order is None else int(self.order[pos]))

    def key(self, i: int) -> str:
        """Key of sample ``i`` (0 <= i < N; IndexError otherwise)."""
        return self._key_bytes(self._check_id(i)).decode("utf-8")

    def _check_id(self, i) -> int:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample id {i} out of range for {len(self)} samples")
        return i

    # -- lookups by id ------------------------------------------------------
    def sample(self, i: int) -> SampleRecord:
        """The record of sample ``i``. Raises IndexError unless 0 <= i < N."""
        i = self._check_id(i)
        idx = self.index
        return SampleRecord(
            i,
            self._key_bytes(i).decode("utf-8"),
            int(idx.labels[i]),
            idx.shards[int(idx.shard[i])]["name"],
            int(idx.offset[i]),
            int(idx.length[i]),
            int(idx.checksum[i]),
        )

    def lookup(self, ids) -> dict:
        """Vectorised lookup of many ids (array-like of ints, shape (M,)).

        Returns a dict of arrays of shape (M,): ``label`` int64, ``shard`` int32
        (index into ``index.shards``), ``offset`` int64 and ``length`` int64 (bytes),
        ``checksum`` uint64. Raises IndexError naming the first id outside [0, N).
        Keys are not included: :meth:`keys_of` gathers them.
        """
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = ids[(ids < 0) | (ids >= len(self))][0]
            raise IndexError(f"sample id {int(bad)} out of range for {len(self)} samples")
        idx = self.index
        return {
            "label": idx.labels[ids],
            "shard": idx.shard[ids].astype(np.int32),
            "offset": idx.offset[ids].astype(np.int64),
            "length": idx.length[ids].astype(np.int64),
            "checksum": idx.checksum[ids],
        }

    def keys_of(self, ids) -> pa.Array:
        """Keys of many ids as a pyarrow string array (M,). IndexError on a bad id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = ids[(ids < 0) | (ids >= len(self))][0]
            raise IndexError(f"sample id {int(bad)} out of range for {len(self)} samples")
        return self.keys.take(from_numpy(ids))

    # -- lookups by key -----------------------------------------------------
    def prepare(self) -> KeyTable:
        """Build the key table now (otherwise built on the first key lookup). Returns self."""
        self._key_table()
        return self

    def _key_table(self) -> _KeyTable:
        t = self._table
        if t is None:
            with self._lock:
                if self._table is None:
                    self._table = _KeyTable(self._offsets, self._data)
                t = self._table
        return t

    def id_of(self, key: str) -> int:
        """Sample id of ``key`` (str or UTF-8 bytes). Raises KeyError naming the key."""
        kb = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else bytes(key)
        t = self._key_table()
        h = np.uint64(_hash_one(kb))
        pos = int(t.hashes.searchsorted(h))
        n = len(t.hashes)
        while pos < n and t.hashes[pos] == h:
            i = int(t.ids[pos])
            if self._key_bytes(i) == kb:
                return i
            pos += 1
        raise KeyError(f"no sample with key {key!r}")

    def ids_of(self, keys, default: int | None = None) -> np.ndarray:
        """Sample ids of many keys: list of str, or a pyarrow string array, shape (M,).

        Returns int64 (M,). A key not in the directory raises KeyError naming it (the
        first few when several are missing), unless ``default`` is given: then it maps
        to ``default`` (e.g. -1).
        """
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        if not isinstance(keys, pa.Array):
            keys = from_strings(keys)
        keys, offsets, data = _string_buffers(keys)
        t = self._key_table()
        m = len(keys)
        out = np.full(m, -1, dtype=np.int64)
        if m == 0:
            return out
        if len(t.hashes) == 0:
            found = np.zeros(m, dtype=bool)
        else:
            h = hash_keys(offsets, data)
            if m > 4096:
                # searchsorted is several times faster with ascending needles
                # (cache-friendly); sorting them costs less than it saves.
                qo = np.argsort(h)
                pos = np.empty(m, dtype=np.int64)
                pos[qo] = np.searchsorted(t.hashes, h[qo])
            else:
                pos = np.searchsorted(t.hashes, h)
            rows = np.arange(m)
            found = np.zeros(m, dtype=bool)
            n = len(t.hashes)
            # Normally one round; a further round only for keys whose hash collides
            # with another key's.
            while rows.size:
                inb = pos < n
                rows, pos = rows[inb], pos[inb]
                hit = t.hashes[pos] == h[rows]
                rows, pos = rows[hit], pos[hit]
                if not rows.size:
                    break
                cand = t.ids[pos].astype(np.int64)
                same = pc.equal(self.keys.take(from_numpy(cand)), keys.take(from_numpy(rows)))
                same = to_numpy(same, null=False)
                out[rows[same]] = cand[same]
                found[rows[same]] = True
                rows, pos = rows[~same], pos[~same] + 1
        if not found.all():
            if default is None:
                miss = np.flatnonzero(~found)
                names = ", ".join(repr(keys[int(j)].as_py()) for j in miss[:5])
                more = f" and {len(miss) - 5} more" if len(miss) > 5 else ""
                raise KeyError(f"no sample with key {names}{more}")
            out[~found] = default
        return out

    def __contains__(self, key) -> bool:
        try:
            self.id_of(key)
        except KeyError:
            return False
        return True

    # -- the prefix tree ----------------------------------------------------
    def ids(self, start: int, stop: int) -> np.ndarray:
        """Sample ids of the key-order range [start, stop) (from :meth:`prefix_range`),
        int64 (stop-start,). ``np.arange(start, stop)`` when :attr:`keys_sorted`."""
        if self.order is None:
            return np.arange(start, stop, dtype=np.int64)
        return self.order[start:stop].astype(np.int64)

    def prefix_range(self, prefix: str) -> tuple[int, int]:
        """Range ``[start, stop)`` of the keys that begin with the string ``prefix``.

        Byte-wise string prefix: ``"a/b"`` covers ``a/b``, ``a/bc`` and ``a/b/x``;
        pass ``"a/b/"`` for the directory. ``""`` is everything. When
        :attr:`keys_sorted` (the packed layout) the range is a range of sample ids;
        otherwise of positions in key order (see :meth:`ids`). An empty range
        (start == stop) means no key has the prefix. O(log N).
        """
        p = prefix.encode("utf-8", "surrogatepass") if isinstance(prefix, str) else bytes(prefix)
        return self._range(p, 0, len(self))

    def _range(self, p: bytes, lo: int, hi: int) -> tuple[int, int]:
        if not p:
            return lo, hi
        kb = self._ranked_bytes
        lp = len(p)
        start = bisect.bisect_left(range(hi), p, lo, hi, key=kb)
        stop = bisect.bisect_right(range(hi), p, start, hi, key=lambda pos: kb(pos)[:lp])
        return start, stop

    @staticmethod
    def _dir(prefix: str) -> str:
        return prefix if prefix == "" or prefix.endswith("/") else prefix + "/"

    def children(self, prefix: str = "", limit: int | None = None) -> list[tuple[str, bool, int, int]]:
        """Direct children of the directory ``prefix`` (trailing ``/`` optional; ``""`` = root).

        Returns ``[(name, is_leaf, start, stop), ...]`` in key order: a leaf is a key
        (``name`` is its last component, range of length 1); a directory's ``name``
        ends with ``/`` and its range covers every key below it. A key and a
        directory may share a name (``a/b`` and ``a/b/c``): both are listed. At most
        ``limit`` entries. Raises KeyError naming ``prefix`` when no key lies below
        it (the root of an empty directory lists nothing). Cost: one binary search
        per child directory plus one step per leaf listed.
        """
        d = self._dir(prefix)
        cache_key = (d, limit)
        cached = self._listing_cache.get(cache_key)
        if cached is not None:
            return list(cached)
        db = d.encode("utf-8", "surrogatepass")
        start, stop = self._range(db, 0, len(self))
        if start == stop and d:
            raise KeyError(f"no directory {prefix!r}: no key starts with {d!r}")
        kb = self._ranked_bytes
        lp = len(db)
        out: list[tuple[str, bool, int, int]] = []
        pos = start
        while pos < stop and (limit is None or len(out) < limit):
            k = kb(pos)
            j = k.find(_SLASH, lp)
            if j < 0:
                out.append((k[lp:].decode("utf-8", "surrogatepass"), True, pos, pos + 1))
                pos += 1
            else:
                sub = k[: j + 1]
                ls_ = len(sub)
                end = bisect.bisect_right(range(stop), sub, pos, stop, key=lambda q: kb(q)[:ls_])
                out.append((k[lp : j + 1].decode("utf-8", "surrogatepass"), False, pos, end))
                pos = end
        self._listing_cache[cache_key] = out
        if len(self._listing_cache) > 256:
            self._listing_cache.popitem(last=False)
        return list(out)

    # -- summary ------------------------------------------------------------
    def summary(self) -> dict:
        """``{samples, payload_bytes, shards, shard_bytes, classes, version, keys_sorted,
        directory_bytes}``: counts are ints, bytes in bytes, version the index's content
        version (hex str)."""
        idx = self.index
        return {
            "samples": len(self),
            "payload_bytes": idx.total_bytes,
            "shards": len(idx.shards),
            "shard_bytes": int(sum(int(s["bytes"]) for s in idx.shards)),
            "classes": len(idx.classes),
            "version": idx.version,
            "keys_sorted": self.keys_sorted,
            "directory_bytes": self.nbytes,
        }
