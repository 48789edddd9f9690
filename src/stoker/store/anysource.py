"""Pack sources for samples of any kind: a tree of files, or a Parquet table of sample bytes.

* ``files`` (:func:`iter_files`): every file under SRC (recursively; names starting with "." and
  OS metadata skipped). Files are grouped into samples by their path up to the first "." of the
  file name, the WebDataset convention: ``clips/utt1.flac`` + ``clips/utt1.txt`` is one sample
  with key ``clips/utt1`` and fields ``flac`` and ``txt``. An image field, else the largest
  member, is the primary payload. Labels are optional, as in WebDataset: the integer (or
  class name) in a ``cls`` member, else ``label``/``cls`` of a ``json`` member, else none (-1).
* ``parquet`` (:func:`iter_parquet`): a Parquet file, or a directory of them (sorted by name),
  whose ``column`` holds each row's sample bytes: a binary column, or Hugging Face's image/audio
  struct ``{bytes, path}`` (what ``datasets`` writes for its ``Image()`` and ``Audio()`` features).
  That member's field is the extension of the struct's ``path`` (``wav``, ``jpg``), else the
  column's name. Every other column is kept as a field too: binary values as they are, strings
  as UTF-8, anything else as JSON. The key is ``<file stem>/<row number, 8 digits>`` (or the
  ``key_column``'s value); the label is the ``label`` column's value when there is one (an int
  or a class name; a Hugging Face ``ClassLabel`` is an int).

Both keep every member byte-exact and feed the streamed pack (:func:`stoker.store.pack.pack`):
the same shards for the same input, atomic shards and index, resumable.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator

import pyarrow.parquet as pq

from ..errors import SourceError, SourceNotFoundError
from ..storage import Origin
from .sources import StreamSample, check_utf8, is_ignored_name, ordered_map
from .wds import finish_sample

__all__ = ["list_file_samples", "iter_files", "iter_parquet"]


def list_file_samples(origin: Origin) -> list[tuple[str, list[tuple[str, str]]]]:
    """The samples of the file tree at ``origin``: ``[(key, [(field, relative path)])]`` in key
    order, fields in name order.

    Raises:
        FileNotFoundError: the tree does not exist or holds no file.
        ValueError: a name is not UTF-8, or two files give the same key and field (``a.x`` and
            ``a.x`` in two spellings cannot happen; ``a.tar.gz`` and ``a.tar.gz`` can't either, but
            a file without extension next to a directory of the same name can), naming both.
    """
    fs, root = origin.fs, origin.root.rstrip("/")
    if not fs.exists(root):
        raise SourceNotFoundError(f"source {origin.url}: not found")
    groups: dict[str, dict[str, str]] = {}
    for path in sorted(fs.find(root)):
        rel = path[len(root) :].lstrip("/") if path.startswith(root) else posixpath.basename(path)
        if any(is_ignored_name(part) for part in rel.split("/")):
            continue
        check_utf8(rel, f"source {origin.url}")
        folder, name = posixpath.split(rel)
        stem, dot, field = name.partition(".")
        if not stem:
            continue
        key = posixpath.join(folder, stem) if folder else stem
        field = field if dot else "bin"
        members = groups.setdefault(key, {})
        if field in members:
            raise SourceError(
                f"source {origin.url}: {members[field]!r} and {rel!r} are both field {field!r} of sample {key!r}"
            )
        members[field] = rel
    if not groups:
        raise SourceNotFoundError(f"source {origin.url}: no files")
    return [(k, sorted(groups[k].items())) for k in sorted(groups)]


def iter_files(origin: Origin, order, listing, workers: int = 16) -> Iterator[StreamSample]:
    """Read the samples of ``listing`` (from :func:`list_file_samples`) in ``order`` (indices),
    ``workers`` samples at a time; yields :class:`StreamSample` in that order.

    Raises FileNotFoundError naming the file when one vanished, :class:`stoker.storage.OriginError`
    after retries."""

    def read(i: int) -> StreamSample:
        key, files = listing[i]
        members = []
        for field, rel in files:
            try:
                members.append((field, origin.read(rel)))
            except FileNotFoundError:
                raise SourceNotFoundError(f"source {origin.url}: {rel} (sample {key!r}) vanished") from None
        big = max(range(len(members)), key=lambda j: len(members[j][1]))  # the payload, not its .txt
        members = [members[big]] + members[:big] + members[big + 1 :]
        return finish_sample(key, members, origin.full_url(files[0][1]))

    yield from ordered_map(read, (int(r) for r in order), workers)


def _parquet_files(origin: Origin) -> list[str]:
    fs, root = origin.fs, origin.root.rstrip("/")
    if fs.isdir(root):
        files = sorted(
            p
            for p in fs.find(root)
            if p.lower().endswith((".parquet", ".pq"))
            and not any(is_ignored_name(x) for x in p[len(root) :].split("/") if x)
        )
        if not files:
            raise SourceNotFoundError(f"source {origin.url}: no .parquet files")
        return files
    if not fs.exists(root):
        raise SourceNotFoundError(f"source {origin.url}: not found")
    return [root]


def _as_bytes(value) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, default=str).encode("utf-8")


def iter_parquet(
    origin: Origin, column: str, key_column: str | None = None, label_column: str = "label"
) -> Iterator[StreamSample]:
    """The rows of the Parquet file(s) at ``origin`` as samples (see the module docstring), in
    file and row order, read one row group at a time.

    Raises:
        ValueError: ``column`` (or ``key_column``) is not a column of a file (names the file and
            its columns); a value of ``column`` is neither bytes nor a ``{bytes, path}`` struct, or
            its struct holds no bytes (only a path), naming the file, row and key.
        FileNotFoundError: no Parquet file at ``origin``.
    """
    fs = origin.fs
    for path in _parquet_files(origin):
        where = f"{fs.unstrip_protocol(path)}" if hasattr(fs, "unstrip_protocol") else path
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            for want, what in ((column, "--column"), (key_column, "key column")):
                if want is not None and want not in names:
                    raise SourceError(f"source {where}: no column {want!r} ({what}); its columns are {names}")
            stem = posixpath.splitext(posixpath.basename(path))[0]
            row = 0
            for g in range(pf.num_row_groups):
                for rec in pf.read_row_group(g).to_pylist():
                    key = check_utf8(
                        str(rec[key_column]) if key_column else f"{stem}/{row:08d}", f"source {where} row {row}"
                    )
                    yield _row_sample(rec, column, key, label_column, f"{where} row {row}")
                    row += 1


def _row_sample(rec: dict, column: str, key: str, label_column: str, where: str) -> StreamSample:
    value, field = rec[column], column
    if isinstance(value, dict):
        if "bytes" not in value:
            raise SourceError(
                f"source {where} (sample {key!r}): column {column!r} is a struct without 'bytes' "
                f"(fields {sorted(value)}); expected binary or {{bytes, path}}"
            )
        data, name = value["bytes"], value.get("path")
        if data is None:
            raise SourceError(
                f"source {where} (sample {key!r}): column {column!r} holds no bytes, only the path "
                f"{name!r} (a dataset saved with external files; embed them first)"
            )
        ext = posixpath.splitext(name)[1][1:].lower() if isinstance(name, str) else ""
        field = ext or column
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = value
    else:
        raise SourceError(
            f"source {where} (sample {key!r}): column {column!r} holds {type(value).__name__}, "
            "not bytes or a {bytes, path} struct"
        )
    members = [(field, bytes(data))]
    for name, v in rec.items():
        if name == column:
            continue
        if name == field:
            raise SourceError(
                f"source {where} (sample {key!r}): column {name!r} has the name of the field of "
                f"column {column!r}; rename one of them"
            )
        members.append((name, _as_bytes(v)))
    label = rec.get(label_column)
    label = label if isinstance(label, (int, str)) and not isinstance(label, bool) else None
    return StreamSample(key=key, label=label, members=members, where=where)
