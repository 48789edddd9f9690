"""The dataset sent to workers started by spawn or forkserver, its large arrays in one shared file.

A worker started by fork shares the training process's pages of the dataset: the index's
arrays, its keys, the block map. One started by spawn or forkserver receives the dataset
pickled, a private copy of every array in each worker (58 MB per million small samples).
:class:`SharedPickle` pickles the dataset once for all of them: each numpy array and Arrow buffer
of at least :data:`MIN_SHARED_BYTES` is written into one file in shared memory
(:func:`stoker.loader.shm.shm_base`) and only its place goes into the pickle
(``pickle.Pickler.reducer_override``); each worker maps the file read-only when it unpickles
(:meth:`SharedPickle.load`), so every worker reads the same pages.

The file follows the batch slots' rules (:mod:`stoker.loader.shm`): its pages are reserved
first (``posix_fallocate``: a full ``/dev/shm`` gives the plain pickle instead, the sharing
lost, nothing else); it is unlinked at once where workers can open it through the training
process's descriptor (``/proc/<pid>/fd/<n>``), else named ``stoker-<pid>-...``, removed by
:meth:`SharedPickle.close` or the object's finalizer, or after a SIGKILL by the next loader
(:func:`stoker.loader.shm.remove_orphans`). The memory is freed when the training process has
closed the file and the last worker has let go of its mapping.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
import pickle
import uuid
import weakref
from typing import Any

import numpy as np
import pyarrow as pa

from ..shm import by_descriptor, shm_base

__all__ = ["MIN_SHARED_BYTES", "SharedPickle"]

#: Arrays and buffers smaller than this (bytes) stay in the pickle.
MIN_SHARED_BYTES = 1 << 16
_ALIGN = 64
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT)


class SharedPickle:
    """``obj`` pickled for processes started by spawn or forkserver, its large arrays in one
    shared file (see the module docstring). Picklable itself (the pickle's bytes and the file's
    path); :meth:`load` in the worker gives the object back, :meth:`close` in the training process
    lets the file go. ``shared_bytes``: bytes in the file (0: the plain pickle, nothing shared)."""

    def __init__(self, obj: Any) -> None:
        self.shared_bytes = 0
        fd, path, name = _create()
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _release, fd, name, os.getpid())
        if fd is not None:
            pieces: list[tuple[int, memoryview]] = []
            self.data = _dumps(obj, path, pieces)
            if pieces and self._fill(fd, pieces):
                return
        self._finalizer()  # nothing shared: no file
        self.data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)

    def _fill(self, fd: int, pieces: list[tuple[int, memoryview]]) -> bool:
        """Write ``pieces`` into the file; False when its filesystem has no room for them."""
        total = pieces[-1][0] + len(pieces[-1][1])
        try:
            os.posix_fallocate(fd, 0, total)  # every page reserved now: ENOSPC here, not SIGBUS in a worker
            for offset, view in pieces:
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            if exc.errno in _NO_ROOM:
                return False
            raise
        self.shared_bytes = total
        return True

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


def _create() -> tuple[int | None, str, str | None]:
    """(descriptor, the path workers open, the name to unlink at close or None once unlinked);
    (None, "", None) where no file can be made."""
    name = os.path.join(shm_base(), f"stoker-{os.getpid()}-{uuid.uuid4().hex[:12]}-dataset")
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None, "", None
    if by_descriptor(fd):
        os.unlink(name)
        return fd, f"/proc/{os.getpid()}/fd/{fd}", None
    return fd, name, name


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
