"""Byte counters shared by every process of one rank (the rank, its decode workers, its prefetcher).

A small file of little-endian int64 counters, incremented under ``flock`` (a few microseconds
per update), so the rank reads one total for all of its processes without any change to the
loader's own statistics. Picklable: a copy reopens the file by path.

Each byte a rank reads is counted once, by where it came from: ``local + peer + origin +
peer_origin + handoff`` is the bytes of the samples the rank read (``handoff``: from the cache of
a block's previous owner, :mod:`stoker.cluster.handoff`). A sample read from a block that this
rank's processes fetched in the current epoch (from the origin or a peer, into the node cache or
the staging area) counts where the block came from, not as local: the file keeps a one-byte
source tag per block after the counters (:meth:`ByteCounters.tag`), cleared at each epoch's start
(:meth:`ByteCounters.clear_tags`). The bytes received are counted apart, in the ``fetch_*``
fields: whole blocks (headers included) and single samples read from a source directly.

The file is unlinked as soon as it is made, where this process's descriptors can be opened as
``/proc/<pid>/fd/<fd>`` (as the batch slots, :mod:`stoker.loader.shm`): the processes of the rank
reopen it by that path, and it goes with the process that made it, also one killed (a Ray worker
ends by SIGKILL). Elsewhere it keeps its name, which carries the pid of the process that made it
(``stoker-bytes-<pid>-*``): a rank killed before :meth:`ByteCounters.close` then leaves it behind,
and the next one made on the node removes the files of this user whose process is gone
(:func:`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import tempfile

from .._procs import left_by_dead

#: Counter names, in file order (all in bytes except ``fallbacks``, a count of reads).
FIELDS = (
    "local",
    "peer",
    "origin",
    "peer_origin",
    "fallbacks",
    "fetch_origin",
    "fetch_peer",
    "fetch_peer_origin",
    "handoff",
    "fetch_handoff",
)
_FMT = "<" + "q" * len(FIELDS)
_HEADER = struct.calcsize(_FMT)
#: Source tags of fetched blocks (index = tag byte): the field a sample read from the block counts in.
SOURCES = ("local", "origin", "peer", "peer_origin", "handoff")


#: File name prefix of the counter files, followed by the creating process's pid and a dash.
PREFIX = "stoker-bytes-"


def sweep_stale(directory: str) -> int:
    """Remove the counter files in ``directory`` that belong to this user and whose creating
    process no longer exists (a rank killed before it closed them); returns how many. Files of
    other users and of live processes are left alone; a file that cannot be removed is skipped."""
    removed = 0
    for path, _ in left_by_dead(directory, PREFIX):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


class ByteCounters:
    """Where the bytes a rank read came from: ``local`` (its node cache), ``peer`` (another
    node's cache service, served from that cache), ``origin`` (read from the origin by the
    rank's own processes), ``peer_origin`` (read from the origin by a peer's cache service to
    serve this rank: the peer did not have the block yet), ``handoff`` (read from the cache of
    the block's previous owner, the node that owned it before the dataset's members last grew:
    fetched by this rank for its own node, or by the owning peer's service to serve this rank;
    :mod:`stoker.cluster.handoff`) and ``fallbacks`` (peer reads that failed and went to the
    origin); ``fetch_origin`` / ``fetch_peer`` / ``fetch_peer_origin`` / ``fetch_handoff``: the
    bytes received from each source, whole blocks and single samples (module docstring). ``path``: the file
    (default: a new one in /dev/shm or the temp dir). :meth:`close` deletes it.
    """

    def __init__(self, path: str | None = None):
        self._fd: int | None = None  # the maker's descriptor of an unlinked file (module docstring)
        self._owner = os.getpid()
        if path is None:
            from ..loader.shm import unlink_to_descriptor

            d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            sweep_stale(d)
            fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=d)
            os.write(fd, struct.pack(_FMT, *([0] * len(FIELDS))))
            if (unlinked := unlink_to_descriptor(fd, path)) is not None:
                self._fd, path = fd, unlinked
            else:
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

    def size_tags(self, num_blocks: int) -> None:
        """Make room for the source tags of ``num_blocks`` blocks (all ``local``)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, _HEADER + int(num_blocks))
        finally:
            os.close(fd)

    def tag(self, b: int, source: str, nbytes: int) -> None:
        """Block ``b`` (``nbytes`` bytes) was fetched from ``source`` (``origin``, ``peer``,
        ``peer_origin``, ``handoff``) by one of this rank's processes: count it in ``fetch_<source>`` and tag it."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            vals = list(struct.unpack(_FMT, os.pread(fd, _HEADER, 0)))
            vals[FIELDS.index("fetch_" + source)] += int(nbytes)
            os.pwrite(fd, struct.pack(_FMT, *vals), 0)
            if os.fstat(fd).st_size > _HEADER + int(b):
                os.pwrite(fd, bytes([SOURCES.index(source)]), _HEADER + int(b))
        finally:
            os.close(fd)

    def credit(self, b: int, nbytes: int) -> None:
        """A sample of ``nbytes`` bytes was read from block ``b`` in this node's cache or the
        staging area: count it where the block came from this epoch (``local`` if not fetched)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            tag = os.pread(fd, 1, _HEADER + int(b))
            field = SOURCES[tag[0]] if tag else "local"
            vals = list(struct.unpack(_FMT, os.pread(fd, _HEADER, 0)))
            vals[FIELDS.index(field)] += int(nbytes)
            os.pwrite(fd, struct.pack(_FMT, *vals), 0)
        finally:
            os.close(fd)

    def clear_tags(self) -> None:
        """Forget which blocks were fetched (an epoch starts: what is cached now is local)."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n = os.fstat(fd).st_size - _HEADER
            if n > 0:
                os.pwrite(fd, bytes(n), _HEADER)
        finally:
            os.close(fd)

    def read(self) -> dict:
        """Current totals ``{name: int}``."""
        with open(self.path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            return dict(zip(FIELDS, struct.unpack(_FMT, f.read(_HEADER))))

    def close(self) -> None:
        """Remove the file: close the maker's descriptor of an unlinked one (in the process that
        made it; a copy elsewhere does nothing), or unlink a named one. Idempotent."""
        if self._fd is not None:
            if os.getpid() == self._owner:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = None
            return
        if self.path.startswith("/proc/"):  # another process's unlinked file: its maker's to close
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def fractions(delta: dict) -> dict:
    """``local_fraction``/``peer_fraction``/``origin_fraction`` of the bytes in ``delta``.

    Origin bytes include ``peer_origin`` (bytes a peer fetched from the origin for us); peer
    bytes include ``handoff`` (bytes from the cache of a block's previous owner: another node's
    cache too). Each byte read is counted once (module docstring), so the three fractions add up
    to 1 (or are all 0).
    """
    origin = delta.get("origin", 0) + delta.get("peer_origin", 0)
    peer = delta.get("peer", 0) + delta.get("handoff", 0)
    total = delta.get("local", 0) + peer + origin
    if total == 0:
        return {"local_fraction": 0.0, "peer_fraction": 0.0, "origin_fraction": 0.0}
    return {
        "local_fraction": delta.get("local", 0) / total,
        "peer_fraction": peer / total,
        "origin_fraction": origin / total,
    }
