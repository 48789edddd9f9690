"""The sample directory (DLFS): "where is sample i / key k" answered from memory.

:class:`SampleDirectory` wraps a :class:`~stoker.store.index.DatasetIndex` without
copying it and without creating per-sample Python objects. It adds:

- **lookups by id**: :meth:`SampleDirectory.sample` (one record) and
  :meth:`SampleDirectory.lookup` (vectorised, numpy gathers);
- **lookups by key**: :meth:`SampleDirectory.id_of` and the vectorised
  :meth:`SampleDirectory.ids_of`, through a key hash table built on first use:
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
then positions in key order and :meth:`SampleDirectory.ids` maps them to ids.

Module functions :func:`ls` and :func:`stat` format the ``stoker ls`` and
``stoker stat`` output; :func:`add_parsers` registers both subcommands.
"""
from __future__ import annotations

import bisect
import json
import sys
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .index import DatasetIndex, IndexError_

__all__ = ["SampleDirectory", "SampleRecord", "hash_keys", "ls", "stat", "add_parsers"]

# splitmix64 / murmur-style odd multipliers
_K0 = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_K0_INT, _K1_INT, _K2_INT = int(_K0), int(_K1), int(_K2)
_S27, _S29, _S30, _S31 = (np.uint64(s) for s in (27, 29, 30, 31))
_MASKS = np.array([(1 << (8 * r)) - 1 for r in range(9)], dtype=np.uint64)  # low r bytes
_SLASH = b"/"


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


def _string_buffers(keys: pa.Array) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Zero-copy views of a string array: (array, offsets (N+1,) int32/int64, data uint8).

    Offsets are absolute positions in ``data``. Raises :class:`IndexError_` on null keys.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_large_string(keys.type) or pa.types.is_large_binary(keys.type):
        off_type = np.int64
    elif pa.types.is_string(keys.type) or pa.types.is_binary(keys.type):
        off_type = np.int32
    else:  # string_view, dictionary, ...
        keys = keys.cast(pa.string())
        off_type = np.int32
    if keys.null_count:
        raise IndexError_(f"the index has {keys.null_count} null keys")
    n = len(keys)
    bufs = keys.buffers()
    if bufs[1] is None:  # empty array
        offsets = np.zeros(n + 1, dtype=off_type)
    else:
        offsets = np.frombuffer(bufs[1], dtype=off_type, count=n + 1,
                                offset=keys.offset * np.dtype(off_type).itemsize)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return keys, offsets, data


def _gather_words(data: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Little-endian uint64 loaded at each byte position ``pos`` (int64, (M,)) of ``data``.

    Bytes past the end of ``data`` read as zero (the caller masks them anyway).
    """
    size = data.size
    if size >= 8:
        # 8-byte opaque items at every byte position: numpy gathers these with a
        # plain copy (faster than an unaligned uint64 view), then views them aligned.
        words = np.ndarray(shape=(size - 7,), dtype="V8", buffer=data, strides=(1,))
        if pos.size == 0 or pos.max() <= size - 8:
            return words[pos].view("<u8")
        safe = pos <= size - 8
        out = np.empty(pos.shape, dtype=np.uint64)
        out[safe] = words[pos[safe]].view("<u8")
        tail_start = size - 8
    else:
        out = np.empty(pos.shape, dtype=np.uint64)
        safe = np.zeros(pos.shape, dtype=bool)
        tail_start = 0
    padded = np.zeros(24, dtype=np.uint8)
    padded[: size - tail_start] = data[tail_start:]
    tail_words = np.ndarray(shape=(17,), dtype="<u8", buffer=padded, strides=(1,))
    rest = ~safe
    out[rest] = tail_words[pos[rest] - tail_start]
    return out


def hash_keys(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """64-bit hash of each string in an Arrow-layout buffer pair, vectorised.

    ``offsets``: int32/int64 (M+1,) byte positions in ``data`` (uint8); string i is
    ``data[offsets[i]:offsets[i+1]]``. Returns uint64 (M,). Equal bytes give equal
    hashes (whatever array they live in); the mixing is splitmix64-style over
    8-byte little-endian words, the length folded in first. Not cryptographic.
    Cost: one gather and a few array passes per 8 bytes of the longest key.
    """
    pos = offsets[:-1].astype(np.int64)
    rem = np.diff(offsets).astype(np.int64)  # bytes left to hash
    with np.errstate(over="ignore"):
        h = rem.astype(np.uint64) * _K0
        rows = None  # rows still hashing; None = all
        cur = h
        while pos.size:
            live = rem > 0
            if not live.all():
                if rows is not None:
                    h[rows] = cur
                keep = np.flatnonzero(live)
                rows = keep if rows is None else rows[keep]
                pos, rem = pos[keep], rem[keep]
                if not pos.size:
                    rows = None  # all written back
                    break
                cur = h[rows]
            w = _gather_words(data, pos)
            if rem.min() < 8:
                w &= _MASKS[np.minimum(rem, 8)]
            cur ^= w
            cur *= _K1
            np.right_shift(cur, _S29, out=w)
            cur ^= w
            pos += 8
            rem -= 8
        if rows is not None:
            h[rows] = cur
        t = np.empty_like(h)
        for mult, shift in ((_K1, _S30), (_K2, _S27), (None, _S31)):
            np.right_shift(h, shift, out=t)
            h ^= t
            if mult is not None:
                h *= mult
    return h


def _hash_one(kb: bytes) -> int:
    """:func:`hash_keys` of one byte string, in plain Python (no numpy call overhead)."""
    m = 0xFFFFFFFFFFFFFFFF
    h = (len(kb) * _K0_INT) & m
    for k in range(0, len(kb), 8):
        h ^= int.from_bytes(kb[k:k + 8], "little")
        h = (h * _K1_INT) & m
        h ^= h >> 29
    h ^= h >> 30
    h = (h * _K1_INT) & m
    h ^= h >> 27
    h = (h * _K2_INT) & m
    return h ^ (h >> 31)


class _KeyTable:
    """Sorted key hashes (uint64, (N,)) and the ids that sort them (int32/int64, (N,))."""

    __slots__ = ("hashes", "ids")

    def __init__(self, offsets: np.ndarray, data: np.ndarray):
        h = hash_keys(offsets, data)
        ids = np.argsort(h)
        self.ids = ids.astype(np.int32) if len(h) < 2**31 else ids
        self.hashes = h[ids]


class SampleDirectory:
    """In-memory sample directory over a :class:`DatasetIndex` (shares its arrays).

    ``len(d)`` samples. Resident cost beyond the index: nothing at construction
    (plus ``order``, 4 B/sample, only for an index whose ids are not in key order);
    the key table (12 B/sample) is built on the first key lookup or by
    :meth:`prepare`. Thread-safe for concurrent readers.

    Raises :class:`IndexError_` when the index has null or duplicate keys (the
    message names the duplicated key and its ids).
    """

    def __init__(self, index: DatasetIndex):
        self.index = index
        self.keys, self._offsets, self._data = _string_buffers(index.keys)
        self._mv = memoryview(self._data)
        n = len(self.keys)
        if n != len(index):
            raise IndexError_(f"the index has {n} keys for {len(index)} samples")
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
        order = pc.sort_indices(self.keys).to_numpy().astype(np.int64)
        sk = self.keys.take(pa.array(order))
        same = pc.equal(sk.slice(0, n - 1), sk.slice(1)).to_numpy(zero_copy_only=False)
        if same.any():
            j = int(np.argmax(same))
            a, b = sorted((int(order[j]), int(order[j + 1])))
            raise IndexError_(f"duplicate key {sk[j].as_py()!r} (sample ids {a} and {b})")
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
        self._mv = memoryview(self._data)
        self._table, self._lock, self._listing_cache = None, threading.Lock(), OrderedDict()

    @property
    def keys_sorted(self) -> bool:
        """True when sample ids are in key order (ranges are then id ranges)."""
        return self.order is None

    @property
    def nbytes(self) -> int:
        """Resident bytes of the directory's arrays: the index's columns and keys, plus
        ``order`` and the key table when present (Python object overhead not counted)."""
        idx = self.index
        total = self.keys.nbytes + sum(a.nbytes for a in (idx.labels, idx.shard, idx.offset,
                                                           idx.length, idx.checksum))
        if self.order is not None:
            total += self.order.nbytes
        t = self._table
        if t is not None:
            total += t.hashes.nbytes + t.ids.nbytes
        return int(total)

    def _key_bytes(self, i: int) -> bytes:
        """UTF-8 bytes of the key of sample id ``i`` (no bounds check)."""
        o = self._offsets
        return self._mv[o[i]:o[i + 1]].tobytes()

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
        return SampleRecord(i, self._key_bytes(i).decode("utf-8"), int(idx.labels[i]),
                            idx.shards[int(idx.shard[i])]["name"], int(idx.offset[i]),
                            int(idx.length[i]), int(idx.checksum[i]))

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
        return {"label": idx.labels[ids], "shard": idx.shard[ids], "offset": idx.offset[ids],
                "length": idx.length[ids], "checksum": idx.checksum[ids]}

    def keys_of(self, ids) -> pa.Array:
        """Keys of many ids as a pyarrow string array (M,). IndexError on a bad id."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            bad = ids[(ids < 0) | (ids >= len(self))][0]
            raise IndexError(f"sample id {int(bad)} out of range for {len(self)} samples")
        return self.keys.take(pa.array(ids))

    # -- lookups by key -----------------------------------------------------
    def prepare(self) -> "SampleDirectory":
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
            keys = pa.array(keys, type=pa.string())
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
                same = pc.equal(self.keys.take(pa.array(cand)), keys.take(pa.array(rows)))
                same = same.to_numpy(zero_copy_only=False)
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
        out = []
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
                out.append((k[lp:j + 1].decode("utf-8", "surrogatepass"), False, pos, end))
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
        return {"samples": len(self), "payload_bytes": idx.total_bytes,
                "shards": len(idx.shards), "shard_bytes": int(sum(int(s["bytes"]) for s in idx.shards)),
                "classes": len(idx.classes), "version": idx.version,
                "keys_sorted": self.keys_sorted, "directory_bytes": self.nbytes}


# -- `stoker ls` / `stoker stat` ------------------------------------------------
def _human(n: int) -> str:
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{int(v)} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"


def _sample_line(d: SampleDirectory, name: str, i: int) -> str:
    r = d.sample(i)
    return f"{name}\t{r.length} B\tlabel {r.label}\t{r.shard}@{r.offset}\tid {r.id}"


def ls(directory: SampleDirectory, prefix: str = "", limit: int | None = 1000) -> list[str]:
    """Lines for ``stoker ls``: the children of directory ``prefix``.

    A directory line is ``name/<TAB>count samples<TAB>ids start-stop`` (ids only when
    keys are sorted); a sample line is ``name<TAB>length B<TAB>label L<TAB>shard@offset<TAB>id I``.
    If ``prefix`` is itself a key, its sample line (full key) comes first. At most
    ``limit`` children (None = all), then a ``... more`` line. Raises KeyError naming
    ``prefix`` when it is neither a key nor a directory.
    """
    lines = []
    exact = None
    if prefix and not prefix.endswith("/"):
        try:
            exact = directory.id_of(prefix)
        except KeyError:
            exact = None
        if exact is not None:
            lines.append(_sample_line(directory, prefix, exact))
    try:
        kids = directory.children(prefix, None if limit is None else limit + 1)
    except KeyError:
        if exact is not None:
            return lines
        raise KeyError(f"{prefix!r}: no such key or directory") from None
    more = limit is not None and len(kids) > limit
    for name, leaf, start, stop in kids[:limit]:
        if leaf:
            lines.append(_sample_line(directory, name, int(directory.ids(start, stop)[0])))
        else:
            span = f"\tids {start}-{stop}" if directory.keys_sorted else ""
            lines.append(f"{name}\t{stop - start} samples{span}")
    if more:
        lines.append(f"... more entries (showing the first {limit}; raise --limit)")
    return lines


def stat(directory: SampleDirectory, url: str | None = None) -> list[str]:
    """Lines for ``stoker stat``: ``name: value`` for the fields of :meth:`SampleDirectory.summary`."""
    s = directory.summary()
    lines = [f"url: {url}"] if url is not None else []
    lines += [f"samples: {s['samples']}",
              f"payload_bytes: {s['payload_bytes']} ({_human(s['payload_bytes'])})",
              f"shards: {s['shards']}",
              f"shard_bytes: {s['shard_bytes']} ({_human(s['shard_bytes'])})",
              f"classes: {s['classes']}",
              f"version: {s['version']}",
              f"keys_sorted: {s['keys_sorted']}",
              f"directory_bytes: {s['directory_bytes']} ({_human(s['directory_bytes'])})"]
    return lines


def _open_directory(a) -> SampleDirectory:
    from .dataset import open_dataset
    ds = open_dataset(a.url, cache=False, check=False, storage_options=json.loads(a.storage_options or "{}"))
    return SampleDirectory(ds.index)


def _cmd_ls(a) -> int:
    d = _open_directory(a)
    try:
        lines = ls(d, a.prefix or "", None if a.limit <= 0 else a.limit)
    except KeyError as exc:
        print(f"stoker ls: {exc.args[0]}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def _cmd_stat(a) -> int:
    d = _open_directory(a)
    if a.json:
        print(json.dumps({"url": a.url, **d.summary()}, indent=2))
    else:
        for line in stat(d, a.url):
            print(line)
    return 0


def add_parsers(sub) -> None:
    """Register ``stoker ls URL [PREFIX]`` and ``stoker stat URL`` on an argparse subparsers object."""
    p = sub.add_parser("ls", help="list the sample directory of a packed dataset under a key prefix")
    p.add_argument("url")
    p.add_argument("prefix", nargs="?", default="", help="directory or key (e.g. n01440764/)")
    p.add_argument("--limit", type=int, default=1000, help="most entries shown (0 = all; default 1000)")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.set_defaults(fn=_cmd_ls)

    p = sub.add_parser("stat", help="summary of a packed dataset: samples, bytes, shards, classes, version")
    p.add_argument("url")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=_cmd_stat)
