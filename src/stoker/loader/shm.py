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
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import uuid
import weakref
from collections import deque

import numpy as np

from .._procs import pid_alive
from ..errors import SharedMemoryError  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: errno values of a reservation that failed for lack of room (tmpfs answers ENOSPC; ENOMEM
#: when the kernel cannot back the pages; EDQUOT under a quota).
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)


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

    Slot files are named ``stoker-<pid>-<id>-<n>``; a file whose pid is not alive is an orphan.
    """
    base = base or SHM_DIR or os.environ.get("TMPDIR", "/tmp")
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "stoker" or not parts[1].isdigit():
            continue
        if pid_alive(int(parts[1])):
            continue
        try:
            os.unlink(os.path.join(base, name))
            removed += 1
        except OSError:
            pass
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

    def __init__(self, batch_size: int, size: int, initial: int, *, shared: bool = True, slot_bytes: int | None = None):
        self.batch_size, self.size, self.shared = batch_size, size, shared
        #: generic slots (user collate, :mod:`stoker.loader.batches`): bytes each slot starts with
        #: (the workers grow a slot file when a batch needs more, and :meth:`remap` follows)
        self.slot_bytes = slot_bytes
        self.base = shm_base() if shared else None
        if shared:
            remove_orphans(self.base)
        self.prefix = f"stoker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths: list[str | None] = []
        self._maps: list[mmap.mmap] = []
        self.free: deque[int] = deque()
        self.busy: set[int] = set()  # slots handed to worker processes, not yet answered (kept by the caller)
        #: True once the directory could not hold another slot: batches are then copied out.
        self.limited = False
        self._shortage: SharedMemoryError | None = None
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
        total = self.slot_bytes if self.slot_bytes is not None else slot_layout(self.batch_size, self.size)[2]
        if not self.shared:
            self.paths.append(None)
            self._maps.append(mmap.mmap(-1, total))
            return i
        assert self.base is not None  # shared slots live in shm_base()
        path = os.path.join(self.base, f"{self.prefix}-{i}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)  # reserve every page now: ENOSPC here, not SIGBUS later
            except OSError as exc:
                if exc.errno not in _NO_ROOM:
                    raise
                os.close(fd)
                fd = -1
                os.unlink(path)
                self._short(total, i)
                return None
            mm = mmap.mmap(fd, total)
        finally:
            if fd >= 0:
                os.close(fd)
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

    def try_acquire(self) -> int | None:
        """A free slot index (a new slot if all are held), or None when no slot is free and the
        shared-memory directory has no room for another (then :meth:`shortage` says why)."""
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

    def shortage(self) -> SharedMemoryError:
        """The error of the last failed reservation (for a caller that cannot wait for a slot;
        called after :meth:`try_acquire` gave None, which only a failed reservation does)."""
        assert self._shortage is not None, "no slot reservation has failed"
        return self._shortage

    def release(self, i: int) -> None:
        self.free.append(i)

    def buffer(self, i: int, nbytes: int) -> np.ndarray:
        """Slot ``i`` as a uint8 array of at least ``nbytes`` (generic slots): the slot is mapped
        again first when a worker grew its file past this process's mapping."""
        mm = self._maps[i]
        if nbytes > len(mm):
            path = self.paths[i]
            if path is None:  # pragma: no cover - private slots are never grown by a worker
                raise ValueError(f"slot {i} holds {len(mm)} bytes, {nbytes} asked")
            fd = os.open(path, os.O_RDWR)
            try:
                mm = self._maps[i] = mmap.mmap(fd, nbytes)  # the old mapping goes with its last view
            finally:
                os.close(fd)
        return np.ndarray((len(mm),), dtype=np.uint8, buffer=mm)

    def hold(self, i: int, arr: np.ndarray) -> None:
        """Release slot ``i`` once ``arr`` (a view over it) and every view of it are gone."""
        weakref.finalize(arr, self.free.append, i)

    def views(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole-slot views (images (B,3,S,S) uint8, labels (B,) int64) for writing in this process."""
        shape, img_bytes, _ = slot_layout(self.batch_size, self.size)
        mm = self._maps[i]
        return (
            np.ndarray(shape, dtype=np.uint8, buffer=mm),
            np.ndarray((self.batch_size,), dtype=np.int64, buffer=mm, offset=img_bytes),
        )

    def batch(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of slot ``i``'s first ``n`` samples: images (n,3,S,S) uint8 (zero-copy; the
        slot is released when this array and every view of it are gone) and labels (n,) int64 (a copy).
        In a ``limited`` ring the images are a copy too and the slot is released at once."""
        shape, img_bytes, _ = slot_layout(self.batch_size, self.size)
        mm = self._maps[i]
        full = np.ndarray(shape, dtype=np.uint8, buffer=mm)
        labels = np.ndarray((self.batch_size,), dtype=np.int64, buffer=mm, offset=img_bytes)[:n].copy()
        if self.limited:
            images = full[:n].copy()
            del full
            self.free.append(i)
            return images, labels
        weakref.finalize(full, self.free.append, i)
        return full[:n], labels

    def close(self) -> None:
        """Unlink every slot file (mappings the user still holds stay valid until dropped)."""
        for p in self.paths:
            if p is None:
                continue
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


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
