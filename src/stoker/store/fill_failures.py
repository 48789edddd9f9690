"""What an origin error says when more than one process tried the same block.

Fills of a cache block are single flight across the processes of a node (the cache's fetch
lock): a decode worker that misses on a block the prefetcher is fetching waits for that fetch.
When the origin keeps failing, the prefetcher spends the retry budget on the block, and the
worker, whose sample read shares one budget with its wait (:meth:`stoker.storage.Origin.shared_budget`),
then makes the one try it is still owed. Its own :class:`~stoker.errors.OriginError` alone would
read "after 1 attempt(s) in 0.0 s": true of that process, untrue of the read.

So a process whose fill fails notes what was tried in the block's fetch-lock file
(:meth:`stoker.cache.DiskCache.note_fill_failure`, while it still holds the lock), and a process
whose read then fails too joins that note to its own error (:func:`after_others`): the error's
``attempts`` and ``elapsed_s`` cover every process that tried, and its ``tried`` and message
list them, e.g. ``after 4 attempt(s) in 2.0 s [the prefetcher (pid 7): 3 in 2.0 s; then
worker 0 (pid 9), having waited for it: 1 in 0.0 s]``. Its own note then carries the sum, for a
third process that waited in turn.
"""

from __future__ import annotations

import multiprocessing
import os
import time

from ..errors import OriginError


def who() -> str:
    """This process, as an error names it: ``the prefetcher (pid N)``, ``worker K (pid N)``
    (the Loader's processes, by their names), ``the main process (pid N)`` or ``process 'name' (pid N)``."""
    name = multiprocessing.current_process().name
    if name == "stoker-prefetch":
        role = "the prefetcher"
    elif name.startswith("stoker-worker-"):
        role = f"worker {name[len('stoker-worker-') :]}"
    elif name == "MainProcess":
        role = "the main process"
    else:
        role = f"process {name!r}"
    return f"{role} (pid {os.getpid()})"


def _tried(err: OriginError) -> list[tuple[str, int, float]]:
    if err.tried:
        return list(err.tried)
    return [(who(), int(err.attempts), float(err.elapsed_s or 0.0))]


def record(cache, namespace: str, name: str, err: OriginError) -> None:
    """Note in block ``name``'s fetch lock that this process's fill failed with ``err`` (call it
    holding the lock). Best effort: nothing is raised."""
    now = time.time()
    cache.note_fill_failure(
        namespace, name, {"pid": os.getpid(), "t0": now - float(err.elapsed_s or 0.0), "t1": now, "tried": _tried(err)}
    )


def after_others(cache, namespace: str, name: str, err: OriginError, since: float) -> OriginError:
    """``err``, this process's failure to read from block ``name``, joined to the failed fill of the
    block that another process noted at or after ``since`` (wall-clock seconds, when this read
    began or began to wait): a new error of the same class and failure whose ``attempts``,
    ``elapsed_s`` and ``tried`` cover both. ``err`` itself when there is no such note, or when
    it already lists more than one process."""
    if err.tried and len(err.tried) > 1:
        return err
    note = cache.fill_failure(namespace, name)
    try:
        if note is None or int(note["pid"]) == os.getpid() or float(note["t1"]) < since:
            return err
        earlier = [(str(w), int(a), float(s)) for w, a, s in note["tried"]]
        first = float(note["t0"])
    except (KeyError, TypeError, ValueError):  # a note this version does not understand
        return err
    now = time.time()
    tried = earlier + _tried(err)
    first = min(first, now - float(err.elapsed_s or 0.0))
    return type(err)(
        err.url,
        err.detail,
        err.start,
        err.end,
        sum(a for _, a, _ in tried),
        code=err.code,
        status=err.status,
        elapsed_s=now - first,
        tried=tried,
    )


def fetch(reader, b: int, name: str, since: float, first_source=None) -> bytes:
    """``reader.fetch_block(b, first_source)`` (a :class:`stoker.store.blocks.BlockReader`) for a fill holding
    block ``b``'s fetch lock (``name``: its cache name; ``since``: when this process began to wait
    for the lock). On an :class:`OriginError` the failure is noted in the lock for the processes
    waiting on it (:func:`record`), joined to the failed fetch this one waited for, if any
    (:func:`after_others`), and raised."""
    try:
        return reader.fetch_block(b, first_source)
    except OriginError as exc:
        ds = reader.dataset
        err = after_others(ds.cache, ds.version, name, exc, since)
        record(ds.cache, ds.version, name, err)
        if err is exc:
            raise
        raise err from exc.__cause__
