"""Byte counters shared by every process of one rank (the rank, its decode workers, its prefetcher).

A small file of little-endian int64 counters, incremented under ``flock`` (a few microseconds
per update), so the rank reads one total for all of its processes without any change to the
loader's own statistics. Picklable: a copy reopens the file by path.
"""
from __future__ import annotations

import fcntl
import os
import struct
import tempfile

#: Counter names, in file order (all in bytes except ``fallbacks``, a count of reads).
FIELDS = ("local", "peer", "origin", "peer_origin", "fallbacks")
_FMT = "<" + "q" * len(FIELDS)


class ByteCounters:
    """Where the bytes a rank read came from: ``local`` (its node cache), ``peer`` (another
    node's cache service, served from that cache), ``origin`` (read from the origin by the
    rank's own processes), ``peer_origin`` (read from the origin by a peer's cache service to
    serve this rank: the peer did not have the block yet) and ``fallbacks`` (peer reads that
    failed and went to the origin). ``path``: the file (default: a new one in /dev/shm or the
    temp dir). :meth:`close` deletes it.
    """

    def __init__(self, path: str | None = None):
        if path is None:
            d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path = tempfile.mkstemp(prefix="stoker-bytes-", dir=d)
            os.write(fd, struct.pack(_FMT, *([0] * len(FIELDS))))
            os.close(fd)
        self.path = path

    def add(self, **counts: int) -> None:
        """Add ``counts`` (names from :data:`FIELDS`) atomically across processes."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            vals = list(struct.unpack(_FMT, os.pread(fd, struct.calcsize(_FMT), 0)))
            for k, v in counts.items():
                vals[FIELDS.index(k)] += int(v)
            os.pwrite(fd, struct.pack(_FMT, *vals), 0)
        finally:
            os.close(fd)

    def read(self) -> dict:
        """Current totals ``{name: int}``."""
        with open(self.path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            return dict(zip(FIELDS, struct.unpack(_FMT, f.read(struct.calcsize(_FMT)))))

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def fractions(delta: dict) -> dict:
    """``local_fraction``/``peer_fraction``/``origin_fraction`` of the bytes in ``delta``.

    Origin bytes include ``peer_origin`` (bytes a peer fetched from the origin for us). A
    block filled from the origin and then read from the node cache in the same epoch counts
    in both ``origin`` and ``local``: the fractions say where bytes were read from, per read.
    """
    origin = delta.get("origin", 0) + delta.get("peer_origin", 0)
    total = delta.get("local", 0) + delta.get("peer", 0) + origin
    if total == 0:
        return {"local_fraction": 0.0, "peer_fraction": 0.0, "origin_fraction": 0.0}
    return {"local_fraction": delta.get("local", 0) / total, "peer_fraction": delta.get("peer", 0) / total,
            "origin_fraction": origin / total}
