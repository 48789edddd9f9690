"""The sample directory: one Parquet index per packed dataset, opened into columnar arrays.

Schema (one row per sample, 64-bit offsets throughout; DLFS keeps the same facts
in memory so that a sample costs one ranged read):

=========== ============================ ==========================================
column      type                         meaning
=========== ============================ ==========================================
sample_id   int64                        0..N-1, the id the loader's permutations use
key         string                       sample key (ImageFolder: ``class/stem``)
label       int64                        class index (-1: unlabelled)
class_name  dictionary<string>           class name ("" when unlabelled)
shard       int32                        index into the shard table (file metadata)
offset      int64                        primary payload byte offset inside the shard
length      int64                        primary payload length in bytes
checksum    uint64                       xxh3-64 of the primary payload
field       dictionary<string>           primary payload's field name (``jpg``, ``png``,
                                         ``JPEG``, ``ten``): its tar member is ``<key>.<field>``
fields      list<struct<name string,     the sample's other members (WebDataset fields such
            offset int64, length int64,  as ``cls``, ``json``), each byte-exact with its own
            checksum uint64>>            xxh3-64; null when the sample has only its primary
=========== ============================ ==========================================

A sample's members lie contiguously in its shard, primary first: its bytes are
the one range ``[offset, span_end)`` where ``span_end`` is the end of its last
member. Format 1 indexes (no ``field``/``fields`` columns) are still read.

The Parquet file's key-value metadata ``stoker`` holds JSON: format version,
the shard table (name, bytes, samples), the class names and the content
``version`` (xxh3-128 over the index content), which keys every cache entry.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field as dc_field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from ..errors import IndexFormatError  # noqa: F401 - re-exported
from .arrownp import from_strings, to_numpy

IndexError_ = IndexFormatError  # the old name, kept importable

INDEX_NAME = "index.parquet"
SHARD_DIR = "shards"
FORMAT_VERSION = 2
#: Index formats this code reads (1: no named fields).
READABLE_FORMATS = (1, 2)

MEMBER_TYPE = pa.struct(
    [("name", pa.string()), ("offset", pa.int64()), ("length", pa.int64()), ("checksum", pa.uint64())]
)

SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("key", pa.string()),
        ("label", pa.int64()),
        ("class_name", pa.dictionary(pa.int32(), pa.string())),
        ("shard", pa.int32()),
        ("offset", pa.int64()),
        ("length", pa.int64()),
        ("checksum", pa.uint64()),
        ("field", pa.dictionary(pa.int32(), pa.string())),
        ("fields", pa.list_(MEMBER_TYPE)),
    ]
)


@dataclass
class Members:
    """The named fields of all samples, flattened (no Python object per sample).

    Sample ``i``'s fields are rows ``start[i]:start[i+1]``. Shapes: ``start`` int64
    (N+1,); ``name`` int32 (M,) codes into :attr:`DatasetIndex.names`; ``offset``,
    ``length`` int64 (M,) bytes in the sample's shard; ``checksum`` uint64 (M,) xxh3-64.
    """

    start: np.ndarray
    name: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray


@dataclass
class DatasetIndex:
    """In-memory sample directory of one packed dataset.

    Arrays have shape (N,): ``labels`` int64, ``shard`` int32, ``offset`` int64 (bytes),
    ``length`` int64 (bytes), ``checksum`` uint64 (xxh3-64); an index read from a dataset
    (:func:`read_index`) holds ``shard``, ``offset``, ``length``, ``span_end``, ``field`` and
    ``members`` at their smallest signed dtypes (:func:`compact`): cast before arithmetic that
    may pass the dataset's largest shard offset. ``keys`` is a pyarrow
    string array (compact: one buffer of UTF-8 bytes plus int32 offsets).
    ``shards`` is a list of dicts {name, bytes, samples}; ``classes`` the class names
    in label order; ``version`` the content version (hex str).
    ``field`` int32 (N,) codes into ``names`` for the primary payload's field name
    (None for a format 1 index, whose field names were not recorded); ``members`` the
    other named fields (None when no sample has any). ``span_end`` int64 (N,): end of
    each sample's last member (``offset + length`` when it has no fields).
    """

    keys: pa.Array
    labels: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray
    shards: list[dict[str, Any]]
    classes: list[str]
    version: str
    field: np.ndarray | None = None
    names: list[str] = dc_field(default_factory=list)
    members: Members | None = None
    span_end: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.span_end is None:
            self.span_end = _span_end(self.offset, self.length, self.members)

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, i: int) -> str:
        """Sample key ``i`` (str), decoded from a view of the string array's buffers (about 1 us;
        a pyarrow scalar costs about 10x that on the decode hot path)."""
        kb = self.__dict__.get("_key_buffers")
        if kb is None:
            kb = self.__dict__["_key_buffers"] = _string_buffers(self.keys)
        if kb is False:
            return str(self.keys[int(i)].as_py())
        offsets, data = kb
        i = int(i)
        return str(data[int(offsets[i]) : int(offsets[i + 1])], "utf-8")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_key_buffers", None)  # derived from keys; rebuilt on first use
        return state

    @property
    def total_bytes(self) -> int:
        """Payload bytes of all samples (primary payloads plus named fields)."""
        extra = int(self.members.length.sum()) if self.members is not None else 0
        return int(self.length.sum()) + extra

    def shard_name(self, shard: int) -> str:
        return str(self.shards[int(shard)]["name"])

    def field_name(self, i: int) -> str:
        """The primary payload's field name of sample ``i`` ("" for a format 1 index)."""
        return "" if self.field is None else self.names[int(self.field[int(i)])]

    def member_table(self, i: int) -> list[tuple[str, int, int, int]]:
        """All members of sample ``i``, primary first: ``[(name, offset, length, checksum)]``."""
        i = int(i)
        out = [(self.field_name(i), int(self.offset[i]), int(self.length[i]), int(self.checksum[i]))]
        m = self.members
        if m is not None:
            for j in range(int(m.start[i]), int(m.start[i + 1])):
                out.append((self.names[int(m.name[j])], int(m.offset[j]), int(m.length[j]), int(m.checksum[j])))
        return out


def index_array_bytes(idx: DatasetIndex) -> int:
    """Bytes of ``idx``'s numpy columns (keys not counted): ``labels``, ``shard``, ``offset``,
    ``length``, ``checksum``, ``span_end``, ``field`` and the named fields' arrays."""
    arrays = [idx.labels, idx.shard, idx.offset, idx.length, idx.checksum, idx.span_end, idx.field]
    if idx.members is not None:
        m = idx.members
        arrays += [m.start, m.name, m.offset, m.length, m.checksum]
    return int(sum(a.nbytes for a in arrays if a is not None))


def _span_end(offset: np.ndarray, length: np.ndarray, members: Members | None) -> np.ndarray:
    end: np.ndarray = offset.astype(np.int64) + length
    if members is not None and len(members.offset):
        owner = np.repeat(np.arange(len(offset)), np.diff(members.start))
        np.maximum.at(end, owner, members.offset + members.length)
    return end


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, memoryview] | Literal[False]:
    """``(offsets int32 or int64 (N+1,), data)`` of a string array, views of its own buffers (no
    copy: a forked worker shares their pages), or False for other layouts."""
    otype: type[np.signedinteger[Any]]
    if arr.type == pa.string():
        otype = np.int32
    elif arr.type == pa.large_string():
        otype = np.int64
    else:
        return False
    _validity, obuf, dbuf = arr.buffers()
    offsets = np.frombuffer(obuf, otype)[arr.offset : arr.offset + len(arr) + 1]
    return offsets, (memoryview(dbuf) if dbuf is not None else memoryview(b""))


def content_version(
    keys: pa.Array,
    labels: Any,
    shard: Any,
    offset: Any,
    length: Any,
    checksum: Any,
    shards: list[dict[str, Any]],
    extra: tuple[bytes, ...] = (),
) -> str:
    """xxh3-128 hex digest over the index content (keys, columns, shard table, ``extra`` bytes)."""
    h = xxhash.xxh3_128()
    keys = keys.cast(pa.string()) if keys.type != pa.string() else keys
    for buf in keys.buffers():
        if buf is not None:
            h.update(memoryview(buf))
    for arr, dt in (
        (labels, np.int64),
        (shard, np.int32),
        (offset, np.int64),
        (length, np.int64),
        (checksum, np.uint64),
    ):
        h.update(np.ascontiguousarray(arr, dtype=dt).tobytes())
    for chunk in extra:
        h.update(chunk)
    h.update(json.dumps([[s["name"], int(s["bytes"])] for s in shards]).encode())
    return h.hexdigest()


def build_table(
    keys: list[str],
    labels: Any,
    class_names: list[str],
    shard: Any,
    offset: Any,
    length: Any,
    checksum: Any,
    shards: list[dict[str, Any]],
    classes: list[str],
    field: list[str] | None = None,
    fields: list[Any] | None = None,
) -> tuple[pa.Table, str]:
    """Assemble the index table and its metadata. Returns (table, version).

    ``field``: primary field name per sample (default ""); ``fields``: per sample
    None or a list of ``(name, offset, length, checksum)`` for its other members,
    each at a shard offset after the primary payload.
    """
    n = len(keys)
    field_arr = pa.array(list(field) if field is not None else [""] * n, type=pa.string())
    rows = list(fields) if fields is not None else [None] * n
    fields_arr = pa.array(
        [None if not r else [{"name": a, "offset": b, "length": c, "checksum": d} for a, b, c, d in r] for r in rows],
        type=pa.list_(MEMBER_TYPE),
    )
    return assemble_table(
        pa.array(keys, type=pa.string()),
        labels,
        pa.array(class_names, type=pa.string()),
        shard,
        offset,
        length,
        checksum,
        shards,
        classes,
        field_arr,
        fields_arr,
    )


def assemble_table(
    key_arr: pa.Array,
    labels: Any,
    class_names: pa.Array,
    shard: Any,
    offset: Any,
    length: Any,
    checksum: Any,
    shards: list[dict[str, Any]],
    classes: list[str],
    field_arr: pa.Array,
    fields_arr: pa.Array,
) -> tuple[pa.Table, str]:
    """:func:`build_table` from columns: Arrow arrays of keys, class names (str), primary field
    names (str) and other members (``list<MEMBER_TYPE>``, null where none), array-likes of the
    rest. Returns (table, version)."""
    n = len(key_arr)
    labels = np.asarray(labels, dtype=np.int64)
    shard = np.asarray(shard, dtype=np.int32)
    offset = np.asarray(offset, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    checksum = np.asarray(checksum, dtype=np.uint64)
    version = content_version(
        key_arr, labels, shard, offset, length, checksum, shards, tuple(_fields_digest_chunks(field_arr, fields_arr))
    )
    meta = {"format": FORMAT_VERSION, "version": version, "shards": shards, "classes": classes}
    table = pa.table(
        {
            "sample_id": pa.array(np.arange(n, dtype=np.int64)),
            "key": key_arr,
            "label": pa.array(labels),
            "class_name": class_names.dictionary_encode(),
            "shard": pa.array(shard),
            "offset": pa.array(offset),
            "length": pa.array(length),
            "checksum": pa.array(checksum),
            "field": field_arr.dictionary_encode(),
            "fields": fields_arr,
        },
        schema=SCHEMA.with_metadata({"stoker": json.dumps(meta)}),
    )
    return table, version


def _fields_digest_chunks(field_arr: pa.Array, fields_arr: pa.Array) -> Iterator[bytes]:
    """Deterministic byte chunks over the ``field`` and ``fields`` columns (for the content version)."""

    def strings(arr: Any) -> Iterator[bytes]:
        arr = pc.fill_null(arr.cast(pa.string()), "")
        if not len(arr):
            return
        offs = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
        yield (offs - offs[0]).tobytes()
        yield bytes(memoryview(arr.buffers()[2] or b"")[offs[0] : offs[-1]])

    yield from strings(field_arr)
    counts = to_numpy(pc.list_value_length(fields_arr), null=0)
    yield np.asarray(counts, dtype=np.int64).tobytes()
    flat = fields_arr.flatten()
    if len(flat):
        yield from strings(flat.field("name"))
        for name, dt in (("offset", np.int64), ("length", np.int64), ("checksum", np.uint64)):
            yield np.asarray(to_numpy(flat.field(name)), dtype=dt).tobytes()


def table_to_bytes(table: pa.Table) -> bytes:
    """The index file's bytes: zstd-compressed Parquet, row groups of :data:`INDEX_ROWS_PER_GROUP`,
    dictionary pages only for the dictionary columns (a dictionary of unique keys and checksums
    costs the writer memory and the file nothing)."""
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        row_group_size=INDEX_ROWS_PER_GROUP,
        use_dictionary=[c for c in ("class_name", "field") if c in table.column_names],
    )
    return sink.getvalue()


def _read_fields(table: pa.Table, n: int) -> tuple[np.ndarray, list[str], Members | None]:
    """Decode the ``field``/``fields`` columns into codes, a name table and flat :class:`Members`."""
    prim = pc.cast(table.column("field"), pa.string()).combine_chunks().dictionary_encode()
    names = [str(s) for s in prim.dictionary.to_pylist()]
    codes = to_numpy(prim.indices).astype(np.int32, copy=False)
    col = table.column("fields").combine_chunks()
    counts = to_numpy(pc.list_value_length(col), null=0).astype(np.int64)
    if not counts.sum():
        return codes, names, None
    flat = col.flatten()
    fnames = flat.field("name")
    lookup = {s: i for i, s in enumerate(names)}
    for s in pc.unique(fnames).to_pylist():
        if s not in lookup:
            lookup[s] = len(names)
            names.append(s)
    name_codes = pc.index_in(fnames, value_set=from_strings(names))
    members = Members(
        start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        name=to_numpy(name_codes).astype(np.int32),
        offset=to_numpy(flat.field("offset")).astype(np.int64, copy=False),
        length=to_numpy(flat.field("length")).astype(np.int64, copy=False),
        checksum=to_numpy(flat.field("checksum")).astype(np.uint64, copy=False),
    )
    return codes, names, members


def read_index(data: bytes, url: str = "<index>") -> DatasetIndex:
    """Parse index bytes into a :class:`DatasetIndex`. Raises :class:`IndexFormatError` naming ``url``.

    Reads format 2 (named fields) and format 1 (primary payload only) indexes. The integer columns
    are held at their smallest signed dtype (:func:`narrow`), keys as one string array (a buffer
    of UTF-8 bytes plus int32 offsets): with ImageNet-length keys about 60 B per sample.
    """
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        meta = json.loads(pf.schema_arrow.metadata[b"stoker"])
    except Exception as exc:  # noqa: BLE001
        raise IndexFormatError(f"{url}: not a stoker index ({type(exc).__name__}: {exc})") from exc
    if meta.get("format") not in READABLE_FORMATS:
        raise IndexFormatError(
            f"{url}: unsupported index format {meta.get('format')!r} (this stoker reads formats {READABLE_FORMATS})"
        )
    with system_pool():
        idx = _decode(pf, meta, url)
    release_memory()
    return idx


def release_memory() -> None:
    """Hand freed heap memory back to the system (Arrow's pools; glibc: ``malloc_trim(0)``), so
    that the decode scratch of an index does not stay resident beside it: glibc raises its mmap
    threshold after a large free, and later large temporaries then stay on the heap (the same
    call as Dask's "trim memory" recipe, https://distributed.dask.org/en/stable/worker-memory.html).
    Nothing happens where the C library has no ``malloc_trim``."""
    pa.default_memory_pool().release_unused()
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None  # libc's malloc_trim once looked up; False where there is none


def _decode(pf: pq.ParquetFile, meta: dict[str, Any], url: str) -> DatasetIndex:
    """The body of :func:`read_index` once the metadata is checked: columns in, validated, compacted."""
    try:
        cols = _read_columns(pf, meta["format"] >= 2)
    except Exception as exc:  # noqa: BLE001
        raise IndexFormatError(f"{url}: not a stoker index ({type(exc).__name__}: {exc})") from exc
    if not np.array_equal(cols["sample_id"], np.arange(len(cols["sample_id"]))):
        raise IndexFormatError(f"{url}: sample_id column is not 0..N-1")
    names: list[str] = []
    field, members = None, None
    if meta["format"] >= 2:
        try:
            field, names, members = _read_fields(cols["named"], len(cols["sample_id"]))
        except (KeyError, pa.ArrowException) as exc:
            raise IndexFormatError(f"{url}: bad field/fields columns ({exc})") from exc
    idx = DatasetIndex(
        keys=cols["key"],
        labels=cols["label"],
        shard=cols["shard"],
        offset=cols["offset"],
        length=cols["length"],
        checksum=cols["checksum"].astype(np.uint64, copy=False),
        shards=meta["shards"],
        classes=meta["classes"],
        version=meta["version"],
        field=field,
        names=names,
        members=members,
    )
    validate(idx, url)
    del cols
    compact(idx)
    return idx


#: Rows per row group of a written index, and per batch of a read one: reading one row group at a
#: time keeps the decode scratch (which the allocator keeps after) to a few MB at any size.
INDEX_ROWS_PER_GROUP = 1 << 16


@contextlib.contextmanager
def system_pool() -> Iterator[None]:
    """Arrow allocates from the C allocator inside the block: its large blocks go back to the
    system when freed, where mimalloc, Arrow's default, keeps the decode scratch of an index
    resident (about 50 B per sample measured)."""
    before = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(before)


def _read_columns(pf: pq.ParquetFile, named: bool) -> dict[str, Any]:
    """The index's columns, read a batch of rows at a time: numpy arrays (int64; ``checksum``
    uint64) and ``key`` one string array; ``named``: also the ``field``/``fields`` columns as a
    table (``"named"``) for :func:`_read_fields`."""
    ints = ("sample_id", "label", "shard", "offset", "length", "checksum")
    wanted = ["key", *ints] + (["field", "fields"] if named else [])
    parts: dict[str, list[Any]] = {c: [] for c in wanted}
    for batch in pf.iter_batches(batch_size=INDEX_ROWS_PER_GROUP, columns=wanted, use_threads=False):
        for c in wanted:
            col = batch.column(c)
            parts[c].append(to_numpy(col).astype(np.int64, copy=False) if c in ints and c != "checksum" else col)
        del batch
    out: dict[str, Any] = {
        c: np.concatenate(parts.pop(c)) if parts[c] else np.zeros(0, np.int64) for c in ints if c != "checksum"
    }
    ck = parts.pop("checksum")
    out["checksum"] = np.concatenate([to_numpy(c) for c in ck]) if ck else np.zeros(0, np.uint64)
    keys = parts.pop("key")
    out["key"] = pa.chunked_array(keys, type=pf.schema_arrow.field("key").type).combine_chunks()
    if named:
        out["named"] = pa.table(
            {c: pa.chunked_array(parts.pop(c), type=pf.schema_arrow.field(c).type) for c in ("field", "fields")}
        )
    return out


def narrow(arr: np.ndarray, top: int | None = None) -> np.ndarray:
    """``arr`` (integers) as the smallest signed dtype that holds its values and ``top`` (the
    largest value arithmetic on it may reach; default its maximum): int8, int16, int32 or int64.
    Signed only, so that arithmetic with int64 never turns into float64."""
    if not len(arr):
        return arr
    lo, hi = int(arr.min()), int(arr.max() if top is None else max(int(arr.max()), top))
    for dt in (np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return arr.astype(dt, copy=False)
    return arr.astype(np.int64, copy=False)


def compact(idx: DatasetIndex) -> None:
    """Hold ``idx``'s integer columns at their smallest dtypes, in place (:func:`narrow`): the
    offsets by the end of the furthest sample, so ``offset + length`` never overflows; shard and
    field codes by the table sizes; ``labels`` stay int64 (``Dataset.labels`` is int64)."""
    assert idx.span_end is not None  # set by __post_init__
    top = int(idx.span_end.max()) if len(idx) else 0
    idx.offset, idx.span_end = narrow(idx.offset, top), narrow(idx.span_end, top)
    idx.length, idx.shard = narrow(idx.length, top), narrow(idx.shard, len(idx.shards))
    if idx.field is not None:
        idx.field = narrow(idx.field, len(idx.names))
    m = idx.members
    if m is not None:
        m.start, m.name = narrow(m.start), narrow(m.name, len(idx.names))
        m.offset, m.length = narrow(m.offset, top), narrow(m.length, top)


def validate(idx: DatasetIndex, url: str = "<index>") -> None:
    """Check shard ids and that every member lies inside its shard, after its primary payload.

    Raises :class:`IndexFormatError` naming the first bad sample.
    """
    if not len(idx):
        return
    if idx.shard.min() < 0 or idx.shard.max() >= len(idx.shards):
        raise IndexFormatError(f"{url}: shard column refers to a shard outside the shard table")
    sizes = np.array([s["bytes"] for s in idx.shards], dtype=np.int64)
    bad = (idx.offset < 0) | (idx.length < 0) | (idx.span_end > sizes[idx.shard])
    m = idx.members
    if m is not None and len(m.offset):
        owner = np.repeat(np.arange(len(idx)), np.diff(m.start))
        mbad = (m.offset < idx.offset[owner] + idx.length[owner]) | (m.length < 0)
        bad[owner[mbad]] = True
    if np.any(bad):
        i = int(np.argmax(bad))
        raise IndexFormatError(
            f"{url}: sample {idx.key(i)!r} extends past the end of shard "
            f"{idx.shard_name(idx.shard[i])!r} or its members are out of order"
        )
