"""The index of the samples a writer wrote, built and written one row group at a time.

:func:`index_bytes` turns :class:`.rows.Rows` (the samples in the order written) into the bytes
of the index file (:mod:`.index`'s schema; sample ids in sorted key order) without ever holding
the index as one table. What it holds for the whole dataset is the sort order (8 bytes per
sample), the offsets of each sample's members (8 B), the labels (8 B) and two dictionary codes
(4 B each), beside the rows themselves; each row group of :data:`.index.INDEX_ROWS_PER_GROUP`
rows is gathered from them, written and dropped. A pack's peak memory at this step is then set
by the rows it already holds, not by a second, sorted copy of them (with the Parquet writer's
buffers on top), which is what a whole table cost (+150 MB at a million samples).

The content version is hashed over exactly the bytes, in exactly the order, that
:func:`.index.content_version` hashes over a whole table, one pass over the row groups per
column, and the Parquet writer sees the same row groups, dictionaries and metadata: the file is
byte for byte the one :func:`.index.build_table` and :func:`.index.table_to_bytes` give.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from ..errors import SourceError
from .arrownp import from_bools, from_numpy, from_strings, to_numpy
from .index import (
    FORMAT_VERSION,
    INDEX_ROWS_PER_GROUP,
    MEMBER_TYPE,
    SCHEMA,
    assemble_table,
    release_memory,
    system_pool,
    table_to_bytes,
)
from .rows import Rows

__all__ = ["index_bytes"]

#: The Parquet columns written with a dictionary page (as :func:`.index.table_to_bytes`).
_DICTIONARY_COLUMNS = ["class_name", "field"]


def index_bytes(
    url: str, rows: Rows, labels, class_names, class_list: list[str], shard_table: list[dict]
) -> tuple[memoryview, str]:
    """(the index file's bytes, its content version) for ``rows``.

    ``labels`` (ints) and ``class_names`` (str) are parallel to ``rows`` (sequences or arrays);
    ``shard_table`` the shards' entries (name, bytes, samples, optional etag) in shard-number
    order; ``class_list`` the class names by label. ``url`` names the dataset in errors.

    Raises :class:`stoker.SourceError` (a ValueError) for a key written twice, naming it and its
    two shards, before anything is built.
    """
    if not len(rows):  # nothing to stream: the whole-table path, trivially small
        table, version = _empty_table(shard_table, class_list)
        return memoryview(table_to_bytes(table)), version
    release_memory()  # what the shards' writing left in the allocators goes back first
    with system_pool():  # the sort's and each row group's scratch go back to the system when freed
        return _write(url, rows, labels, class_names, class_list, shard_table)


def _write(url: str, rows: Rows, labels, class_names, class_list: list[str], shard_table: list[dict]) -> tuple:
    s = _Sorted(rows, labels, class_names)
    s.check_unique(url, shard_table)
    version = _version(s, shard_table)
    meta = {"format": FORMAT_VERSION, "version": version, "shards": shard_table, "classes": class_list}
    sink = pa.BufferOutputStream()  # its buffer is the result, not copied (BytesIO.getvalue copies)
    schema = SCHEMA.with_metadata({"stoker": json.dumps(meta)})
    with pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS) as writer:
        for a, b in s.groups():
            writer.write_table(s.table(a, b), row_group_size=INDEX_ROWS_PER_GROUP)
            release_memory()  # the row group's scratch, freed, goes back (glibc kept it: +20 MB per million)
    return memoryview(sink.getvalue()), version


def _empty_table(shard_table: list[dict], class_list: list[str]) -> tuple[pa.Table, str]:
    empty = pa.array([], pa.string())
    ints = np.zeros(0, np.int64)
    return assemble_table(
        empty, ints, empty, ints, ints, ints, ints, shard_table, class_list, empty, pa.nulls(0, pa.list_(MEMBER_TYPE))
    )


def _first_seen(groups: Iterator[tuple[int, int]], codes: Callable, values: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(a table from code to code renumbered in order of first appearance, the dictionary in that
    order): what ``dictionary_encode`` of the strings ``values.take(codes(a, b))``, over every
    ``(a, b)`` of ``groups`` in turn, gives, one row group at a time."""
    seen = np.zeros(len(values), bool)
    first: list[int] = []
    for a, b in groups:
        uniq, at = np.unique(codes(a, b), return_index=True)
        new = ~seen[uniq]
        first.extend(uniq[new][np.argsort(at[new], kind="stable")].tolist())
        seen[uniq] = True
        if len(first) == len(values):
            break
    remap = np.zeros(max(len(values), 1), np.int32)
    remap[first] = np.arange(len(first), dtype=np.int32)
    return remap, values.take(from_numpy(np.array(first, np.int64)))


def _view(arr, dtype) -> np.ndarray:
    """A numpy view of one of :class:`.rows.Rows`' ``array`` columns (empty: a new empty array)."""
    return np.frombuffer(arr, dtype) if len(arr) else np.zeros(0, dtype)


class _Sorted:
    """``rows`` in sorted key order, gathered a row group at a time (``a``, ``b``: sorted
    positions). Holds the order, the labels and the class names' codes (rows order) beside views
    of the rows' columns; everything else per row is gathered on demand."""

    def __init__(self, rows: Rows, labels, class_names) -> None:
        self.rows = rows
        self.keys = rows.keys_array()
        self.key_offsets = np.frombuffer(self.keys.buffers()[1], np.int32)
        # from the C allocator, so that the sort's scratch goes back to the system once freed
        order = pc.sort_indices(self.keys, memory_pool=pa.system_memory_pool())
        # int32 where it fits: 4 bytes per sample held through every pass, not 8
        self.order: np.ndarray = to_numpy(order).astype(np.int32 if len(rows) < 2**31 else np.int64)
        del order
        self.member_end = _view(rows.member_end, np.int64)
        self.cols = {"shard": _view(rows.shard, np.int32), "name": _view(rows.name, np.int32)}
        for name, dt in (("offset", np.int64), ("length", np.int64), ("checksum", np.uint64)):
            self.cols[name] = _view(getattr(rows, name), dt)
        self.labels = labels  # a list is read a row group at a time (an int64 copy of N: +8 MB per million)
        lookup: dict[str, int] = {}  # class name -> code, rows order (no string of N built)
        self.class_rows = np.fromiter((lookup.setdefault(c, len(lookup)) for c in class_names), np.int32, len(rows))
        self.class_remap, self.class_dict = _first_seen(
            self.groups(), lambda a, b: self.class_rows[self.order[a:b]], from_strings(list(lookup))
        )
        self.names = from_strings(rows.names)
        self.name_len = np.array([len(n.encode("utf-8")) for n in rows.names] or [0], np.int64)
        self.field_remap, self.field_dict = _first_seen(self.groups(), self.primary_names, self.names)

    def primary_names(self, a: int, b: int) -> np.ndarray:
        """The codes (into ``rows.names``) of the primary fields of sorted rows a..b."""
        return self.cols["name"][self.first(a, b)[0]]

    def key_len(self, a: int, b: int) -> np.ndarray:
        """The UTF-8 lengths of the keys of sorted rows a..b."""
        idx = self.order[a:b]
        return self.key_offsets[idx + 1] - self.key_offsets[idx]

    def groups(self) -> Iterator[tuple[int, int]]:
        n = len(self.order)
        for a in range(0, n, INDEX_ROWS_PER_GROUP):
            yield a, min(a + INDEX_ROWS_PER_GROUP, n)

    def check_unique(self, url: str, shard_table: list[dict]) -> None:
        """SourceError naming the first key (in sorted order) that two samples share, and their shards."""
        last = None
        for a, b in self.groups():
            keys = self.key_chunk(a, b)
            if last is not None and keys[0].as_py() == last:
                self._duplicate(url, shard_table, a - 1)
            if len(keys) > 1:
                same = pc.equal(keys.slice(0, len(keys) - 1), keys.slice(1))
                if same.true_count:
                    self._duplicate(url, shard_table, a + int(pc.index(same, True).as_py()))
            last = keys[len(keys) - 1].as_py()

    def _duplicate(self, url: str, shard_table: list[dict], j: int) -> None:
        a, b = (shard_table[self.rows.shard[int(self.order[x])]]["name"] for x in (j, j + 1))
        key = self.rows[int(self.order[j])]
        raise SourceError(f"{url}: duplicate key {key!r} (in {a} and {b}): every sample needs its own key")

    def key_chunk(self, a: int, b: int) -> pa.Array:
        return self.keys.take(from_numpy(self.order[a:b]))

    def first(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(each sample's first member row, its count of other members) for sorted rows a..b."""
        idx = self.order[a:b]
        end = self.member_end[idx]
        first = np.where(idx > 0, self.member_end[idx - 1], 0)
        return first, end - first - 1

    def column(self, name: str, a: int, b: int) -> np.ndarray:
        """Sorted rows a..b of ``label``, ``shard``, or the primary's ``offset``/``length``/``checksum``."""
        if name == "label":
            if isinstance(self.labels, np.ndarray):
                return self.labels[self.order[a:b]].astype(np.int64, copy=False)
            return np.fromiter(map(self.labels.__getitem__, self.order[a:b].tolist()), np.int64, b - a)
        if name == "shard":
            return self.cols["shard"][self.order[a:b]]
        return self.cols[name][self.first(a, b)[0]]

    def name_bytes(self, codes: np.ndarray) -> bytes:
        """The UTF-8 bytes of the field names of ``codes`` (codes into ``rows.names``), back to back."""
        return _string_bytes(self.names.take(from_numpy(codes)))

    def picks(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(list offsets (rows + 1,), member rows) of the other members of sorted rows a..b."""
        first, extra = self.first(a, b)
        offsets = np.zeros(len(extra) + 1, dtype=np.int32)
        np.cumsum(extra, out=offsets[1:])
        pick = np.repeat(first + 1 - offsets[:-1], extra) + np.arange(int(offsets[-1]))
        return offsets, pick

    def table(self, a: int, b: int) -> pa.Table:
        """Sorted rows a..b as a table of the index schema (without its metadata)."""
        first, extra = self.first(a, b)
        if extra.any():
            offsets, pick = self.picks(a, b)
            c = self.cols
            members = pa.StructArray.from_arrays(
                [
                    self.names.take(from_numpy(c["name"][pick])),
                    *(from_numpy(c[name][pick]) for name in ("offset", "length", "checksum")),
                ],
                fields=list(MEMBER_TYPE),
            )
            fields = pa.ListArray.from_arrays(from_numpy(offsets), members, mask=from_bools(extra == 0))
        else:
            fields = pa.nulls(b - a, pa.list_(MEMBER_TYPE))
        columns = {
            "sample_id": from_numpy(np.arange(a, b, dtype=np.int64)),
            "key": self.key_chunk(a, b),
            "label": from_numpy(self.column("label", a, b)),
            "class_name": pa.DictionaryArray.from_arrays(
                from_numpy(self.class_remap[self.class_rows[self.order[a:b]]]), self.class_dict
            ),
            "shard": from_numpy(self.column("shard", a, b).astype(np.int32)),
        }
        for name, dt in (("offset", np.int64), ("length", np.int64), ("checksum", np.uint64)):
            columns[name] = from_numpy(self.column(name, a, b).astype(dt, copy=False))
        columns["field"] = pa.DictionaryArray.from_arrays(
            from_numpy(self.field_remap[self.primary_names(a, b)]), self.field_dict
        )
        columns["fields"] = fields
        return pa.table(columns, schema=SCHEMA)


def _string_bytes(arr: pa.Array) -> bytes:
    """The UTF-8 bytes of a string array's values, back to back."""
    offs = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + len(arr) + 1]
    return bytes(memoryview(arr.buffers()[2] or b"")[offs[0] : offs[-1]])


def _strings(s: _Sorted, lengths: Callable, data: Callable) -> Iterator[bytes]:
    """A string column's offsets (int32, from 0) then its bytes, as :func:`.index.content_version`
    hashes an Arrow string array's buffers: ``lengths(a, b)`` and ``data(a, b)`` per row group."""
    base = 0
    yield np.zeros(1, np.int32).tobytes()
    for a, b in s.groups():
        ends = base + np.cumsum(lengths(a, b), dtype=np.int64)
        if len(ends):
            base = int(ends[-1])
        yield ends.astype(np.int32).tobytes()
    for a, b in s.groups():
        yield data(a, b)


def _version_pieces(s: _Sorted, shard_table: list[dict]) -> Iterator[bytes]:
    """The bytes :func:`.index.content_version` hashes, in its order (keys, integer columns, the
    ``field``/``fields`` digest of :func:`.index._fields_digest_chunks`, the shard table)."""
    n = len(s.order)  # the sorted keys' validity bitmap (Arrow's take gives one, all valid)
    yield b"\xff" * (n // 8) + (bytes([(1 << n % 8) - 1]) if n % 8 else b"")
    yield from _strings(s, s.key_len, lambda a, b: _string_bytes(s.key_chunk(a, b)))
    for name, dt in (("label", np.int64), ("shard", np.int32), ("offset", np.int64), ("length", np.int64)):
        yield from (s.column(name, a, b).astype(dt).tobytes() for a, b in s.groups())
    yield from (s.column("checksum", a, b).astype(np.uint64).tobytes() for a, b in s.groups())
    prim = s.cols["name"]

    primary = s.primary_names
    yield from _strings(s, lambda a, b: s.name_len[primary(a, b)], lambda a, b: s.name_bytes(primary(a, b)))
    yield from (s.first(a, b)[1].astype(np.int64).tobytes() for a, b in s.groups())
    if not int(s.member_end[-1]) - len(s.order):  # no sample has a member besides its primary
        yield json.dumps([[x["name"], int(x["bytes"])] for x in shard_table]).encode()
        return

    def member_names(a: int, b: int) -> np.ndarray:
        return prim[s.picks(a, b)[1]]

    yield from _strings(
        s,
        lambda a, b: s.name_len[member_names(a, b)],
        lambda a, b: s.name_bytes(member_names(a, b)),
    )
    for name in ("offset", "length", "checksum"):
        yield from (s.cols[name][s.picks(a, b)[1]].tobytes() for a, b in s.groups())
    yield json.dumps([[x["name"], int(x["bytes"])] for x in shard_table]).encode()


def _version(s: _Sorted, shard_table: list[dict]) -> str:
    """The content version (xxh3-128 hex) of the index of ``s``."""
    h = xxhash.xxh3_128()
    for piece in _version_pieces(s, shard_table):
        h.update(piece)
    return h.hexdigest()
