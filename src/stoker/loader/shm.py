"""Shared-memory primitives of the loader: batch slots and :class:`SharedCell`.

Batch slots: workers decode straight into them, the trainer wraps them with no copy.

A slot is one file in ``/dev/shm`` (RAM-backed) mapped by the loader and by every
worker; it holds one batch: images uint8 (batch, 3, size, size) followed by
labels int64 (batch,). The loader hands the training process an array over the
slot (and a tensor over that array); the slot returns to the free list when the
last reference to that array is dropped, so a batch the user keeps is never
overwritten (the ring grows instead).

Every slot's pages are reserved (``posix_fallocate``) before anything maps them: on a full
``/dev/shm`` (Docker's default is 64 MiB) that fails with ENOSPC, where touching unreserved
pages of a mapping would kill the process with SIGBUS. When fewer slots fit than asked for,
the ring keeps what fits (at least one) and copies each batch out of its slot, so the slot is
free again at once; when not even one fits, :class:`SharedMemoryError` names the directory,
the bytes one slot needs and the bytes free. With ``shared=False`` (no worker processes) the
slots are anonymous private memory and ``/dev/shm`` is not used at all.

A slot's name is unlinked from ``/dev/shm`` the moment it is made, where the platform allows:
the training process keeps the file open, and every worker (the ones started later too) opens
it through that descriptor, ``/proc/<pid>/fd/<n>`` (Linux; the training process must be
dumpable, as processes are unless they changed it). The memory stays reserved and counted in
``/dev/shm`` while any process holds the file or a mapping of it, and is freed when the last one
lets go, however the processes end: a Ctrl-C, a script that never calls ``close()``, even a
SIGKILL leave no slot file behind. Where that is not possible the files keep their names and are
unlinked by :meth:`SlotRing.close`, by the ring's finalizer when it is dropped or the interpreter
exits, or, after a SIGKILL, by the next loader on the node (:func:`remove_orphans`).

A slot a device copy reads (``device="cuda"``, :mod:`stoker.loader.device.transfer`) is given
back with :meth:`SlotRing.release_after` and is free again only once the copy's event has
completed; a ring that needs a slot polls those events first and, with none free, waits for the
oldest copy rather than make another slot.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import uuid
import weakref
from collections import deque
from typing import Any

import numpy as np

from .._procs import dumpable, left_by_dead
from ..errors import SharedMemoryError  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: errno values of a reservation that failed for lack of room (tmpfs answers ENOSPC; ENOMEM
#: when the kernel cannot back the pages; EDQUOT under a quota).
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)
#: errnos of a process (or system) out of file descriptors
_NO_FDS = (errno.EMFILE, errno.ENFILE)


def shm_base() -> str:
    """The directory slot files live in: ``/dev/shm``, else ``$TMPDIR`` or ``/tmp``."""
    return SHM_DIR or os.environ.get("TMPDIR", "/tmp")


def free_bytes(path: str) -> int:
    """Bytes free to an unprivileged writer in ``path``'s filesystem (statvfs); -1 if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def slot_layout(batch_size: int, size: int) -> tuple[tuple, int, int]:
    """(image shape, image bytes, total bytes) of one slot."""
    shape = (batch_size, 3, size, size)
    img_bytes = batch_size * 3 * size * size
    return shape, img_bytes, img_bytes + 8 * batch_size


def map_slot(path: str, batch_size: int, size: int) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    """Map an existing slot file; returns (mmap, images view, labels view)."""
    shape, img_bytes, total = slot_layout(batch_size, size)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    images = np.ndarray(shape, dtype=np.uint8, buffer=mm)
    labels = np.ndarray((batch_size,), dtype=np.int64, buffer=mm, offset=img_bytes)
    return mm, images, labels


def remove_orphans(base: str | None = None) -> int:
    """Unlink slot files left by loaders that died (SIGKILL skips cleanup). Returns the count.

    Slot files are named ``stoker-<pid>-<id>-<n>``; a file of this user whose pid is not alive is
    an orphan (:func:`stoker._procs.left_by_dead`).
    """
    removed = 0
    for path, _ in left_by_dead(base or shm_base(), "stoker-"):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


class SlotRing:
    """The loader's side of the slots: create, hand out, take back, unlink.

    ``batch_size`` samples of (3, ``size``, ``size``) uint8 per slot; starts with
    ``initial`` slots and grows when every slot is held. ``shared``: slots are files in
    :func:`shm_base` that worker processes map (else anonymous memory of this process, and
    ``paths`` holds None). Not thread-safe except :meth:`release`, which only appends to a deque.

    Raises:
        SharedMemoryError: not even one slot fits in the shared-memory directory.
    """

    def __init__(
        self,
        batch_size: int,
        size: int,
        initial: int,
        *,
        shared: bool = True,
        slot_bytes: int | None = None,
        unlink_early: bool | None = None,
    ):
        self.shared = shared
        self.layout = slot_layout(batch_size, size)  #: (image shape, image bytes, total bytes) of a slot
        #: shared slots: their names are unlinked as soon as made (module docstring); None: where
        #: the platform allows it (decided with the first slot)
        self.unlinked = unlink_early
        #: generic slots (user collate, :mod:`stoker.loader.workers.batches`): bytes each slot starts with
        #: (the workers grow a slot file when a batch needs more, and :meth:`remap` follows)
        self.slot_bytes = slot_bytes
        self.base = shm_base() if shared else None
        if shared:
            remove_orphans(self.base)
        self.prefix = f"stoker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        #: per slot, what the workers open: ``/proc/<pid>/fd/<n>`` (unlinked) or the file's name
        #: in :attr:`base` (None: a private slot)
        self.paths: list[str | None] = []
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []  # the open slot files (shared slots)
        self._names: list[str] = []  # slot files still linked in the directory
        # the files go when the ring is closed, dropped, or the interpreter exits
        self._finalizer = weakref.finalize(self, _release, self._names, self._fds, os.getpid())
        self.free: deque[int] = deque()
        #: slots waiting on an event before they are free again, oldest first: (slot or None, event, kept)
        self._after: deque[tuple[int | None, Any, Any]] = deque()
        self.busy: set[int] = set()  # slots handed to worker processes, not yet answered (kept by the caller)
        #: True once the directory could not hold another slot: batches are then copied out.
        self.limited = False
        self._shortage: OSError | None = None  # SharedMemoryError, or EMFILE (_no_fds)
        for _ in range(max(1, initial)):
            i = self._create()
            if i is None:
                break
            self.free.append(i)
        if not self.paths:
            raise self.shortage()

    def _create(self) -> int | None:
        """A new slot's index, or None (and ``limited`` set) when the directory has no room."""
        i = len(self.paths)
        total = self.slot_bytes if self.slot_bytes is not None else self.layout[2]
        if not self.shared:
            self.paths.append(None)
            self._maps.append(mmap.mmap(-1, total))
            return i
        assert self.base is not None  # shared slots live in shm_base()
        path = os.path.join(self.base, f"{self.prefix}-{i}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            if exc.errno in _NO_FDS and i > 0:
                self._no_fds(i)
                return None
            raise
        self._names.append(path)
        try:
            os.posix_fallocate(fd, 0, total)  # reserve every page now: ENOSPC here, not SIGBUS later
            mm = mmap.mmap(fd, total)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            self._names.remove(path)
            if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
                self._short(total, i)
                return None
            if isinstance(exc, OSError) and exc.errno in _NO_FDS and i > 0:
                self._no_fds(i)
                return None
            raise
        self._fds.append(fd)
        if self.unlinked is None:
            self.unlinked = by_descriptor(fd)
        if self.unlinked:
            os.unlink(path)
            self._names.remove(path)
            path = f"/proc/{os.getpid()}/fd/{fd}"
        self.paths.append(path)
        self._maps.append(mm)
        return i

    def _short(self, total: int, have: int) -> None:
        """Record a failed reservation (of a shared slot: private ones do not fail); warn once."""
        assert self.base is not None
        self._shortage = SharedMemoryError(
            self.base, total, free_bytes(self.base), f" ({have} slot(s) already held by this loader)" if have else ""
        )
        if not self.limited and have > 0:
            log.warning(
                "%s is too small for more batch slots (%d bytes each, %d held, %d bytes free): "
                "continuing with %d slot(s), and batches are copied out of shared memory",
                self.base,
                total,
                have,
                self._shortage.free_bytes,
                have,
            )
        self.limited = True

    def _no_fds(self, have: int) -> None:
        """Record that the process is out of file descriptors for another slot (each holds two: its
        file and its mapping), with ``have`` slots already; warn once. Batches are then copied out
        of the slots that exist, as in a directory with no room."""
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._shortage = OSError(
            errno.EMFILE,
            f"no file descriptor left for another batch slot ({have} slots held, open-file limit "
            f"{limit}): batches kept by the training loop hold their slots (two descriptors each); "
            "keep fewer, or keep copies (tensor.clone(), array.copy()), or raise the limit (ulimit -n)",
        )
        if not self.limited:
            log.warning(
                "%s; continuing with %d slot(s), and batches are copied out of shared memory", self._shortage, have
            )
        self.limited = True

    def try_acquire(self) -> int | None:
        """A free slot index (a new slot if all are held), or None when no slot is free and the
        shared-memory directory has no room for another (then :meth:`shortage` says why)."""
        if not self.free and self._after:
            self._reclaim()
        if self.free:
            return self.free.popleft()
        return self._create()

    def acquire(self) -> int:
        """A free slot index (a new slot if all are held).

        Raises:
            SharedMemoryError: every slot is held and no other fits.
        """
        i = self.try_acquire()
        if i is None:
            raise self.shortage()
        return i

    def shortage(self) -> OSError:
        """The error of the last failed reservation (for a caller that cannot wait for a slot;
        called after :meth:`try_acquire` gave None, which only a failed reservation does): a
        :class:`~stoker.errors.SharedMemoryError`, or an ``OSError`` (EMFILE) when the process ran
        out of file descriptors."""
        assert self._shortage is not None, "no slot reservation has failed"
        return self._shortage

    def release(self, i: int) -> None:
        self.free.append(i)

    def release_after(self, i: int | None, event: Any, keep: Any = None) -> None:
        """Release slot ``i`` only once ``event`` says the work that reads it has completed (a
        device copy from the slot: ``event.query()`` True, or ``event.synchronize()`` returned).
        ``keep`` (the host tensors the copy reads) is held until then; ``i`` None: only ``keep``.
        Events are expected to complete in the order given (one stream)."""
        self._after.append((i, event, keep))

    def reap(self, wait: bool = False) -> int:
        """Release the slots whose events have completed, oldest first; ``wait``: wait for the
        oldest event first (``synchronize()``). Returns the number of entries released."""
        n = 0
        while self._after:
            i, event, _ = self._after[0]
            if wait and n == 0:
                event.synchronize()
            elif not event.query():
                break
            self._after.popleft()
            if i is not None:
                self.free.append(i)
            n += 1
        return n

    def _reclaim(self) -> None:
        """Free a slot waiting on an event, when none is free: the completed ones, else wait for
        the oldest (a copy takes far less than a batch) rather than make another slot."""
        self.reap()
        while not self.free and any(i is not None for i, _, _ in self._after):
            self.reap(wait=True)

    def drain(self) -> None:
        """Wait for every event :meth:`release_after` was given and release their slots."""
        while self._after:
            self.reap(wait=True)

    def mapping(self, i: int) -> mmap.mmap:
        """This process's current mapping of slot ``i`` (a new object after :meth:`buffer` mapped
        a grown slot again)."""
        return self._maps[i]

    def buffer(self, i: int, nbytes: int) -> np.ndarray:
        """Slot ``i`` as a uint8 array of at least ``nbytes`` (generic slots): the slot is mapped
        again first when a worker grew its file past this process's mapping."""
        mm = self._maps[i]
        if nbytes > len(mm):
            if self.paths[i] is None:  # pragma: no cover - private slots are never grown by a worker
                raise ValueError(f"slot {i} holds {len(mm)} bytes, {nbytes} asked")
            mm = self._maps[i] = mmap.mmap(self._fds[i], nbytes)  # the old mapping goes with its last view
        return np.ndarray((len(mm),), dtype=np.uint8, buffer=mm)

    def hold(self, i: int, arr: np.ndarray) -> None:
        """Release slot ``i`` once ``arr`` (a view over it) and every view of it are gone."""
        weakref.finalize(arr, self.free.append, i)

    def views(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole-slot views (images (B,3,S,S) uint8, labels (B,) int64) for writing in this process."""
        shape, img_bytes, _ = self.layout
        mm = self._maps[i]
        return (
            np.ndarray(shape, dtype=np.uint8, buffer=mm),
            np.ndarray(shape[:1], dtype=np.int64, buffer=mm, offset=img_bytes),
        )

    def batch(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of slot ``i``'s first ``n`` samples: images (n,3,S,S) uint8 (zero-copy; the
        slot is released when this array and every view of it are gone) and labels (n,) int64 (a copy).
        In a ``limited`` ring the images are a copy too and the slot is released at once."""
        shape, img_bytes, _ = self.layout
        mm = self._maps[i]
        full = np.ndarray(shape, dtype=np.uint8, buffer=mm)
        labels = np.ndarray(shape[:1], dtype=np.int64, buffer=mm, offset=img_bytes)[:n].copy()
        if self.limited:
            images = full[:n].copy()
            del full
            self.free.append(i)
            return images, labels
        weakref.finalize(full, self.free.append, i)
        return full[:n], labels

    def close(self) -> None:
        """Unlink every slot file still linked and close the files (mappings the user still holds
        stay valid until dropped; the memory is freed with the last of them). Idempotent."""
        self._finalizer()


def by_descriptor(fd: int) -> bool:
    """Whether other processes of this user can open ``fd`` (a slot file of this process) as
    ``/proc/<pid>/fd/<fd>``: procfs is there, it opens, and this process is dumpable."""
    if not dumpable():
        return False
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR))
    except OSError:
        return False
    return True


def unlink_to_descriptor(fd: int, name: str) -> str | None:
    """Where other processes of this user can open ``fd`` as ``/proc/<pid>/fd/<fd>``
    (:func:`by_descriptor`): unlink the file's ``name`` and return that path, so the file goes with
    this process's descriptor (also when the process is killed); else None, the name kept."""
    if not by_descriptor(fd):
        return None
    os.unlink(name)
    return f"/proc/{os.getpid()}/fd/{fd}"


def _release(names: list[str], fds: list[int], pid: int) -> None:
    """Unlink the slot files still linked and close the open ones (a ring's finalizer). Nothing
    in a process forked from the ring's (at its exit): the files are its parent's."""
    if os.getpid() != pid:
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    names.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class SharedCell:
    """One cell of a shared int64 array, with a ``.value`` like mp.Value (picklable to workers)."""

    def __init__(self, arr, i: int):
        self.arr, self.i = arr, i

    @property
    def value(self) -> int:
        return self.arr[self.i]

    @value.setter
    def value(self, v: int) -> None:
        self.arr[self.i] = v
