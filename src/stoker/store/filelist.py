"""File lists as a pack source: a CSV or Parquet table of ``path``, ``label`` (and ``key``).

* ``path`` (required): relative to the list's directory, absolute on the list's
  filesystem (``/data/x.jpg``; for a list at ``s3://b/l.csv`` that is ``s3://data/x.jpg``),
  or a full URL (``s3://...``, ``https://...``).
* ``label`` (optional): int, or class name (see :func:`.sources.resolve_labels`);
  empty / missing -> -1.
* ``key`` (optional): default is the path without its extension (scheme and
  leading ``/`` and ``./`` removed).

Each file is one sample whose primary field is its extension (``jpg``; ``bin``
when it has none), stored as raw bytes. Files are read in parallel in the order
given (or a permutation of it), with a bounded window of reads in flight.
"""

from __future__ import annotations

import io
import posixpath
from typing import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..errors import SourceError, SourceNotFoundError
from ..storage import Origin, join
from .sources import StreamSample, check_utf8, ordered_map


class FileList:
    """A parsed file list: parallel lists ``urls``, ``keys``, ``fields``, ``labels`` (raw)."""

    def __init__(self, urls, keys, fields, labels, where):
        self.urls, self.keys, self.fields, self.labels, self.where = urls, keys, fields, labels, where

    def __len__(self) -> int:
        return len(self.urls)


def _key_of(path: str) -> str:
    p = path.split("://", 1)[1] if "://" in path else path
    p = p.lstrip("/")
    while p.startswith("./"):
        p = p[2:]
    stem, _ = posixpath.splitext(p)
    return stem


def read_file_list(origin: Origin) -> FileList:
    """Read and check the list at ``origin`` (its URL is the list file).

    Raises FileNotFoundError when the list is missing; ValueError when it has no
    ``path`` column, is not valid UTF-8, or two rows share a key.
    """
    data = origin.read("")
    where = origin.url
    try:
        if where.lower().endswith(".csv"):
            table = pacsv.read_csv(
                io.BytesIO(data),
                convert_options=pacsv.ConvertOptions(column_types={"path": pa.string(), "key": pa.string()}),
            )
        else:
            table = pq.read_table(io.BytesIO(data))
    except pa.ArrowInvalid as exc:
        raise SourceError(f"file list {where}: cannot parse ({exc})") from exc
    if "path" not in table.column_names:
        raise SourceError(f"file list {where}: no 'path' column (columns: {table.column_names})")
    paths = [str(p) for p in table.column("path").to_pylist()]
    n = len(paths)
    labels = table.column("label").to_pylist() if "label" in table.column_names else [None] * n
    labels = [None if (v is None or v == "") else v for v in labels]
    keys = table.column("key").to_pylist() if "key" in table.column_names else [None] * n
    base = where.rsplit("/", 1)[0] if "/" in where else "."
    proto = origin.fs.protocol if isinstance(origin.fs.protocol, str) else origin.fs.protocol[0]
    local = proto in ("file", "local")
    urls, out_keys, fields = [], [], []
    seen: dict[str, int] = {}  # key -> row
    for row, (p, k) in enumerate(zip(paths, keys)):
        if "://" in p:
            url = p
        elif p.startswith("/"):
            url = p if local else f"{proto}://{p.lstrip('/')}"
        else:
            url = join(base, p)
        key = check_utf8(str(k) if k else _key_of(p), f"file list {where} row {row}")
        if key in seen:
            raise SourceError(f"file list {where}: duplicate key {key!r} (rows {seen[key]} and {row})")
        seen[key] = row
        ext = posixpath.splitext(p.rsplit("/", 1)[-1])[1]
        urls.append(url)
        out_keys.append(key)
        fields.append(ext[1:] if ext else "bin")
    return FileList(urls, out_keys, fields, labels, where)


def iter_file_list(
    fl: FileList, order, storage_options: dict | None = None, workers: int = 16
) -> Iterator[StreamSample]:
    """Read the files of ``fl`` in ``order`` (row indices), ``workers`` at a time.

    Yields :class:`StreamSample` in ``order``. Raises FileNotFoundError naming the
    list and the file, :class:`stoker.storage.OriginError` after retries.
    """
    origins: dict[str, Origin] = {}

    def read(row: int) -> StreamSample:
        url = fl.urls[row]
        parent, name = url.rsplit("/", 1) if "/" in url else (".", url)
        origin = origins.get(parent)
        if origin is None:
            origin = origins.setdefault(parent, Origin(parent, storage_options or {}))
        try:
            data = origin.read(name)
        except FileNotFoundError:
            raise SourceNotFoundError(f"file list {fl.where}: {url} (key {fl.keys[row]!r}) not found") from None
        return StreamSample(fl.keys[row], fl.labels[row], [(fl.fields[row], data)], url)

    yield from ordered_map(read, (int(r) for r in order), workers)
