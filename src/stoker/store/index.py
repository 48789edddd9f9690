"""The sample directory: one Parquet index per packed dataset, opened into columnar arrays.

Schema (one row per sample, 64-bit offsets throughout; DLFS keeps the same facts
in memory so that a sample costs one ranged read):

=========== ========= ==============================================
column      type      meaning
=========== ========= ==============================================
sample_id   int64     0..N-1, the id the loader's permutations use
key         string    sample key (ImageFolder: ``class/stem``)
label       int64     class index (ImageFolder: sorted class names)
class_name  string    class name (dictionary encoded)
shard       int32     index into the shard table (file metadata)
offset      int64     payload byte offset inside the shard
length      int64     payload length in bytes
checksum    uint64    xxh3-64 of the payload
=========== ========= ==============================================

The Parquet file's key-value metadata ``stoker`` holds JSON: format version,
the shard table (name, bytes, samples), the class names and the content
``version`` (xxh3-128 over the index content), which keys every cache entry.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

INDEX_NAME = "index.parquet"
SHARD_DIR = "shards"
FORMAT_VERSION = 1

SCHEMA = pa.schema([
    ("sample_id", pa.int64()),
    ("key", pa.string()),
    ("label", pa.int64()),
    ("class_name", pa.dictionary(pa.int32(), pa.string())),
    ("shard", pa.int32()),
    ("offset", pa.int64()),
    ("length", pa.int64()),
    ("checksum", pa.uint64()),
])


class IndexError_(ValueError):
    """The index is missing, unreadable or inconsistent (message names the URL)."""


@dataclass
class DatasetIndex:
    """In-memory sample directory of one packed dataset.

    Arrays have shape (N,): ``labels`` int64, ``shard`` int32, ``offset`` int64 (bytes),
    ``length`` int64 (bytes), ``checksum`` uint64 (xxh3-64). ``keys`` is a pyarrow
    string array (compact: one buffer of UTF-8 bytes plus int32 offsets).
    ``shards`` is a list of dicts {name, bytes, samples}; ``classes`` the class names
    in label order; ``version`` the content version (hex str).
    """

    keys: pa.Array
    labels: np.ndarray
    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray
    shards: list
    classes: list
    version: str

    def __len__(self) -> int:
        return len(self.labels)

    def key(self, i: int) -> str:
        return self.keys[int(i)].as_py()

    @property
    def total_bytes(self) -> int:
        """Payload bytes of all samples."""
        return int(self.length.sum())

    def shard_name(self, shard: int) -> str:
        return self.shards[int(shard)]["name"]


def content_version(keys: pa.Array, labels, shard, offset, length, checksum, shards) -> str:
    """xxh3-128 hex digest over the index content (keys, columns and shard table)."""
    h = xxhash.xxh3_128()
    keys = keys.cast(pa.string()) if keys.type != pa.string() else keys
    for buf in keys.buffers():
        if buf is not None:
            h.update(memoryview(buf))
    for arr, dt in ((labels, np.int64), (shard, np.int32), (offset, np.int64),
                    (length, np.int64), (checksum, np.uint64)):
        h.update(np.ascontiguousarray(arr, dtype=dt).tobytes())
    h.update(json.dumps([[s["name"], int(s["bytes"])] for s in shards]).encode())
    return h.hexdigest()


def build_table(keys: list[str], labels, class_names: list[str], shard, offset, length, checksum,
                shards: list, classes: list) -> tuple[pa.Table, str]:
    """Assemble the index table and its metadata. Returns (table, version)."""
    n = len(keys)
    key_arr = pa.array(keys, type=pa.string())
    labels = np.asarray(labels, dtype=np.int64)
    shard = np.asarray(shard, dtype=np.int32)
    offset = np.asarray(offset, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    checksum = np.asarray(checksum, dtype=np.uint64)
    version = content_version(key_arr, labels, shard, offset, length, checksum, shards)
    meta = {"format": FORMAT_VERSION, "version": version, "shards": shards, "classes": classes}
    table = pa.table({
        "sample_id": pa.array(np.arange(n, dtype=np.int64)),
        "key": key_arr,
        "label": pa.array(labels),
        "class_name": pa.array(class_names, type=pa.string()).dictionary_encode(),
        "shard": pa.array(shard),
        "offset": pa.array(offset),
        "length": pa.array(length),
        "checksum": pa.array(checksum),
    }, schema=SCHEMA.with_metadata({"stoker": json.dumps(meta)}))
    return table, version


def table_to_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def read_index(data: bytes, url: str = "<index>") -> DatasetIndex:
    """Parse index bytes into a :class:`DatasetIndex`. Raises :class:`IndexError_` naming ``url``."""
    try:
        table = pq.read_table(io.BytesIO(data))
        meta = json.loads(table.schema.metadata[b"stoker"])
    except Exception as exc:  # noqa: BLE001
        raise IndexError_(f"{url}: not a stoker index ({type(exc).__name__}: {exc})") from exc
    if meta.get("format") != FORMAT_VERSION:
        raise IndexError_(f"{url}: unsupported index format {meta.get('format')!r}")
    ids = table.column("sample_id").to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise IndexError_(f"{url}: sample_id column is not 0..N-1")
    keys = table.column("key").combine_chunks()
    idx = DatasetIndex(
        keys=keys,
        labels=table.column("label").to_numpy().astype(np.int64, copy=False),
        shard=table.column("shard").to_numpy().astype(np.int32, copy=False),
        offset=table.column("offset").to_numpy().astype(np.int64, copy=False),
        length=table.column("length").to_numpy().astype(np.int64, copy=False),
        checksum=table.column("checksum").to_numpy().astype(np.uint64, copy=False),
        shards=meta["shards"], classes=meta["classes"], version=meta["version"],
    )
    if len(idx) and (idx.shard.min() < 0 or idx.shard.max() >= len(idx.shards)):
        raise IndexError_(f"{url}: shard column refers to a shard outside the shard table")
    ends = idx.offset + idx.length
    sizes = np.array([s["bytes"] for s in idx.shards], dtype=np.int64)
    if len(idx) and np.any(ends > sizes[idx.shard]):
        bad = int(np.argmax(ends > sizes[idx.shard]))
        raise IndexError_(f"{url}: sample {idx.key(bad)!r} extends past the end of shard "
                          f"{idx.shard_name(idx.shard[bad])!r}")
    return idx
