"""A node cache served as it is, without writing: a pre-filled cache on a read-only mount.

A cache can be filled once (``stoker warm``, or a job's first epochs) and then shipped read-only:
baked into a container image, or a volume mounted read-only into many jobs. A
:class:`stoker.cache.DiskCache` writes as soon as it opens (its marker, its lock files, the job
records), so on such a mount it raises :class:`~stoker.errors.CacheUnwritableError`. A
:class:`ReadOnlyCache` opens the same directory and writes nothing, ever:

* a sample whose block is cached is read from it (and checked against the index, as always);
* every other sample is read from the origin, one ranged GET each, and is not kept (no fills,
  no staging area, no prefetch process: the loader starts none for it);
* a cached block that fails its checksum is not used (nor deleted) and the sample is read
  from the origin;
* nothing is locked, counted, registered or recorded (no job record, no live figures).

``open_dataset(..., cache=CacheOptions(cache_read_only=True))`` (or ``$STOKER_CACHE_READ_ONLY=1``) opens the cache this
way. It has the reading side of :class:`stoker.cache.DiskCache`'s interface; the writing side
refuses (``would_admit`` and ``put`` say no) or does nothing.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager

from ..errors import NotACacheError
from . import layout
from .disk import CacheStats
from .handles import Handles
from .perms import DEFAULT_MODE

__all__ = ["ReadOnlyCache", "READ_ONLY_ENV"]

#: Environment variable that opens the node cache read-only when set to 1 (``open_dataset``).
READ_ONLY_ENV = "STOKER_CACHE_READ_ONLY"


class ReadOnlyCache:
    """The cache in directory ``root``, read and never written (see the module docstring).

    ``root`` must be a stoker cache (filled earlier: it holds the cache's marker). Picklable:
    each process opens block files by path. Its ``capacity_bytes`` is 0 (it admits nothing).
    Raises :class:`~stoker.errors.NotACacheError` naming ``root`` when it is missing or not a
    stoker cache (a read-only cache that is empty can serve nothing: read without one, ``cache=False``).
    """

    read_only = True
    capacity_bytes = 0

    def __init__(self, root: str, policy: str = "future"):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.policy = policy
        if not os.path.isdir(self.root):
            raise NotACacheError(
                f"read-only cache directory {self.root} does not exist: a read-only cache serves a cache "
                "filled earlier (point cache_dir at it), or read without a cache (cache=False)"
            )
        if not layout.is_cache(self.root):
            raise NotACacheError(
                f"read-only cache directory {self.root} is not a stoker cache (no {layout.ROOT_MARKER} "
                "marker): fill one first (a job, or `stoker warm`), or read without a cache (cache=False)"
            )
        try:
            recorded = layout.recorded_mode(self.root)
        except OSError:
            recorded = None
        self.mode = recorded if recorded is not None else DEFAULT_MODE  # (nothing is written with it)
        self.stats = CacheStats()
        self._handles: Handles | None = None

    def __getstate__(self):
        return {**self.__dict__, "_handles": None}  # descriptors are per process (stats: per process too)

    def _local(self) -> Handles:
        h = self._handles
        if h is None or h.pid != os.getpid():
            h = self._handles = Handles.for_pid(h, self.root, self.mode)
        return h

    def path(self, namespace: str, name: str) -> str:
        """File of block ``name`` of ``namespace`` (whether or not it is cached)."""
        return os.path.join(layout.ns_dir(self.root, namespace), name)

    # -- reads ----------------------------------------------------------------------
    def read(self, namespace: str, name: str, offset: int, length: int, count: bool = True) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a cached block, or None if it is not cached (or
        shorter than that: damaged, counted in ``stats.corrupt``). ``count`` as in
        :meth:`stoker.cache.DiskCache.read` (accepted; hits are counted by the reader)."""
        return self._read(namespace, name, offset, length, open_only=False)

    def read_if_open(self, namespace: str, name: str, offset: int, length: int) -> bytes | None:
        """As :meth:`read`, but None unless this process holds the block file open already."""
        return self._read(namespace, name, offset, length, open_only=True)

    def _read(self, namespace: str, name: str, offset: int, length: int, open_only: bool) -> bytes | None:
        h = self._local()
        try:
            ent = h.block_ref((namespace, name), lambda: self.path(namespace, name), open_only)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):  # a block this user may not read: a miss
                return None
            raise
        if ent is None:
            return None
        try:
            data = os.pread(ent.fd, length, offset)
        finally:
            h.release(ent)
        if len(data) != length:
            self.stats.corrupt += 1
            return None
        return data

    def contains(self, namespace: str, name: str) -> bool:
        try:
            return os.path.isfile(self.path(namespace, name)) and not os.path.islink(self.path(namespace, name))
        except OSError:
            return False

    def used_bytes(self) -> int:
        """Bytes of the cache's blocks (counted from the files; nothing is reserved here)."""
        total = 0
        for _, d in layout.namespace_dirs(self.root):
            try:
                total += sum(e.stat().st_size for e in os.scandir(d) if e.is_file(follow_symlinks=False))
            except OSError:
                continue
        return total

    def recover(self) -> dict:
        """Nothing to recover in a cache this process never writes: ``{"removed_tmp": 0, "used": bytes}``."""
        return {"removed_tmp": 0, "used": self.used_bytes()}

    # -- the writing side: refused or nothing --------------------------------------------
    def would_admit(self, nbytes: int, namespace: str = "") -> bool:
        """False: nothing is admitted."""
        return False

    def put(self, namespace: str, name: str, data) -> bool:
        """False: nothing is written (counted in ``stats.refused``)."""
        self.stats.refused += 1
        return False

    def remove(self, namespace: str, name: str) -> None:
        """Stop using block ``name`` in this process (a damaged one): its file is left as it is."""
        self._local().drop((namespace, name))

    @contextmanager
    def fetch_lock(self, namespace: str, name: str, blocking: bool = True):
        """Yields True at once: no fill ever happens here, so there is nothing to wait for."""
        yield True

    def note_fill_failure(self, namespace: str, name: str, note: dict) -> None:
        """Nothing is noted (no fill runs here)."""

    def fill_failure(self, namespace: str, name: str) -> dict | None:
        """None: no fill runs here."""
        return None

    def register(self, namespace: str, dataset_bytes: int, epoch_s: float | None = None) -> None:
        """Nothing is registered (no job record is written)."""

    def describe(self, namespace: str, url: str) -> None:
        """Nothing is recorded."""

    def forget_quotas(self) -> None:
        """Nothing to forget."""

    def close(self) -> None:
        """Close the block files this process keeps open."""
        if self._handles is not None and self._handles.pid == os.getpid():
            self._handles.close()
