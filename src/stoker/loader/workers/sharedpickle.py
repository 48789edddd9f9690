"""The dataset sent to workers started by spawn or forkserver, its large arrays in one shared file.

A worker started by fork shares the training process's pages of the dataset: the index's
arrays, its keys, the block map. One started by spawn or forkserver receives the dataset
pickled, a private copy of every array in each worker (58 MB per million small samples).
:func:`share` pickles the dataset once for all of them: each numpy array and Arrow buffer
of at least :data:`MIN_SHARED_BYTES` is written into one file in shared memory
(:func:`stoker.loader.shm.shm_base`) and only its place goes into the pickle
(``pickle.Pickler.reducer_override``); each worker maps the file read-only when it unpickles
(:meth:`SharedPickle.load`), so every worker reads the same pages.

The file follows the batch slots' rules (:mod:`stoker.loader.shm`): its pages are reserved
first (``posix_fallocate``: on a full ``/dev/shm`` the dataset goes to each process as its own
copy, as before); it is unlinked at once where workers can open it through the training
process's descriptor (``/proc/<pid>/fd/<n>``), else named ``stoker-<pid>-...``, removed by
:meth:`SharedPickle.close` or the object's finalizer, or after a SIGKILL by the next loader
(:func:`stoker.loader.shm.remove_orphans`). The memory is freed when the training process has
closed the file and the last worker has let go of its mapping.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import mmap
import os
import pickle
import uuid
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

from ..shm import shm_base, unlink_to_descriptor

__all__ = ["MIN_SHARED_BYTES", "SharedPickle", "share"]

#: Arrays and buffers smaller than this (bytes) stay in the pickle.
MIN_SHARED_BYTES = 1 << 16
_ALIGN = 64
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)
log = logging.getLogger(__name__)


def share(obj: Any) -> SharedPickle | None:
    """``obj`` pickled for processes started by spawn or forkserver with its large arrays in one
    shared file (the module docstring), or None where nothing would be shared: no array large
    enough, no file or no room for it in the shared-memory directory, or an object that pickles
    only while a process is being started (``multiprocessing``'s locks and values). Given None,
    the caller sends ``obj`` itself, pickled by ``multiprocessing`` as before: a copy per process."""
    fd, path, name = _create()
    if fd is None:
        return None
    pieces: list[tuple[int, memoryview]] = []
    try:
        data = _dumps(obj, path, pieces)
        total = _fill(fd, pieces) if pieces else 0
    except Exception as exc:  # noqa: BLE001 - the plain way still works (or fails with its own error)
        log.debug("the dataset goes to each process as its own copy: %s: %s", type(exc).__name__, exc)
        total = 0
    if not total:
        _release(fd, name, os.getpid())
        return None
    return SharedPickle(data, total, fd, name)


class SharedPickle:
    """An object pickled by :func:`share`: the pickle's bytes (``data``), the bytes of its arrays
    in the shared file (``shared_bytes``). Picklable itself (the bytes name the file's path);
    :meth:`load` in a worker gives the object back, :meth:`close` in the training process lets the
    file go (``fd``: its descriptor; ``name``: its name while it has one)."""

    def __init__(self, data: bytes, shared_bytes: int, fd: int, name: str | None) -> None:
        self.data, self.shared_bytes = data, shared_bytes
        # the file goes at close, when this object is dropped, or at the interpreter's exit
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _release, fd, name, os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "shared_bytes": self.shared_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finalizer = None  # the file is the training process's, not this worker's

    def load(self) -> Any:
        """The object (in a worker): its shared arrays map the file, read-only."""
        return pickle.loads(self.data)

    def close(self) -> None:
        """Let the file go (the training process, once its workers have ended). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()


def _fill(fd: int, pieces: list[tuple[int, memoryview]]) -> int:
    """Write ``pieces`` into the file; the bytes written, or 0 when its filesystem has no room."""
    total = pieces[-1][0] + len(pieces[-1][1])
    try:
        os.posix_fallocate(fd, 0, total)  # every page reserved now: ENOSPC here, not SIGBUS in a worker
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            return 0
        raise
    for offset, view in pieces:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    return total


def _create() -> tuple[int | None, str, str | None]:
    """(descriptor, the path workers open, the name to unlink at close or None once unlinked);
    (None, "", None) where no file can be made."""
    name = os.path.join(shm_base(), f"stoker-{os.getpid()}-{uuid.uuid4().hex[:12]}-dataset")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None, "", None
    path = unlink_to_descriptor(fd, name)
    return (fd, path, None) if path is not None else (fd, name, name)


def _release(fd: int | None, name: str | None, pid: int) -> None:
    if os.getpid() != pid:  # a forked child's copy of the object: the file is its parent's
        return
    if name is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _dumps(obj: Any, path: str, pieces: list[tuple[int, memoryview]]) -> bytes:
    """``obj`` pickled with each large array or buffer replaced by its place in the file at
    ``path``; ``pieces`` gets ``(offset, bytes)`` of each, in file order."""

    def place(view: memoryview) -> int:
        end = pieces[-1][0] + len(pieces[-1][1]) if pieces else 0
        offset = -(-end // _ALIGN) * _ALIGN
        pieces.append((offset, view))
        return offset

    class Pickler(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if type(o) is np.ndarray and o.nbytes >= MIN_SHARED_BYTES and not o.dtype.hasobject:
                c = np.ascontiguousarray(o)
                return _array, (path, place(c.data.cast("B")), c.dtype.str, c.shape)
            if isinstance(o, pa.Buffer) and o.size >= MIN_SHARED_BYTES:
                return _buffer, (path, place(memoryview(o)), o.size)
            return NotImplemented

    out = io.BytesIO()
    Pickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


_maps: dict[str, mmap.mmap] = {}  # (in a worker) the shared files mapped, by path


def _mapping(path: str) -> mmap.mmap:
    mm = _maps.get(path)
    if mm is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = _maps[path] = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    return mm


def _array(path: str, offset: int, dtype: str, shape: tuple) -> np.ndarray:
    """A shared array in a worker: a read-only view of the mapped file."""
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(_mapping(path), np.dtype(dtype), count, offset).reshape(shape)


def _buffer(path: str, offset: int, size: int) -> pa.Buffer:
    """A shared Arrow buffer in a worker: over the mapped file, not copied."""
    return pa.py_buffer(memoryview(_mapping(path))[offset : offset + size])
