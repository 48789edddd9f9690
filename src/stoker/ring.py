"""Shared-memory batch slots: workers decode straight into them, the trainer wraps them with no copy.

A slot is one file in ``/dev/shm`` (RAM-backed) mapped by the loader and by every
worker; it holds one batch: images uint8 (batch, 3, size, size) followed by
labels int64 (batch,). The loader hands the training process an array over the
slot (and a tensor over that array); the slot returns to the free list when the
last reference to that array is dropped, so a batch the user keeps is never
overwritten (the ring grows instead).
"""
from __future__ import annotations

import mmap
import os
import uuid
import weakref
from collections import deque

import numpy as np

from .procs import pid_alive

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


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
    ``initial`` slots and grows when every slot is held. Not thread-safe except
    :meth:`release`, which only appends to a deque.
    """

    def __init__(self, batch_size: int, size: int, initial: int):
        remove_orphans()
        self.batch_size, self.size = batch_size, size
        self.prefix = f"stoker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths: list[str] = []
        self._maps: list[mmap.mmap] = []
        self.free: deque[int] = deque()
        for _ in range(initial):
            self.free.append(self._create())

    def _create(self) -> int:
        i = len(self.paths)
        _, _, total = slot_layout(self.batch_size, self.size)
        base = SHM_DIR or os.environ.get("TMPDIR", "/tmp")
        path = os.path.join(base, f"{self.prefix}-{i}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.paths.append(path)
        self._maps.append(mm)
        return i

    def acquire(self) -> int:
        """A free slot index (a new slot if all are held)."""
        return self.free.popleft() if self.free else self._create()

    def release(self, i: int) -> None:
        self.free.append(i)

    def views(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Whole-slot views (images (B,3,S,S) uint8, labels (B,) int64) for writing in this process."""
        shape, img_bytes, _ = slot_layout(self.batch_size, self.size)
        mm = self._maps[i]
        return (np.ndarray(shape, dtype=np.uint8, buffer=mm),
                np.ndarray((self.batch_size,), dtype=np.int64, buffer=mm, offset=img_bytes))

    def batch(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of slot ``i``'s first ``n`` samples: images (n,3,S,S) uint8 (zero-copy; the
        slot is released when this array and every view of it are gone) and labels (n,) int64 (a copy)."""
        shape, img_bytes, _ = slot_layout(self.batch_size, self.size)
        mm = self._maps[i]
        full = np.ndarray(shape, dtype=np.uint8, buffer=mm)
        labels = np.ndarray((self.batch_size,), dtype=np.int64, buffer=mm, offset=img_bytes)[:n].copy()
        weakref.finalize(full, self.free.append, i)
        return full[:n], labels

    def close(self) -> None:
        """Unlink every slot file (mappings the user still holds stay valid until dropped)."""
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
