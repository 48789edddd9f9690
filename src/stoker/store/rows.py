"""The samples a writer has written so far, held columnar: what the index is built from.

One :class:`Rows` per pack, :class:`stoker.Writer` or merge. A sample costs its key's UTF-8 bytes
plus about 40 bytes with one field (an ``array`` per column, no Python object per sample), where
a tuple of lists per sample cost about 1.5 KiB: the bookkeeping of a pack of a million small
samples fits in tens of MB. The manifest of a shard stores the same columns (:func:`encode`,
:func:`decode`), base64 in JSON.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["Rows", "decode", "encode"]

#: The array typecodes of the member columns (``q`` int64, ``Q`` uint64, ``i`` int32).
_MEMBER_COLUMNS = (("name", "i"), ("offset", "q"), ("length", "q"), ("checksum", "Q"))


class Rows(Sequence):
    """Samples in the order written: key, shard number and members ``(field, offset, length,
    checksum)``, primary first. As a sequence, ``rows[j]`` is sample ``j``'s key (str).

    Columns (``array``): ``shard`` int32 (N,), ``member_end`` int64 (N,) (sample ``j``'s members
    are rows ``member_end[j-1]:member_end[j]`` of the member columns), ``name`` int32 (M,) codes
    into ``names``, ``offset``/``length`` int64 (M,) bytes in the shard, ``checksum`` uint64 (M,).
    """

    def __init__(self) -> None:
        self.key_data = bytearray()
        self.key_end = array("q")
        self.shard = array("i")
        self.member_end = array("q")
        self.names: list[str] = []
        self._codes: dict[str, int] = {}
        self.name = array("i")
        self.offset = array("q")
        self.length = array("q")
        self.checksum = array("Q")

    def __len__(self) -> int:
        return len(self.key_end)

    def __getitem__(self, j):  # type: ignore[override]
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = range(len(self))[j]
        start = self.key_end[j - 1] if j else 0
        return self.key_data[start : self.key_end[j]].decode("utf-8")

    def code(self, field: str) -> int:
        """The code of field name ``field`` in :attr:`names` (added if new)."""
        c = self._codes.get(field)
        if c is None:
            c = self._codes[field] = len(self.names)
            self.names.append(field)
        return c

    def append(self, key: str, shard: int, members: Sequence[Sequence[Any]]) -> None:
        """Add one sample: ``members`` = ``[(field, offset, length, checksum), ...]``, primary first."""
        self.key_data += key.encode("utf-8")
        self.key_end.append(len(self.key_data))
        self.shard.append(shard)
        for field, off, n, ck in members:
            self.name.append(self.code(field))
            self.offset.append(int(off))
            self.length.append(int(n))
            self.checksum.append(int(ck))
        self.member_end.append(len(self.name))

    def extend(self, other: Rows, shard: int) -> None:
        """Add every sample of ``other`` (e.g. one shard's, :func:`decode`), in shard ``shard``."""
        base_key, base_member = len(self.key_data), len(self.name)
        self.key_data += other.key_data
        self.key_end.extend(array("q", (np.frombuffer(other.key_end, np.int64) + base_key).tobytes()))
        self.shard.extend(array("i", [shard]) * len(other))
        self.member_end.extend(array("q", (np.frombuffer(other.member_end, np.int64) + base_member).tobytes()))
        recode = np.array([self.code(f) for f in other.names], dtype=np.int32)
        if len(other.name):
            self.name.extend(array("i", recode[np.frombuffer(other.name, np.int32)].tobytes()))
        self.offset.extend(other.offset)
        self.length.extend(other.length)
        self.checksum.extend(other.checksum)

    def members(self, j: int) -> list[list]:
        """Sample ``j``'s members as ``[[field, offset, length, checksum], ...]``."""
        start = self.member_end[j - 1] if j else 0
        return [
            [self.names[self.name[m]], self.offset[m], self.length[m], self.checksum[m]]
            for m in range(start, self.member_end[j])
        ]

    def as_lists(self) -> Iterator[list]:
        """``[key, shard, members]`` per sample (a part's record, :mod:`.parts`)."""
        for j in range(len(self)):
            yield [self[j], self.shard[j], self.members(j)]

    @property
    def payload_bytes(self) -> int:
        """Bytes of every member of every sample."""
        return int(np.frombuffer(self.length, np.int64).sum()) if len(self.length) else 0

    def keys_array(self) -> pa.Array:
        """The keys as one Arrow string array (``large_string`` past 2 GiB of keys)."""
        ends = np.frombuffer(self.key_end, np.int64) if len(self) else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], ends])
        big = len(self.key_data) >= 2**31
        typ = pa.large_string() if big else pa.string()
        offsets = offsets.astype(np.int64 if big else np.int32)
        # the key bytes are shared, not copied: the bytearray can no longer grow while the array lives
        return pa.Array.from_buffers(typ, len(self), [None, pa.py_buffer(offsets), pa.py_buffer(self.key_data)])

    def columns(self) -> dict[str, np.ndarray]:
        """numpy views of the columns: ``shard``, ``member_start`` (N+1,), ``name``, ``offset``,
        ``length``, ``checksum``."""
        out = {"shard": np.frombuffer(self.shard, np.int32) if len(self) else np.zeros(0, np.int32)}
        ends = np.frombuffer(self.member_end, np.int64) if len(self) else np.zeros(0, np.int64)
        out["member_start"] = np.concatenate([np.zeros(1, np.int64), ends])
        for col, code in _MEMBER_COLUMNS:
            arr = getattr(self, col)
            out[col] = np.frombuffer(arr, np.dtype(code)) if len(arr) else np.zeros(0, np.dtype(code))
        return out


def encode(rows: Rows) -> dict[str, Any]:
    """One shard's rows as JSON-ready columns (a manifest's ``rows``)."""

    def b64(data) -> str:
        return base64.b64encode(bytes(data)).decode("ascii")

    out: dict[str, Any] = {"samples": len(rows), "names": rows.names, "keys": b64(rows.key_data)}
    for col in ("key_end", "member_end", *(c for c, _ in _MEMBER_COLUMNS)):
        out[col] = b64(getattr(rows, col))
    return out


def decode(cols: dict[str, Any]) -> Rows:
    """The :class:`Rows` of :func:`encode`'s output (shard numbers 0). ValueError if malformed."""
    rows = Rows()
    rows.key_data = bytearray(base64.b64decode(cols["keys"]))
    for col, code in (("key_end", "q"), ("member_end", "q"), *_MEMBER_COLUMNS):
        a = array(code)
        a.frombytes(base64.b64decode(cols[col]))
        setattr(rows, col, a)
    for name in cols["names"]:
        rows.code(str(name))
    rows.shard = array("i", [0]) * len(rows.key_end)
    n = int(cols["samples"])
    if len(rows.key_end) != n or len(rows.member_end) != n or (n and rows.key_end[-1] != len(rows.key_data)):
        raise ValueError("manifest rows do not agree with their sample count")
    if len({len(getattr(rows, c)) for c, _ in _MEMBER_COLUMNS}) != 1 or (n and rows.member_end[-1] != len(rows.name)):
        raise ValueError("manifest member columns differ in length")
    return rows
