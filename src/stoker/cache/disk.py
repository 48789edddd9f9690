"""Disk tier of the node cache: shard blocks as files, one byte budget for all processes.

The files under ``root`` are drawn in this folder's README.md; what the cache owns and how it
recognises it: :mod:`.layout` (anything else in ``root`` is never counted, evicted or deleted).

Every fill reserves its bytes under ``.lock`` before it writes (the budget is enforced on every
write, never exceeded; WebDataset checks its cache limit only every 30 s), writes a temporary file
and renames it into place, so a reader sees a whole block or none. A process killed mid-fill
leaves a temporary file and a reservation; :meth:`DiskCache.recover` (run when a loader opens the
cache) deletes temporary files of dead processes and recounts usage from the files on disk. A
disk smaller than the budget caps the budget at what the filesystem can take (:mod:`.space`).

Policies (selectable; ``stoker bench cache`` compares them):

- ``future`` (the default): never evicts a dataset's blocks for the same dataset's blocks
  (so one dataset sits on the D - C floor, like ``noevict``), and splits the budget between
  the datasets of the jobs alive on the node by what each cached byte saves per second
  (:mod:`stoker.cache.policy`): a fill that finds the budget full evicts blocks of datasets
  holding more than their share (oldest first), never of datasets within it.
- ``noevict``: admit until the budget is full, then admit nothing more (CoorDL's
  MinIO: with epoch-random access this reads the minimum D - C bytes per epoch).
- ``lru``: evict the least recently used blocks (mtime, touched on every hit) to
  make room; thrashes under epoch-random access, kept for comparison.
"""

from __future__ import annotations

import os
import shutil

from .._procs import pid_alive
from ..errors import CacheLockTimeout  # noqa: F401 - re-exported
from . import catalog, perms
from .blockfiles import BlockFiles
from .budget import POLICIES, Budget, CacheStats, check
from .cachedir import CacheDir
from .fetchlocks import FetchLocks
from .usage import UsageCounters

__all__ = ["CacheStats", "DiskCache", "POLICIES"]


class DiskCache:
    """A byte-budgeted block cache in directory ``root``, safe to share between processes.

    ``capacity_bytes``: the budget (bytes); usage never exceeds it, nor what the
    filesystem under ``root`` can hold. ``policy``: one of :data:`POLICIES`.
    ``lock_timeout_s``: longest wait for another process's fill before
    :class:`CacheLockTimeout`. Picklable: each process reopens by path. Opening writes the
    cache's marker into ``root`` (:mod:`.layout`); only the cache's own namespaces are
    counted, evicted or cleared.
    ``mode``: file mode of all it creates (:mod:`.perms`: ``$STOKER_CACHE_MODE`` or 0600,
    directories 0700; ``"0640"`` shares it with the directory's group), kept in the marker.
    Raises ValueError for a bad policy, mode or budget; :class:`~stoker.errors.CacheModeError`
    (``root`` made with another mode), :class:`~stoker.errors.UnsafePathError` (see :mod:`.perms`)
    and :class:`~stoker.errors.CacheUnwritableError` (``root`` on a read-only filesystem, or not
    writable by this user: a cache filled earlier is read with :class:`stoker.cache.readonly.ReadOnlyCache`).

    Its parts: :attr:`dir` (:class:`stoker.cache.cachedir.CacheDir`), :attr:`files`, :attr:`locks`,
    :attr:`usage` (``usage.namespace_usage()``) and :attr:`budget` (``budget.quotas()``,
    ``budget.keep_free_fraction``, ``budget.overflow``).
    A directory removed while a job runs is made again at the next fill (its blocks are then
    misses, read from the origin again; logged once): :meth:`stoker.cache.cachedir.CacheDir.revive`.
    """

    read_only = False  # (see stoker.cache.readonly.ReadOnlyCache)

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        policy: str = "future",
        lock_timeout_s: float = 120.0,
        mode: int | str | None = None,
    ):
        self.stats = CacheStats()
        check(capacity_bytes, policy)  # before anything is made
        self.dir = CacheDir(os.path.abspath(os.path.expanduser(root)), perms.parse_mode(mode))
        self.files = BlockFiles(self.dir)
        self.locks = FetchLocks(self.dir, lock_timeout_s)
        self.usage = UsageCounters(self.files)
        self.budget = Budget(self.files, self.usage, capacity_bytes, policy, self.stats)

    @property
    def root(self) -> str:
        """The cache directory (absolute path)."""
        return self.dir.root

    @property
    def mode(self) -> int:
        """File mode of the files the cache makes (:mod:`.perms`)."""
        return self.dir.mode

    @property
    def jobs(self):
        """The job records of the ``future`` policy (:class:`stoker.cache.policy.JobRegistry`)."""
        return self.dir.jobs

    @property
    def capacity_bytes(self) -> int:
        """The budget in bytes."""
        return self.budget.capacity_bytes

    @property
    def policy(self) -> str:
        """The eviction policy (one of :data:`POLICIES`)."""
        return self.budget.policy

    def path(self, namespace: str, name: str) -> str:
        """File of block ``name`` of ``namespace`` (whether or not it is cached)."""
        return self.files.path(namespace, name)

    def close(self) -> None:
        """Close the descriptors this process keeps open (lock files, block files). The cache
        stays usable: they are opened again when needed."""
        self.dir.close()

    def fetch_lock(self, namespace: str, name: str, blocking: bool = True):
        """Single-flight lock of one block (:meth:`stoker.cache.fetchlocks.FetchLocks.fetch_lock`)."""
        return self.locks.fetch_lock(namespace, name, blocking)

    def note_fill_failure(self, namespace: str, name: str, note: dict) -> None:
        """Note a failed fill of a block (:meth:`stoker.cache.fetchlocks.FetchLocks.note_fill_failure`)."""
        self.locks.note_fill_failure(namespace, name, note)

    def fill_failure(self, namespace: str, name: str) -> dict | None:
        """The last failed fill's note (:meth:`stoker.cache.fetchlocks.FetchLocks.fill_failure`)."""
        return self.locks.fill_failure(namespace, name)

    def used_bytes(self) -> int:
        """Bytes committed or reserved in the cache (all processes)."""

        def used() -> int:
            with self.usage.locked():
                return self.usage.used()

        return self.dir.again(used)

    def recover(self) -> dict:
        """Delete temporary fills and staging areas of dead processes, records of dead jobs, and
        recount usage from disk.

        Returns {"removed_tmp": n, "used": bytes}. Safe while other processes run:
        fills of live processes are kept and counted.
        """
        with self.usage.locked():
            removed = self.files.remove_dead_fills()
            used = self.usage.recount()
        self.dir.jobs.remove_dead()
        staging = os.path.join(self.root, ".staging")
        if os.path.isdir(staging):
            for d in os.listdir(staging):
                owner = d.split("-")[0]
                if owner.isdigit() and not pid_alive(int(owner)):
                    shutil.rmtree(os.path.join(staging, d), ignore_errors=True)
        return {"removed_tmp": removed, "used": used}

    # -- reads ------------------------------------------------------------
    def read(self, namespace: str, name: str, offset: int, length: int, count: bool = True) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a cached block, or None if it is not cached.
        ``count``: as :meth:`stoker.cache.tiered.TieredCache.read` (one tier counts no hits)."""
        return self._read(namespace, name, offset, length, open_only=False)

    def read_if_open(self, namespace: str, name: str, offset: int, length: int) -> bytes | None:
        """As :meth:`read`, but None unless this process holds the block file open already (no
        ``open`` tried: a tiered cache asks the tier that served the block last first)."""
        return self._read(namespace, name, offset, length, open_only=True)

    def _read(self, namespace: str, name: str, offset: int, length: int, open_only: bool) -> bytes | None:
        data = self.files.read(namespace, name, offset, length, open_only, touch=self.policy == "lru")
        if data is not None and len(data) != length:  # a short block file is damaged: treat as missing
            self.remove(namespace, name)
            self.stats.corrupt += 1
            return None
        return data

    def with_fd(self, namespace: str, name: str, use, count: bool = True):
        """``use(fd)`` on an open descriptor of cached block ``name`` (a server sends its bytes with
        ``os.sendfile``: :mod:`stoker.cluster.service.endpoint`) and its result, or None when the
        block is not cached. ``use`` checks the file's size itself (a short file is a damaged
        block: :meth:`read` drops it). ``count``: as :meth:`read`."""
        return self.files.with_fd(namespace, name, use, touch=self.policy == "lru")

    def contains(self, namespace: str, name: str) -> bool:
        """Whether block ``name`` of ``namespace`` is cached."""
        return self.files.contains(namespace, name)

    # -- the policy --------------------------------------------------------
    def register(self, namespace: str, dataset_bytes: int, epoch_s: float | None = None) -> None:
        """Announce this process's job on ``namespace`` (its size in bytes and, once known,
        its epoch time in seconds) to the ``future`` policy's budget split."""
        self.budget.register(namespace, dataset_bytes, epoch_s)

    def describe(self, namespace: str, url: str) -> None:
        """Record for ``stoker cache status`` that ``namespace`` holds the dataset at ``url`` and
        that this cache's budget is in force (:mod:`.catalog`; best effort)."""
        catalog.record_dataset(self.root, namespace, url, self.mode)
        if self.capacity_bytes > 0:
            catalog.record_budget(self.root, self.capacity_bytes, self.mode)

    def forget_quotas(self) -> None:
        """Split the budget again at the next fill (:meth:`stoker.cache.budget.Budget.forget_quotas`)."""
        self.budget.forget_quotas()

    # -- writes -----------------------------------------------------------
    def would_admit(self, nbytes: int, namespace: str = "") -> bool:
        """Whether a fill of ``nbytes`` for ``namespace`` would be admitted now (a dry run:
        no reservation, nothing evicted)."""
        return self.dir.again(lambda: self.budget.would_admit(nbytes, namespace))

    def put(self, namespace: str, name: str, data: bytes) -> bool:
        """Admit a block: reserve its bytes, write a temporary file, rename it into place.

        A cache directory removed while the job runs is made again and the block admitted into
        it; one removed again at once raises :class:`~stoker.errors.CacheDirError` naming it.

        Returns True if the block is now cached, False if the policy refused it or it does
        not fit on the filesystem. Under ``lru`` older blocks are evicted to make room; under
        ``future`` blocks of datasets over their share. Usage never exceeds ``capacity_bytes``
        nor what the filesystem holds: a full disk or quota (ENOSPC, EDQUOT, on any write)
        removes the temporary file, releases the reservation, warns once per job naming the
        directory and the free bytes (:mod:`.space`) and refuses the block. Other OSErrors
        release the reservation and are re-raised.
        """
        return self.dir.again(lambda: self.budget.admit(namespace, name, data))

    def remove(self, namespace: str, name: str) -> None:
        """Drop one block (e.g. after a checksum failure) and return its bytes to the budget."""
        self.dir.again(lambda: self.budget.remove(namespace, name))
