"""Staging area: blocks fetched just in time that the cache did not admit.

When the budget C is smaller than the dataset D, the no-eviction policy keeps the blocks
it admitted and reads the other D - C bytes from the origin every epoch (the floor: no
policy can read less). The prefetcher still fetches those blocks ahead of the workers, in
the order the epoch needs them, into a staging directory owned by one loader; a staged
block is deleted once the consumer is past its last use in the epoch, so nothing staged
serves a later epoch (but the blocks the next epoch's first batches need while this one's
last batches still hold them, :mod:`stoker.loader.prefetch.process`). A worker that needs a block
before the prefetcher has it fetches the whole block into staging itself (when
:meth:`StagingArea.has_room`), so the block is read from the origin once. Staging is bounded
by the loader's ``staging_bytes``, on the cache's disk but outside the cache budget. Several
loaders on one node (a job's ranks) each need most blocks: one that another loader has staged
is hard-linked into this loader's area (:meth:`StagingArea.adopt`), not fetched again.

Layout: ``<cache root>/.staging/<pid>-<id>/<namespace>/<block>``; directories of dead
processes are removed by :meth:`stoker.cache.DiskCache.recover`. Staging shares the cache's disk:
a block that does not fit there is not staged (:meth:`StagingArea.put`, :mod:`.space`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import uuid

from .._atomic import PRIVATE_FILE_MODE, open_file
from . import layout, perms, space
from .files import TMP_MARK, is_file, read_at, write_whole


class StagingArea:
    """One loader's staged blocks under ``root`` (a directory it owns). Picklable.

    ``cache_root``: the cache directory it lives in (default: the parent of ``.staging``,
    else ``root``), named in the full-disk warning. ``mode``: file mode of staged blocks
    (the cache's, :mod:`.perms`; default 0600, directories 0700). ``capacity_bytes``: the
    loader's ``staging_bytes``, which :meth:`has_room` holds the workers' own staging to
    (None: no bound; the prefetcher keeps its own account, in-flight fills included).
    Raises :class:`~stoker.errors.UnsafePathError` when ``root`` (or a directory made under
    it) is a symlink, another user's or writable by others.
    """

    def __init__(
        self, root: str, cache_root: str | None = None, mode: int = PRIVATE_FILE_MODE, capacity_bytes: int | None = None
    ):
        self.root = root
        self.capacity_bytes = capacity_bytes
        parent = os.path.dirname(os.path.abspath(root))
        if cache_root is None:
            cache_root = os.path.dirname(parent) if os.path.basename(parent) == ".staging" else root
        self.cache_root = cache_root
        self._owner_pid = os.getpid()  # the job that made it (kept by pickling)
        self.mode = mode
        perms.ensure_dir(root, mode)

    @classmethod
    def create(cls, cache_root: str, mode: int = PRIVATE_FILE_MODE, capacity_bytes: int | None = None) -> "StagingArea":
        """A new staging area of this process under ``<cache_root>/.staging``, file mode ``mode``,
        bounded by ``capacity_bytes`` (see the class)."""
        top = perms.ensure_dir(os.path.join(cache_root, ".staging"), mode, parents=False)
        return cls(os.path.join(top, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"), cache_root, mode, capacity_bytes)

    def path(self, namespace: str, name: str) -> str:
        return os.path.join(self.root, namespace, name)

    def put(self, namespace: str, name: str, data) -> bool:
        """Write a block (temporary file + rename: readers see all of it or nothing).

        Returns True when staged, False when the disk has no room for it (by ``statvfs``
        before writing, or ENOSPC / EDQUOT while writing: the temporary file is removed);
        the reader then reads the block's samples from the origin. A staging directory removed
        with the cache directory while the job runs is made again. Other OSErrors are raised.
        """
        final = self.path(namespace, name)
        n = memoryview(data).nbytes
        room = space.headroom_bytes(self.root, n)
        try:
            if room is not None and n > room[0]:
                raise OSError(space.FULL_ERRNOS[0], "no room by statvfs", self.root)
            try:
                perms.ensure_dir(os.path.dirname(final), self.mode, parents=False)
                write_whole(final, data, mode=self.mode)
            except FileNotFoundError:  # the cache directory was removed under the job: make ours again
                layout.wait_removed(self.cache_root)  # once an rm -rf in progress is through
                perms.ensure_dir(os.path.dirname(final), self.mode, parents=True)
                write_whole(final, data, mode=self.mode)
            return True
        except OSError as exc:
            if not space.is_full(exc):
                raise
            info = space.free_bytes(self.root)
            space.warn_full(self.cache_root, info[0] if info else None, None, self._owner_pid, self._claim)
            return False

    def _claim(self) -> bool:
        """Whether no process of this job warned of this full cache directory yet (shares
        the cache's ``.lock`` warning slot, so cache and staging warn once between them)."""
        try:
            fd = open_file(os.path.join(self.cache_root, ".lock"), os.O_RDWR)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return space.claim_warning(fd, self._owner_pid)
        finally:
            os.close(fd)

    def _entries(self, namespace: str) -> list[os.DirEntry]:
        """The blocks staged now under ``namespace`` (fills in progress left out)."""
        try:
            return [e for e in os.scandir(os.path.join(self.root, namespace)) if not e.name.startswith(TMP_MARK)]
        except FileNotFoundError:
            return []

    def held_bytes(self, namespace: str) -> int:
        """Bytes of the blocks staged now under ``namespace`` (fills in progress not counted)."""
        total = 0
        for e in self._entries(namespace):
            try:
                total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted after its last use meanwhile
                continue
        return total

    def has_room(self, namespace: str, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits beside the blocks staged under ``namespace``
        within ``capacity_bytes`` (always, without a bound). A dry run, not a reservation:
        writers racing past it overshoot by at most one block each."""
        if self.capacity_bytes is None:
            return True
        return self.held_bytes(namespace) + int(nbytes) <= self.capacity_bytes

    def names(self, namespace: str) -> list[str]:
        """Names of the blocks staged now under ``namespace`` (fills in progress not listed)."""
        return [e.name for e in self._entries(namespace)]

    def contains(self, namespace: str, name: str) -> bool:
        return is_file(self.path(namespace, name))

    def adopt(self, namespace: str, name: str) -> bool:
        """Make block ``name`` staged here by hard-linking the copy that another loader on this
        node staged (another staging area under the same ``.staging`` directory: the ranks of a
        job on one node, a second job on the dataset); returns whether the block is now staged
        here. Nothing is read from the origin; the other loader deleting its copy later removes
        only its own name, and this area deletes its own after its last use. Each rank would
        otherwise fetch every block that the cache does not admit once more.

        Only a regular file of this user, of the block's name, is taken (a block is renamed into
        place whole: :meth:`put`); its samples are checked against the index when they are read,
        as every staged block's. False when no other area holds it, or on any OSError (the
        other copy deleted meanwhile, a filesystem without hard links): the caller fetches it."""
        top = os.path.dirname(os.path.abspath(self.root))
        if os.path.basename(top) != ".staging":
            return False
        mine = os.path.basename(os.path.abspath(self.root))
        try:
            areas = [e.path for e in os.scandir(top) if e.name != mine and e.is_dir(follow_symlinks=False)]
        except OSError:
            return False
        final = self.path(namespace, name)
        for area in areas:
            src = os.path.join(area, namespace, name)
            try:
                st = os.lstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                perms.ensure_dir(os.path.dirname(final), self.mode, parents=False)
                os.link(src, final, follow_symlinks=False)
                return True
            except FileExistsError:  # staged here meanwhile (a worker's fetch)
                return True
            except OSError:  # (an UnsafePathError too: our namespace directory is not trusted)
                continue
        return False

    def read(self, namespace: str, name: str, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a staged block, or None."""
        data = read_at(self.path(namespace, name), offset, length)
        return data if data is not None and len(data) == length else None

    def remove(self, namespace: str, name: str) -> int:
        """Delete a staged block; returns the bytes freed (0 if it was not there)."""
        path = self.path(namespace, name)
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
            return size
        except FileNotFoundError:
            return 0

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
