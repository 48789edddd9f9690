"""Key hashing for the sample directory: 64-bit hashes of every key, computed with numpy straight
from the pyarrow string buffers (no Python loop over samples), and the sorted hash table that
answers key -> id lookups (each hit checked against the key bytes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import IndexFormatError

# splitmix64 / murmur-style odd multipliers
_K0 = np.uint64(0x9E3779B97F4A7C15)
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_K0_INT, _K1_INT, _K2_INT = int(_K0), int(_K1), int(_K2)
_S27, _S29, _S30, _S31 = (np.uint64(s) for s in (27, 29, 30, 31))
_MASKS = np.array([(1 << (8 * r)) - 1 for r in range(9)], dtype=np.uint64)  # low r bytes
_SLASH = b"/"


def _string_buffers(keys: pa.Array) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Zero-copy views of a string array: (array, offsets (N+1,) int32/int64, data uint8).

    Offsets are absolute positions in ``data``. Raises :class:`IndexFormatError` on null keys.
    """
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    off_type: type[np.signedinteger[Any]]
    if pa.types.is_large_string(keys.type) or pa.types.is_large_binary(keys.type):
        off_type = np.int64
    elif pa.types.is_string(keys.type) or pa.types.is_binary(keys.type):
        off_type = np.int32
    else:  # string_view, dictionary, ...
        keys = keys.cast(pa.string())
        off_type = np.int32
    if keys.null_count:
        raise IndexFormatError(f"the index has {keys.null_count} null keys")
    n = len(keys)
    bufs = keys.buffers()
    if bufs[1] is None:  # empty array
        offsets = np.zeros(n + 1, dtype=off_type)
    else:
        offsets = np.frombuffer(bufs[1], dtype=off_type, count=n + 1, offset=keys.offset * np.dtype(off_type).itemsize)
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
        h ^= int.from_bytes(kb[k : k + 8], "little")
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
