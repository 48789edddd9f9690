"""The cache directory as one process sees it: made and checked at open, made again when it is
removed while a job runs, and the descriptors this process keeps open in it.

A :class:`CacheDir` is the bottom part of a :class:`stoker.cache.disk.DiskCache`: the block files
(:mod:`.blockfiles`), the fetch locks (:mod:`.fetchlocks`), the usage counters (:mod:`.usage`)
and the budget (:mod:`.budget`) all reach the directory through it. It owns what has to be made
again together when the directory goes away under the process: the open descriptors
(:mod:`.handles`), the namespace directories made so far, and the job's records for the
``future`` policy (:class:`stoker.cache.policy.JobRegistry`), which are written again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

from .._atomic import open_file
from ..errors import CacheDirError, StokerError
from . import layout, paths, perms
from .handles import Handles
from .policy import JobRegistry

log = logging.getLogger(__name__)

_REVIVED: set[tuple[str, int]] = set()  # (cache root, pid) that logged a revival


class CacheDir:
    """The cache directory ``root`` (absolute) with file mode ``mode``, made (or checked) now.

    Picklable: a copy in another process opens its own descriptors and keeps the job's owner
    (the pid of the process that opened the cache). Raises
    :class:`~stoker.errors.CacheUnwritableError` (a read-only filesystem, no permission),
    :class:`~stoker.errors.UnsafePathError` and :class:`~stoker.errors.CacheModeError`, each naming
    ``root`` (:meth:`make`).
    """

    def __init__(self, root: str, mode: int):
        self.root, self.mode = root, mode
        self.jobs = JobRegistry(root, mode)
        self.owner_pid = os.getpid()  # the job that opened the cache (kept by pickling)
        self.generation = 0  # how many times this process made the directory again
        self._handles: Handles | None = None  # this process's open descriptors (see local)
        self._made: set[str] = set()  # namespace directories made by this process
        self._announced: dict[str, tuple[int, float | None]] = {}  # jobs announced, made again on a revival
        self._mutex = threading.Lock()
        paths.check_root_path(root)  # a clear error naming root when a file is in the way
        self.make()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = None  # descriptors are per process
        state["_made"] = set()
        del state["_mutex"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._mutex = threading.Lock()

    def make(self) -> None:
        """Create (or check) the root and the cache's own directories, mark it, and try one write
        (the budget lock file), so that a directory that cannot be written is reported now, once,
        by name. Raises :class:`~stoker.errors.CacheUnwritableError` (a read-only filesystem, no
        permission), :class:`~stoker.errors.UnsafePathError`, :class:`~stoker.errors.CacheModeError`."""
        try:
            perms.open_root(self.root, self.mode)
            perms.ensure_dir(os.path.join(self.root, ".locks"), self.mode, parents=False)
            perms.ensure_dir(os.path.join(self.root, ".usage"), self.mode, parents=False)
            layout.mark_root(self.root, self.mode)
            os.close(open_file(os.path.join(self.root, ".lock"), os.O_CREAT | os.O_RDWR, self.mode))
        except OSError as exc:
            if isinstance(exc, StokerError) or exc.errno not in paths.UNWRITABLE_ERRNOS:
                raise  # UnsafePathError, CacheModeError: already named
            raise paths.unwritable_root(self.root, exc) from exc

    def local(self) -> Handles:
        """This process's open descriptors of the cache (:mod:`.handles`; new after a fork)."""
        h = self._handles
        if h is None or h.pid != os.getpid():
            h = self._handles = Handles.for_pid(h, self.root, self.mode)
        return h

    def close(self) -> None:
        """Close the descriptors this process keeps open (opened again when needed)."""
        if self._handles is not None and self._handles.pid == os.getpid():
            self._handles.close()

    def ensure_ns(self, namespace: str) -> None:
        """Make the directory of ``namespace`` (once per process and revival)."""
        if namespace not in self._made:
            perms.ensure_dir(layout.ns_dir(self.root, namespace), self.mode, parents=False)
            self._made.add(namespace)

    def announce(self, namespace: str, dataset_bytes: int, epoch_s: float | None) -> None:
        """Record this process's job on ``namespace`` (bytes; epoch seconds or None) in the job
        registry, and again after every revival. FileNotFoundError when the directory is gone."""
        self._announced[namespace] = (int(dataset_bytes), epoch_s)
        self.jobs.register(namespace, dataset_bytes, epoch_s)

    def revive(self) -> None:
        """Start again after the cache's files went away under this process (its directory removed
        by a tmp cleaner or a colleague's ``rm -rf`` while a job runs, or only its lock files):
        drop every descriptor this process keeps (they are of unlinked files, which no other
        process sees), make the directory and its bookkeeping again if they are gone, and announce
        this job again. The blocks that went with it are read from the origin again, counted as
        misses. Logged once per process and directory. Raises what :meth:`make` raises."""
        with self._mutex:
            old, self._handles = self._handles, None
            if old is not None and old.pid == os.getpid():
                old.close()
            self._made = set()
            self.generation += 1
            if not layout.is_whole(self.root):
                layout.wait_removed(self.root)  # an rm -rf still walking it: let it finish first
            if not layout.is_whole(self.root):
                if (self.root, os.getpid()) not in _REVIVED:
                    _REVIVED.add((self.root, os.getpid()))
                    log.warning(
                        "cache directory %s was removed while this job ran: made again (its blocks are read "
                        "from the origin again)",
                        self.root,
                    )
                self.make()
            # the job's record went with the directory: without it the policy admits nothing of the
            # job's dataset; whichever of the job's processes gets here first writes it again
            live = {(r.get("namespace"), r.get("pid")) for r in self.jobs.records()}
            for ns, (nbytes, epoch_s) in list(self._announced.items()):
                if (ns, self.owner_pid) not in live:
                    try:
                        self.jobs.register(ns, nbytes, epoch_s, pid=self.owner_pid)
                    except OSError as exc:
                        log.debug("could not announce the job on %s again: %s", self.root, exc)

    def again(self, fn):
        """``fn()``, or, when a file of the cache's own went away under it (FileNotFoundError: the
        directory removed while it ran), ``fn()`` again once the cache is revived
        (:meth:`revive`); a second such failure is :meth:`gone`."""
        try:
            return fn()
        except FileNotFoundError as exc:
            if isinstance(exc, StokerError):
                raise
        self.revive()
        try:
            return fn()
        except FileNotFoundError as again:
            if isinstance(again, StokerError):
                raise
            raise self.gone(again) from again

    def gone(self, exc: BaseException) -> CacheDirError:
        """The error of a cache directory that keeps going away under this job (made again, gone
        again before its next use)."""
        return CacheDirError(
            errno.ENOENT,
            f"cache directory {self.root} was removed while this job ran and is gone again after it was "
            f"made again ({exc}): give the job a directory that nothing else deletes (cache_dir, "
            "STOKER_CACHE_DIR)",
            self.root,
        )
