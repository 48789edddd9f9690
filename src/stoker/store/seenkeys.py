"""The keys a writer has taken so far, as 64-bit digests: an exact duplicate check at about 20
bytes per key.

A Python set of the keys themselves costs about 100 bytes per ImageNet-length key (the str
object and its slot), which at a million samples was most of :class:`stoker.Writer`'s memory.
:class:`SeenKeys` keeps each key's xxh3-64 digest twice: in the order taken (so that a digest
match leads back to the earlier samples to compare) and in a sorted array searched by bisection,
with the newest digests in a small set until they are merged in, and a bitmap of the digests'
low bits in front (16 to 32 bits per key, so at most 1 bit in 16 is set), which answers most new
keys with one byte read in Python (the numpy search alone cost about 6 us a key). About 18-20
bytes per key in all. A digest match is only a
candidate: the caller compares the keys themselves (:meth:`SeenKeys.earlier` gives the
positions), so two different keys whose digests collide are both accepted.
"""

from __future__ import annotations

from array import array

import numpy as np
import xxhash

__all__ = ["SeenKeys", "key_digest"]

#: Digests held in the set of newest ones before they are merged into the sorted array.
MERGE_EVERY = 1 << 16
#: Bits of the first bitmap; it doubles whenever keys pass 1/16 of its bits.
FIRST_BITMAP_BITS = 1 << 20


def key_digest(key: str) -> int:
    """The 64-bit digest of ``key`` (xxh3-64 of its UTF-8 bytes)."""
    return xxhash.xxh3_64_intdigest(key.encode("utf-8"))


class SeenKeys:
    """Digests (:func:`key_digest`) of the keys taken, in the order taken (position ``j`` is the
    ``j``-th key)."""

    def __init__(self) -> None:
        self._in_order = array("Q")
        self._sorted = np.zeros(0, np.uint64)
        self._recent: set[int] = set()
        self._bits = bytearray(FIRST_BITMAP_BITS // 8)
        self._mask = FIRST_BITMAP_BITS - 1

    def __len__(self) -> int:
        return len(self._in_order)

    def digest(self, key: str) -> int:
        """``key``'s digest, for :meth:`earlier` and :meth:`add`."""
        return key_digest(key)

    def earlier(self, digest: int) -> list[int]:
        """The positions of the keys taken before whose digest is ``digest`` (usually none; a key
        equal to one of them is a duplicate, a different one a collision)."""
        h = digest & self._mask
        if not self._bits[h >> 3] >> (h & 7) & 1:
            return []
        if digest not in self._recent:
            i = int(self._sorted.searchsorted(np.uint64(digest)))
            if i == len(self._sorted) or int(self._sorted[i]) != digest:
                return []
        return np.flatnonzero(np.frombuffer(self._in_order, np.uint64) == np.uint64(digest)).tolist()

    def add(self, digest: int) -> None:
        """Record the next key's digest (from :meth:`digest`)."""
        self._in_order.append(digest)
        self._recent.add(digest)
        h = digest & self._mask
        self._bits[h >> 3] |= 1 << (h & 7)
        if len(self._recent) >= MERGE_EVERY:
            self._merge()
        if len(self._in_order) * 16 > self._mask + 1:
            self._grow()

    def _merge(self) -> None:
        recent = np.fromiter(self._recent, np.uint64, len(self._recent))
        self._sorted = np.concatenate([self._sorted, recent])
        self._sorted.sort()
        self._recent = set()

    def _grow(self) -> None:
        """Double the bitmap and set the bits of every digest taken."""
        nbits = 2 * (self._mask + 1)
        low = np.frombuffer(self._in_order, np.uint64) & np.uint64(nbits - 1)
        bits = np.zeros(nbits // 8, np.uint8)
        np.bitwise_or.at(bits, low >> np.uint64(3), np.left_shift(1, low & np.uint64(7)).astype(np.uint8))
        self._bits, self._mask = bytearray(bits.tobytes()), nbits - 1
