"""Every public error stoker raises, with one base class.

Each error derives from :class:`StokerError` and also keeps the builtin base it always had, so
``except OSError`` or ``except ValueError`` written against older stoker still catches it::

    StokerError (Exception)
    ├── OriginError (OSError)                 a read or write against the origin failed
    │   ├── OriginNotFoundError (FileNotFoundError)    the object does not exist; not retried
    │   └── OriginPermissionError (PermissionError)    the request was denied; not retried
    ├── ChecksumError (OSError)               sample bytes differ from the index
    ├── DatasetChangedError (OSError)         shards at the origin differ from the index
    ├── PeerUnavailable (OSError)             a peer's cache service did not answer
    ├── SharedMemoryError (OSError)           /dev/shm cannot hold one batch slot (ENOSPC)
    ├── PackLeaseLostError (OSError)          another pack took the destination over while this one wrote
    ├── PackLeaseError (FileExistsError)      another pack is writing the destination
    ├── DatasetExistsError (FileExistsError)  the destination already holds a dataset
    ├── CacheLockTimeout (TimeoutError)       waited too long for another process's fill
    ├── IndexFormatError (ValueError)         the index is missing, unreadable or inconsistent
    ├── SourceError (ValueError)              a pack source is malformed (layout, keys, labels, spec)
    │   └── SourceArchiveError (TarError)      a source archive is not a readable tar file
    ├── SourceNotFoundError (FileNotFoundError)  a pack source, or a file it names, does not exist
    ├── NotACacheError (ValueError)           a directory is not a stoker cache
    ├── NotADatasetError (TypeError)          a Loader was given a torch dataset, not a stoker Dataset
    ├── CacheModeError (ValueError)           a cache made under one file mode opened with another
    ├── UnsafePathError (PermissionError)     a cache path is a symlink, another user's, or writable by others
    ├── CacheDirError (NotADirectoryError)    the cache directory is a file, or lies under one
    ├── CacheUnwritableError (PermissionError)  the cache directory cannot be written (read-only, no permission)
    ├── DecodeError (ValueError)              a sample's bytes could not be decoded
    │   └── ImageTooLarge                     the header declares more than ``max_pixels``
    ├── EntryError (ValueError)               a derived-cache entry is damaged
    ├── CollateError (ValueError)             a batch's samples cannot be collated (names its position)
    ├── SampleFnError (ValueError)            the user's decode/collate failed on a sample (names its key)
    ├── CacheInUseError (RuntimeError)        a cache is in use by a live job
    ├── CapacityError (RuntimeError)          a cluster job's ranks do not fit the nodes' free resources
    ├── ServiceStartError (RuntimeError)      a node's cache service could not start
    ├── ProcessGroupError (RuntimeError)      a cluster job's process group cannot be set up (backend, rendezvous)
    ├── RankSetupError (RuntimeError)         a rank's cluster reads outside run(): ranks missing, or closed
    ├── WorkerError (RuntimeError)            a loader worker failed or died
    │   └── WorkerStartError                  a worker process could not start (names the cause)
    ├── StaleIteratorError (RuntimeError)     an epoch's iterator used after a later iter() replaced it
    ├── ForkUnsafeError (RuntimeError)        ``fork`` asked for in a process where it is unsafe
    └── ExtenderRequestError (ValueError)     the scheduler extender refuses a request (HTTP code)

The benchmarks' own errors (``NetnsUnavailable``, ``VenvError``) live in the lab package beside
this one: :mod:`stoker_lab.errors`.

Every message names what failed: the sample key, the shard, the path or the URL. The modules
that raise these errors re-export them under their old names (``stoker.storage.OriginError``,
``stoker.store.index.IndexError_`` and so on), so older imports keep working. This module
imports nothing from stoker: it is the lowest layer.
"""

from __future__ import annotations

import errno
import re
import tarfile
import time

__all__ = [
    "CacheDirError",
    "CacheInUseError",
    "CacheLockTimeout",
    "CacheModeError",
    "CacheUnwritableError",
    "CapacityError",
    "ChecksumError",
    "CollateError",
    "DatasetChangedError",
    "DatasetExistsError",
    "DecodeError",
    "EntryError",
    "ExtenderRequestError",
    "ForkUnsafeError",
    "ImageTooLarge",
    "IndexFormatError",
    "NotACacheError",
    "NotADataLoaderError",
    "NotADatasetError",
    "OriginError",
    "OriginNotFoundError",
    "OriginPermissionError",
    "PackLeaseError",
    "PackLeaseLostError",
    "PeerUnavailable",
    "ProcessGroupError",
    "RankSetupError",
    "SampleFnError",
    "ServiceStartError",
    "SharedMemoryError",
    "SourceArchiveError",
    "SourceError",
    "SourceNotFoundError",
    "StaleIteratorError",
    "StokerError",
    "UnsafePathError",
    "WorkerError",
    "WorkerStartError",
]


class StokerError(Exception):
    """Base class of every error stoker raises on purpose; catch it to catch them all.

    Every subclass pickles to an equal error (same class, message, errno and attributes), so
    it crosses process boundaries (multiprocessing queues, Ray) even when its ``__init__``
    takes other arguments than the ones it passes on to the builtin base.
    """

    def __reduce__(self):
        args = self.args
        if isinstance(self, OSError) and self.filename is not None:  # not kept in args
            args = (self.errno, self.strerror, self.filename, None, self.filename2)
        return (_restore, (type(self), args, dict(self.__dict__)))


def _restore(cls: type, args: tuple, state: dict) -> BaseException:
    """Rebuild a pickled :class:`StokerError` without calling its own ``__init__``: the builtin
    base it keeps (OSError, ValueError, ...) gets the ``args`` it had, then the attributes."""
    err = cls.__new__(cls, *args)
    builtin = next(b for b in cls.__mro__ if b.__module__ == "builtins")
    builtin.__init__(err, *args)  # type: ignore[misc]  # the builtin base on purpose
    err.__dict__.update(state)
    return err


# --- storage: the origin ------------------------------------------------------------------


class OriginError(StokerError, OSError):
    """A read or write against the origin failed: after retrying for the retry budget, or at once
    when the failure cannot clear.

    Attributes: ``url`` (str), ``start``/``end`` (byte range or None), ``attempts`` (int),
    ``code`` (the S3 error code such as ``SlowDown``, ``AccessDenied``, ``NoSuchKey``, or None),
    ``status`` (HTTP status or None), ``elapsed_s`` (seconds spent, retries included), ``detail``
    (the failure, without the URL and counts), ``tried`` (None, or when more than one process
    tried this read: ``[(who, attempts, seconds), ...]`` in the order they tried, e.g. the
    prefetcher's fetch of the block that a worker's read waited for, then the worker's own; then
    ``attempts`` is their sum and ``elapsed_s`` the seconds from the first one's start; the
    message lists them).
    """

    def __init__(
        self,
        url: str,
        message: str,
        start: int | None = None,
        end: int | None = None,
        attempts: int = 1,
        *,
        code: str | None = None,
        status: int | None = None,
        elapsed_s: float | None = None,
        tried: list[tuple[str, int, float]] | None = None,
    ):
        rng = f" bytes {start}-{end}" if start is not None else ""
        took = f" in {elapsed_s:.1f} s" if elapsed_s is not None else ""
        who = ""
        if tried:  # e.g. [the prefetcher (pid 7): 3 in 2.0 s; then worker 0 (pid 9), having waited for it: 1 in 0.0 s]
            who = (
                " ["
                + "; then ".join(
                    f"{w}{', having waited for it' if j else ''}: {a} in {t:.1f} s" for j, (w, a, t) in enumerate(tried)
                )
                + "]"
            )
        super().__init__(f"origin error reading {url}{rng} after {attempts} attempt(s){took}{who}: {message}")
        self.url, self.start, self.end, self.attempts = url, start, end, attempts
        self.code, self.status, self.elapsed_s = code, status, elapsed_s
        self.detail, self.tried = message, tried


class OriginNotFoundError(OriginError, FileNotFoundError):
    """The object does not exist (S3 ``NoSuchKey``/404, or a missing local file); not retried.
    Also a ``FileNotFoundError``."""


class OriginPermissionError(OriginError, PermissionError):
    """The request was denied (S3 ``AccessDenied``/403, ...); not retried. Also a ``PermissionError``."""


# --- store: packed datasets ---------------------------------------------------------------


class ChecksumError(StokerError, OSError):
    """A sample's bytes from the origin do not match the index (names key, shard and URL)."""

    #: the key of the sample at fault, when the reader that found it knows it
    key: str | None = None


class DatasetChangedError(StokerError, OSError):
    """Shards at the origin differ from what the index recorded (message names each shard)."""


class DatasetExistsError(StokerError, FileExistsError):
    """The destination already holds a packed dataset (pass overwrite=True)."""


class IndexFormatError(StokerError, ValueError):
    """The index is missing, unreadable or inconsistent (message names the URL).

    Called ``IndexError_`` before; that name stays importable from :mod:`stoker.store.index`.
    """


# --- store: pack sources -----------------------------------------------------------------


class SourceError(StokerError, ValueError):
    """A pack source is malformed: an unknown source kind or shard spec, a duplicate key, a label
    outside the class list, a name that is not UTF-8, a missing column (names the source URL and
    the file or sample key). Also a ``ValueError``."""


class SourceArchiveError(SourceError, tarfile.TarError):
    """A source archive is not a readable tar file (names the archive's URL). Also a
    ``tarfile.TarError``."""


class SourceNotFoundError(StokerError, FileNotFoundError):
    """A pack source does not exist, holds no samples, or a file it names is missing (names the
    URL). Also a ``FileNotFoundError``."""


def _utc(t) -> str:
    """A Unix time in seconds as ``YYYY-MM-DDTHH:MM:SSZ``, or ``"?"`` when unknown."""
    if not t:
        return "?"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))


class PackLeaseError(StokerError, FileExistsError):
    """Another pack is writing the destination now. Attributes: ``url`` (the destination's URL),
    ``owner`` (dict: host, pid, run, started_unix, renewed_unix, expires_unix; times in Unix
    seconds, read on the owner's clock).

    The message says who packs, since when, and when a pack that died stops blocking: its claim
    runs out by itself at ``expires_unix`` unless that pack renews it (it does every third of its
    length while it lives), and one whose process is gone from this host is taken over at once.
    ``watched``: the claim's times could not be believed on this host's clock (it had run out
    by it, or was renewed ahead of it), and it changed while this pack watched it: the message
    then says that the owner is alive and the two clocks disagree (liveness is judged by the
    claim's changes, never by comparing clocks: :mod:`stoker.store.lease`).
    """

    def __init__(self, url: str, owner: dict, watched: bool = False):
        self.url, self.owner = url, owner
        now = time.time()
        started = float(owner.get("started_unix") or 0)
        exp = float(owner.get("expires_unix") or 0)
        since = f"since {_utc(started)} ({_ago(now - started)})" if started else "since an unknown time"
        if not watched:
            when = (
                f"If that pack died, it stops blocking by itself at {_utc(exp)} (in {max(0.0, exp - now):.0f} s, "
                "unless it is alive and renews its claim); then run again."
            )
        else:
            if started:
                since = f"since {_utc(started)} by its clock"
            renewed = float(owner.get("renewed_unix") or 0)
            off = f" by about {_span(abs(now - renewed))}" if renewed else ""
            when = (
                "It is alive: it renewed its claim while this pack watched it, although its times cannot be "
                f"believed on this host's clock (the two hosts' clocks disagree{off}, or its claim had run out)."
            )
        super().__init__(
            f"{url}: another pack is writing this destination (host {owner.get('host')!r}, "
            f"pid {owner.get('pid')}, run {owner.get('run')}), {since}. Wait for it to finish, or pack "
            f"somewhere else. {when} A pack that died on this host is taken over at once."
        )


def _span(seconds: float) -> str:
    """``"42 s"``, ``"3 min"``, ``"2.5 h"``."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _ago(seconds: float) -> str:
    """``"42 s ago"``, ``"3 min ago"``, ``"2.5 h ago"``."""
    return f"{_span(seconds)} ago"


class PackLeaseLostError(StokerError, OSError):
    """This pack's claim on the destination was taken over or removed while it was writing
    (another pack saw it unchanged for the claim's length: this process was frozen, or the store
    unreachable, that long): it stops before installing an index. The message names the
    destination, the new owner, if any, and how long before its last renewal had been."""


# --- cache: the node cache ----------------------------------------------------------------


class CacheLockTimeout(StokerError, TimeoutError):
    """Waited longer than the timeout for another process's fill of a block."""


class NotACacheError(StokerError, ValueError):
    """The directory is not a stoker cache (no marker) and holds none; the message names it."""


class CacheModeError(StokerError, ValueError):
    """A cache directory made under one file mode (``cache_mode``) is opened with another; the
    message names the directory and both modes. Nothing is read or written there."""


class UnsafePathError(StokerError, PermissionError):
    """A cache, staging or shared-memory path that stoker would write through is a symlink, a
    non-directory, owned by another user or writable by others; the message names the path."""


class CacheDirError(StokerError, NotADirectoryError):
    """The cache directory given (or one of its parents) is a file; the message names both."""


class CacheUnwritableError(StokerError, PermissionError):
    """The cache directory (or one it needs: a parent, the memory tier's) cannot be created or
    written: a read-only filesystem (``errno`` EROFS) or no permission (EACCES, EPERM). The
    message names the directory, the path that failed and why, and the ways out (a writable
    ``cache_dir``, ``cache=False``, or ``CacheOptions(cache_read_only=True)`` for a cache filled earlier)."""

    def __init__(self, root: str, why: str, err_no: int = errno.EACCES):
        super().__init__(
            err_no,
            f"cache directory {root} cannot be written ({why}): pass a writable directory as cache_dir "
            "(or set STOKER_CACHE_DIR), or read without a cache (cache=False); a cache filled earlier "
            "(a pre-warmed image mounted read-only) is served as it is with cache=CacheOptions(cache_read_only=True)",
            root,
        )


class CacheInUseError(StokerError, RuntimeError):
    """A cache (or one dataset in it) is in use by a live job; the message names its pid."""


# --- decode -------------------------------------------------------------------------------


class DecodeError(StokerError, ValueError):
    """A sample's bytes could not be decoded to an RGB image.

    Attributes:
        key: the sample key (str) the bytes belong to.
        reason: human-readable cause (str).
    """

    def __init__(self, key: str, reason: str):
        self.key = key
        # Pillow names the in-memory file it was given ("<_io.BytesIO object at 0x...>"): the
        # sample key says which bytes these were
        self.reason = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "(the sample's bytes)", reason)
        super().__init__(f"cannot decode sample {key!r}: {self.reason}")


class ImageTooLarge(DecodeError):
    """The image header declares more pixels (width * height) than ``max_pixels``."""


class EntryError(StokerError, ValueError):
    """A derived entry is damaged (short, wrong magic/kind/size, checksum mismatch)."""


# --- the user's decode and collate (stoker.loader.workers.batches, stoker.collate) ----------------


class CollateError(StokerError, ValueError):
    """A batch's samples cannot be collated. ``index``: the position in the batch of the sample
    at fault (the Loader turns it into the sample's key); ``what``: what was wrong."""

    def __init__(self, index: int, what: str):
        super().__init__(f"sample {index} of the batch: {what}")
        self.index, self.what = index, what


class SampleFnError(StokerError, ValueError):
    """The user's ``decode`` or ``collate`` failed on a sample, or returned what cannot be used;
    ``key`` names the sample (None when a whole batch failed: the message names its keys)."""

    def __init__(self, key, msg: str):
        super().__init__(msg)
        self.key = key


# --- loader and processes -----------------------------------------------------------------


class WorkerError(StokerError, RuntimeError):
    """A worker failed or died; the message names the worker and the sample key."""


class WorkerStartError(WorkerError):
    """A worker (or the prefetch process) exited before its own start was done; it is not
    restarted. The message names the cause: the main script run again by a spawn/forkserver
    child (no ``if __name__ == "__main__":`` guard), a ``__main__`` such a child cannot import,
    or the child's own error."""


class StaleIteratorError(StokerError, RuntimeError):
    """An epoch's iterator was used after a later ``iter()`` on the same Loader ended its epoch
    (a Loader serves one epoch at a time); the message names both epochs."""


class NotADataLoaderError(StokerError, AttributeError):
    """A training framework tried to rebuild a Loader as a ``torch.utils.data.DataLoader`` (it
    iterated the Loader's ``batch_sampler``, which only describes the batches stoker draws
    itself: accelerate's ``skip_first_batches``); the message names the stoker call to use
    instead. Also an AttributeError, as frameworks expect of a part a data loader lacks."""


class NotADatasetError(StokerError, TypeError):
    """A Loader was given a torch dataset (a ``torch.utils.data.Subset`` over a stoker Dataset, or
    any other ``torch.utils.data.Dataset``) instead of a packed stoker Dataset; the message says
    what to pass instead. Also a TypeError: the argument is of the wrong kind."""


class ForkUnsafeError(StokerError, RuntimeError):
    """``start_method="fork"`` was asked for in a process whose threads make fork unsafe; the
    message names the threads (or the library) found."""


class SharedMemoryError(StokerError, OSError):
    """The shared-memory directory cannot hold one batch slot (errno ENOSPC).

    Attributes: ``path`` (the directory, e.g. ``/dev/shm``), ``needed_bytes`` (one slot),
    ``free_bytes`` (free in that directory's filesystem when the reservation failed).
    """

    def __init__(self, path: str, needed_bytes: int, free_bytes: int, detail: str = ""):
        self.needed_bytes, self.free_bytes = int(needed_bytes), int(free_bytes)
        super().__init__(
            errno.ENOSPC,
            f"{path} has {free_bytes} bytes free but one batch slot needs {needed_bytes} bytes"
            f"{detail}: give the container a larger {path} (docker run --shm-size, a Kubernetes "
            "emptyDir with medium Memory), or lower batch_size / image_size, or use num_workers=0 "
            "(no shared memory)",
            path,
        )


# --- cluster ---------------------------------------------------------------


class PeerUnavailable(StokerError, OSError):
    """A peer's cache service did not answer (dead, restarting, or timed out)."""


class CapacityError(StokerError, RuntimeError):
    """A cluster job's ranks do not fit in the nodes' free resources now (the message gives what a
    rank asks for and, per node, what is free); nothing of the job was started."""


class ServiceStartError(StokerError, RuntimeError):
    """A node's cache service could not start: its constructor raised (e.g. the node's cache
    directory is unusable), so Ray does not restart it; the message names the node and why."""


class ProcessGroupError(StokerError, RuntimeError):
    """A cluster job's ``torch.distributed`` process group cannot be set up: the backend needs
    what the ranks lack (``nccl`` without a GPU), rank 0 did not publish its address in time,
    or a group is already open on the rank; the message names the backend and the rank."""


class RankSetupError(StokerError, RuntimeError):
    """A rank's cluster reads set up outside ``stoker.cluster.run``
    (:func:`stoker.cluster.rank_context`) failed or are closed: the job's ranks did not all report
    within the timeout, rank 0 could not place the dataset, the dataset changed between the ranks,
    or the rank's reads were closed; the message names the job, the ranks or the URL."""


class ExtenderRequestError(StokerError, ValueError):
    """A scheduler-extender request the server refuses; ``code`` is the HTTP status (400, 404,
    411, 413). Also importable as ``stoker.cluster.extender.scoring.BadRequest``."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code
