"""Usage counters of a node cache: the total bytes in use (8 bytes at the start of the budget
lock file) and the bytes per namespace (``.usage/<namespace>``, 8 bytes each), changed only under
the budget lock. :class:`UsageCounters` is mixed into :class:`stoker.cache.disk.DiskCache`, which
provides ``root``, ``mode``, ``_lock_fd`` (the budget lock file, open) and ``_entries()``.
"""

from __future__ import annotations

import os
import struct

from .._atomic import open_file
from . import layout, space

__all__ = ["UsageCounters"]


class UsageCounters:
    """Reads and writes of the usage counters (bytes); callers hold the budget lock unless said."""

    root: str
    mode: int
    _lock_fd: int | None  # the budget lock file while the lock is held, else None

    def _entries(self):  # provided by the cache
        raise NotImplementedError

    def _held_fd(self) -> int:
        """The budget lock file's descriptor. Raises RuntimeError when the lock is not held."""
        if self._lock_fd is None:
            raise RuntimeError(f"cache {self.root}: the usage counters are used without the budget lock")
        return self._lock_fd

    def _read_used(self) -> int:
        """Bytes in use; caller holds the budget lock. A new or damaged counter is recounted."""
        raw = os.pread(self._held_fd(), 8, 0)
        if len(raw) != 8:
            used = self._scan_used()
            try:
                self._write_used(used)
            except OSError as exc:  # a full disk: the next reader recounts again
                if not space.is_full(exc):
                    raise
            return used
        return struct.unpack("<q", raw)[0]

    def _write_used(self, used: int) -> None:
        # 16 bytes: the counter and the full-disk warning slot share one page from the start
        fd = self._held_fd()
        raw = os.pread(fd, 16, 0)
        os.pwrite(fd, struct.pack("<q", max(0, int(used))) + (raw[8:16] if len(raw) == 16 else bytes(8)), 0)

    # Bytes per namespace (dataset content version) in .usage/<namespace>, 8 bytes each,
    # changed only under the budget lock together with the total.
    def _ns_read(self, namespace: str) -> int:
        try:
            fd = open_file(os.path.join(self.root, ".usage", namespace), os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            raw = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
        return struct.unpack("<q", raw)[0] if len(raw) == 8 else 0

    def _ns_write(self, namespace: str, used: int) -> None:
        fd = open_file(layout.usage_file(self.root, namespace), os.O_CREAT | os.O_WRONLY, self.mode)
        try:
            os.pwrite(fd, struct.pack("<q", max(0, int(used))), 0)
        finally:
            os.close(fd)

    def _charge(self, namespace: str, delta: int, used: int | None = None) -> int:
        """Add ``delta`` bytes to the total and to ``namespace``; caller holds the budget lock.
        Returns the new total. The namespace counter is written first: it is the one write
        that may need new space (a new counter file), and when it fails the total is unchanged."""
        used = (self._read_used() if used is None else used) + delta
        self._ns_write(namespace, self._ns_read(namespace) + delta)
        self._write_used(used)
        return used

    def namespace_usage(self) -> dict[str, int]:
        """{namespace: bytes committed or reserved} for every namespace with a counter."""
        out: dict[str, int] = {}
        try:
            names = os.listdir(os.path.join(self.root, ".usage"))
        except FileNotFoundError:  # removed with the directory: nothing is counted there now
            return out
        for ns in names:
            out[ns] = self._ns_read(ns)
        return out

    def _scan_used(self) -> int:
        """Recount usage from the files on disk (total and per namespace); caller holds the lock."""
        per: dict[str, int] = {}
        for path, size, _, _ in self._entries():
            ns = layout.namespace_of(path)
            per[ns] = per.get(ns, 0) + size
        try:
            counted = set(os.listdir(os.path.join(self.root, ".usage")))
        except FileNotFoundError:  # removed with the directory (made again by the cache)
            counted = set()
        for ns in set(per) | counted:
            try:
                self._ns_write(ns, per.get(ns, 0))
            except OSError as exc:  # a full disk: the counter is recounted on the next recover
                if not space.is_full(exc):
                    raise
        return sum(per.values())
