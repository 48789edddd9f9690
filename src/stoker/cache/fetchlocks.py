"""Fetch locks of a node cache: one fill of a block at a time, across threads and processes
(single flight), and a note of the last fill that failed for those that waited for it.

Locks are striped over :data:`STRIPES` files ``<root>/.locks/NNNN`` (``flock``), kept open per
process (:mod:`.handles`); a stripe file's bytes hold the note of the last failed fill under it
(JSON naming the block, so a note of another block on the same stripe is not taken for this one's).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from contextlib import contextmanager

import xxhash

from .._atomic import open_file
from ..errors import CacheLockTimeout
from . import perms
from .cachedir import CacheDir
from .handles import wait_flock

log = logging.getLogger(__name__)

# Fetch locks are striped over this many lock files.  Two blocks on one stripe serialise their
# fills, and a prefetch that finds a stripe taken must come back later: with 8 fills in flight
# and 256 stripes, about 3% of fills collided (bench cache, C = 0.1 D); 4096 makes that 0.2%.
STRIPES = 4096


def stripe_of(namespace: str, name: str) -> int:
    """The stripe (``0..STRIPES-1``) of block ``name`` of ``namespace``."""
    return xxhash.xxh3_64_intdigest(f"{namespace}/{name}".encode()) % STRIPES


class FetchLocks:
    """The fetch locks under ``cache_dir`` (a :class:`stoker.cache.cachedir.CacheDir`).

    ``lock_timeout_s``: longest wait in seconds for another fill of a block before
    :class:`~stoker.errors.CacheLockTimeout`. Picklable.
    """

    def __init__(self, cache_dir: CacheDir, lock_timeout_s: float):
        self.dir = cache_dir
        self.lock_timeout_s = lock_timeout_s

    def stripe(self, namespace: str, name: str) -> str:
        """The fetch-lock file of block ``name`` (one of :data:`STRIPES`, shared by many blocks)."""
        return os.path.join(self.dir.root, ".locks", f"{stripe_of(namespace, name):04d}")

    def note_fill_failure(self, namespace: str, name: str, note: dict) -> None:
        """Record that a fill of block ``name`` failed: ``note`` (JSON-able; what was tried) is
        written into the block's fetch-lock file, for the processes that waited for that fill
        (:meth:`fill_failure`). Call it holding :meth:`fetch_lock` of the block. Best effort:
        an OSError is logged at debug level, never raised."""
        data = json.dumps({"block": f"{namespace}/{name}", **note}).encode()
        try:
            fd = open_file(self.stripe(namespace, name), os.O_CREAT | os.O_RDWR, self.dir.mode)
            try:
                os.pwrite(fd, data, 0)  # then cut: a reader in between parses the first object only
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("could not note the failed fill of %s/%s: %s", namespace, name, exc)

    def fill_failure(self, namespace: str, name: str) -> dict | None:
        """The note of the last failed fill of block ``name`` (:meth:`note_fill_failure`, any
        process), or None: none noted, the lock's last note is of another block, or unreadable."""
        try:
            fd = open_file(self.stripe(namespace, name), os.O_RDONLY)
            try:
                raw = os.pread(fd, 1 << 16, 0)
            finally:
                os.close(fd)
            note, _ = json.JSONDecoder().raw_decode(raw.decode())
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) and note.get("block") == f"{namespace}/{name}" else None

    @contextmanager
    def fetch_lock(self, namespace: str, name: str, blocking: bool = True):
        """Single-flight lock for one block, across threads and processes.

        Yields True when held. With ``blocking=False`` yields False at once if another
        fill holds it. Blocking waits block (a thread lock within the process, one blocking
        ``flock`` in a helper thread across processes: :func:`.handles.wait_flock`) for up to
        ``lock_timeout_s`` and then raise :class:`CacheLockTimeout` (never a hang); the waiter
        wakes when the holder lets go, not on a polling tick. A holder killed with SIGKILL
        releases the lock (the kernel drops flocks of closed files). The stripe's file stays
        open in the process between uses (:mod:`.handles`). A lock directory removed under the
        job makes the cache directory again first (:meth:`stoker.cache.cachedir.CacheDir.revive`).
        """
        h = self.dir.local()
        k = stripe_of(namespace, name)
        path = self.stripe(namespace, name)
        deadline = time.monotonic() + self.lock_timeout_s
        tlock = h.stripe_lock(k)
        if not tlock.acquire(blocking, self.lock_timeout_s if blocking else -1):
            if not blocking:
                yield False
                return
            raise self._timeout(namespace, name)
        fd: int | None = None
        locked = False
        try:
            try:
                fd = h.take_stripe(k, path)
            except FileNotFoundError:  # .locks/ went away with the directory: make it again
                self.dir.revive()
                perms.ensure_dir(os.path.dirname(path), self.dir.mode, parents=False)
                fd = h.take_stripe(k, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if not locked:
                if not blocking:
                    yield False
                    return
                if not wait_flock(fd, deadline - time.monotonic()):
                    fd = None  # the waiting helper thread owns it now (closes it)
                    raise self._timeout(namespace, name)
                locked = True
            yield True
        finally:
            if fd is not None:
                if locked:
                    # Unlock explicitly: a process forked while this thread held the lock has a copy
                    # of the descriptor, and closing ours alone would leave the lock held until
                    # that child exits (seen as a block "busy" forever in the prefetcher).
                    fcntl.flock(fd, fcntl.LOCK_UN)
                h.give_stripe(k, fd)
            tlock.release()

    def _timeout(self, namespace: str, name: str) -> CacheLockTimeout:
        return CacheLockTimeout(
            f"waited {self.lock_timeout_s:.0f} s for the fill of {namespace}/{name} in {self.dir.root}"
        )
