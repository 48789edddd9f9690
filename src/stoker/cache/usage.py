"""Usage counters of a node cache and the budget lock that guards them: the total bytes in use
(8 bytes at the start of the budget lock file ``.lock``) and the bytes per namespace
(``.usage/<namespace>``, 8 bytes each), changed only while :meth:`UsageCounters.locked` is held.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from contextlib import contextmanager

from .._atomic import open_file
from . import layout, space
from .blockfiles import BlockFiles

__all__ = ["UsageCounters"]


class UsageCounters:
    """The usage counters (bytes) of the cache whose block files are ``files``
    (:class:`stoker.cache.blockfiles.BlockFiles`); callers hold :meth:`locked` unless said. Picklable."""

    def __init__(self, files: BlockFiles):
        self.files = files
        self.dir = files.dir
        self._lock_fd: int | None = None  # the budget lock file while the lock is held, else None

    def __getstate__(self):
        return {**self.__dict__, "_lock_fd": None}

    @contextmanager
    def locked(self):
        """The budget lock (``.lock``): a thread lock of this process, then ``flock`` on the
        process's open descriptor of the file; unlocked explicitly (a forked child's copy of
        the descriptor must not keep it held). A lock file that is no longer the one at its name
        (the cache directory was removed or moved) or cannot be opened (it is gone) revives the
        cache first (:meth:`stoker.cache.cachedir.CacheDir.revive`): a lock only this process sees
        would exclude nobody. Raises :class:`~stoker.errors.CacheDirError` when it stays gone."""
        for attempt in range(3):
            h = self.dir.local()
            with h.budget_mutex:
                try:
                    fd = h.budget_fd()
                except FileNotFoundError as exc:
                    if attempt == 2:
                        raise self.dir.gone(exc) from exc
                    fd = None
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    if h.current(fd, h.budget_path()):
                        self._lock_fd = fd
                        try:
                            yield
                        finally:
                            self._lock_fd = None
                            fcntl.flock(fd, fcntl.LOCK_UN)
                        return
                    fcntl.flock(fd, fcntl.LOCK_UN)
            self.dir.revive()
        raise self.dir.gone(FileNotFoundError(errno.ENOENT, "the budget lock file went away again"))

    def held_fd(self) -> int:
        """The budget lock file's descriptor. Raises RuntimeError when the lock is not held."""
        if self._lock_fd is None:
            raise RuntimeError(f"cache {self.dir.root}: the usage counters are used without the budget lock")
        return self._lock_fd

    def used(self) -> int:
        """Bytes in use; caller holds the budget lock. A new or damaged counter is recounted."""
        raw = os.pread(self.held_fd(), 8, 0)
        if len(raw) != 8:
            return self.recount()
        return struct.unpack("<q", raw)[0]

    def _write_used(self, used: int) -> None:
        # 16 bytes: the counter and the full-disk warning slot share one page from the start
        fd = self.held_fd()
        raw = os.pread(fd, 16, 0)
        os.pwrite(fd, struct.pack("<q", max(0, int(used))) + (raw[8:16] if len(raw) == 16 else bytes(8)), 0)

    # Bytes per namespace (dataset content version) in .usage/<namespace>, 8 bytes each,
    # changed only under the budget lock together with the total.
    def of(self, namespace: str) -> int:
        """Bytes committed or reserved of ``namespace`` (0 without a counter)."""
        try:
            fd = open_file(os.path.join(self.dir.root, ".usage", namespace), os.O_RDONLY)
        except FileNotFoundError:
            return 0
        try:
            raw = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
        return struct.unpack("<q", raw)[0] if len(raw) == 8 else 0

    def _ns_write(self, namespace: str, used: int) -> None:
        fd = open_file(layout.usage_file(self.dir.root, namespace), os.O_CREAT | os.O_WRONLY, self.dir.mode)
        try:
            os.pwrite(fd, struct.pack("<q", max(0, int(used))), 0)
        finally:
            os.close(fd)

    def charge(self, namespace: str, delta: int, used: int | None = None) -> int:
        """Add ``delta`` bytes to the total (``used``: the total now, if known) and to
        ``namespace``; caller holds the budget lock. Returns the new total. The namespace counter
        is written first: it is the one write that may need new space (a new counter file), and
        when it fails the total is unchanged."""
        used = (self.used() if used is None else used) + delta
        self._ns_write(namespace, self.of(namespace) + delta)
        self._write_used(used)
        return used

    def namespace_usage(self) -> dict[str, int]:
        """{namespace: bytes committed or reserved} for every namespace with a counter."""
        try:
            names = os.listdir(os.path.join(self.dir.root, ".usage"))
        except FileNotFoundError:  # removed with the directory: nothing is counted there now
            return {}
        return {ns: self.of(ns) for ns in names}

    def recount(self) -> int:
        """Recount usage from the files on disk (total and per namespace), write the counters and
        return the total in bytes; caller holds the lock. A full disk leaves a counter as it was
        (recounted again at the next recount)."""
        per: dict[str, int] = {}
        for path, size, _, _ in self.files.entries():
            ns = layout.namespace_of(path)
            per[ns] = per.get(ns, 0) + size
        try:
            counted = set(os.listdir(os.path.join(self.dir.root, ".usage")))
        except FileNotFoundError:  # removed with the directory (made again by the cache)
            counted = set()
        for ns in set(per) | counted:
            try:
                self._ns_write(ns, per.get(ns, 0))
            except OSError as exc:
                if not space.is_full(exc):
                    raise
        used = sum(per.values())
        try:
            self._write_used(used)
        except OSError as exc:
            if not space.is_full(exc):
                raise
        return used
