"""Origin access through fsspec: ranged reads with bounded retries, whole-object writes.

Every byte stoker reads from an origin goes through :class:`Origin`, which counts
origin bytes and requests (the figures every benchmark reports) and turns storage
failures into :class:`OriginError` naming the URL and byte range after a bounded
number of attempts, so a failing store never hangs a job.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import fsspec
import fsspec.asyn

log = logging.getLogger(__name__)

#: Attempts per ranged read before :class:`OriginError` (first try included).
DEFAULT_ATTEMPTS = 4
#: First back-off in seconds; doubles after each failed attempt (0.1, 0.2, 0.4 s).
DEFAULT_BACKOFF_S = 0.1


#: Errors that another attempt cannot fix (a missing object, a denied request, a bug).
_NOT_RETRIED = (FileNotFoundError, PermissionError, TypeError, AttributeError, NameError)
#: Storage-client configuration errors (botocore's names): reported at once, not retried.
_CONFIG_ERRORS = frozenset({"ProfileNotFound", "NoCredentialsError", "PartialCredentialsError",
                            "NoRegionError", "InvalidConfigError", "UnknownConfigurationKeyError"})


class OriginError(IOError):
    """A read or write against the origin failed after all retries.

    Attributes: ``url`` (str), ``start``/``end`` (byte range or None), ``attempts`` (int).
    """

    def __init__(self, url: str, message: str, start: int | None = None,
                 end: int | None = None, attempts: int = 1):
        rng = f" bytes {start}-{end}" if start is not None else ""
        super().__init__(f"origin error reading {url}{rng} after {attempts} attempt(s): {message}")
        self.url, self.start, self.end, self.attempts = url, start, end, attempts


_INHERITED: list = []


def _forget_inherited_sessions() -> None:
    """In a forked child, detach the finalizers of s3fs sessions inherited from the parent.

    Each s3fs instance registers ``weakref.finalize(self, close_session, loop, client)``.
    In a child those belong to the parent's event loop; when fsspec drops its inherited
    instance cache they are collected, and closing them from the child's loop fails with
    "attached to a different loop" noise (or worse, touches the parent's sockets). The
    parent still owns and closes them.
    """
    import weakref
    try:
        for fin, info in list(weakref.finalize._registry.items()):  # noqa: SLF001
            if getattr(info.func, "__name__", "") == "close_session":
                owner = info.weakref()
                if owner is not None:
                    _INHERITED.append(owner)  # never collected here: no "unclosed session" noise
                fin.detach()
    except Exception:  # noqa: BLE001 - best effort; CPython internals
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_sessions)


def _s3_defaults(storage_options: dict) -> dict:
    """Bound s3fs's own retries and timeouts so that our retry loop stays in charge."""
    opts = dict(storage_options)
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", 10)
    cfg.setdefault("read_timeout", 60)
    cfg.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = cfg
    return opts


def url_to_fs(url: str, storage_options: dict | None = None):
    """Return ``(filesystem, path)`` for an fsspec URL (``s3://``, ``file://``, ``memory://``, a path)."""
    opts = dict(storage_options or {})
    proto = url.split("://", 1)[0] if "://" in url else "file"
    if proto in ("s3", "s3a"):
        opts = _s3_defaults(opts)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    if proto in ("s3", "s3a"):
        # s3fs retries throttling errors itself (5 tries, growing back-off) inside each of
        # our attempts; one retry loop, ours, keeps the total wait bounded and visible.
        fs.retries = 1
    return fs, path


def join(url: str, *parts: str) -> str:
    """Join URL path parts with '/' (fsspec URLs use '/' on every platform)."""
    out = url.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


@dataclass
class OriginCounters:
    """Bytes and requests actually received from the origin by one process."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    errors: int = 0

    def snapshot(self) -> dict:
        return {"bytes": self.bytes, "requests": self.requests,
                "retries": self.retries, "errors": self.errors}


@dataclass
class Origin:
    """Read/write access to one dataset root at an fsspec URL.

    ``url`` is the dataset root; paths given to methods are relative to it.
    ``storage_options`` are passed to fsspec (for S3: ``endpoint_url``, ``key``, ``secret``, ...).
    The object is picklable (the filesystem is re-created lazily in each process).
    """

    url: str
    storage_options: dict = field(default_factory=dict)
    attempts: int = DEFAULT_ATTEMPTS
    backoff_s: float = DEFAULT_BACKOFF_S
    counters: OriginCounters = field(default_factory=OriginCounters)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        self._fs = None
        self._root = None
        self._native = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fs"] = None
        state["_root"] = None
        state["_native"] = None  # each process opts in itself (use_native)
        state["counters"] = OriginCounters()
        return state

    def use_native(self) -> bool:
        """Serve :meth:`read_range` with obstore in this process (S3 only; see
        :mod:`stoker.native_s3`). Call it only in a process that will not fork afterwards.
        Returns whether it is on (False: not S3, obstore missing, unsupported options, or
        ``STOKER_NATIVE_S3=0``)."""
        if os.environ.get("STOKER_NATIVE_S3", "1") == "0":
            return False
        from .native_s3 import NativeS3Reader
        self._native = NativeS3Reader.create(self.url, self.storage_options)
        return self._native is not None

    @property
    def fs(self):
        if self._fs is None:
            self._fs, self._root = url_to_fs(self.url, self.storage_options)
        return self._fs

    @property
    def root(self) -> str:
        self.fs  # noqa: B018 - initialises _root
        return self._root

    def warm(self) -> None:
        """Build the storage client now (for S3, botocore loads its service model: ~0.2 s),
        so the first read of a new process does not pay for it. Makes no request."""
        fs = self.fs
        if hasattr(fs, "set_session") and getattr(fs, "loop", None) is not None:  # s3fs
            try:
                fsspec.asyn.sync(fs.loop, fs.set_session)
            except Exception as exc:  # noqa: BLE001 - the first real read will report it
                log.debug("warm-up of %s failed: %s", self.url, exc)

    def path(self, rel: str) -> str:
        return join(self.root, rel) if rel else self.root

    def full_url(self, rel: str) -> str:
        return join(self.url, rel) if rel else self.url

    def _retry(self, what: str, fn, start=None, end=None):
        delay = self.backoff_s
        last: Exception | None = None
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except _NOT_RETRIED:
                raise
            except Exception as exc:  # noqa: BLE001 - storage backends raise many types
                last = exc
                self.counters.errors += 1
                if type(exc).__name__ in _CONFIG_ERRORS:
                    raise OriginError(what, f"{type(exc).__name__}: {exc} (a configuration error: not retried)",
                                      start, end, attempt) from exc
                if attempt < self.attempts:
                    self.counters.retries += 1
                    log.warning("retrying %s (attempt %d/%d): %s", what, attempt, self.attempts, exc)
                    time.sleep(delay)
                    delay *= 2
        raise OriginError(what, f"{type(last).__name__}: {last}", start, end, self.attempts) from last

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of object ``rel`` with one ranged GET (retried).

        Raises :class:`OriginError` after ``attempts`` failures, ``FileNotFoundError``
        at once when the object does not exist, and :class:`OriginError` when the
        store returns fewer bytes than asked (object shorter than the index says).
        """
        if end <= start:
            return b""
        path = self.path(rel)
        native = self._native
        if native is not None:
            key = path.split("/", 1)[1]  # s3fs paths are "bucket/key"
            data = self._retry(self.full_url(rel), lambda: native.read_range(key, start, end), start, end)
        else:
            data = self._retry(self.full_url(rel), lambda: self.fs.cat_file(path, start=start, end=end),
                               start, end)
        self.counters.requests += 1
        self.counters.bytes += len(data)
        if len(data) != end - start:
            raise OriginError(self.full_url(rel),
                              f"short read: got {len(data)} bytes, expected {end - start} "
                              "(object changed or truncated?)", start, end)
        return data

    def read(self, rel: str) -> bytes:
        """Read a whole object (retried). Raises :class:`OriginError` / ``FileNotFoundError``."""
        path = self.path(rel)
        data = self._retry(self.full_url(rel), lambda: self.fs.cat_file(path))
        self.counters.requests += 1
        self.counters.bytes += len(data)
        return data

    def exists(self, rel: str) -> bool:
        return self._retry(self.full_url(rel), lambda: self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self._retry(self.full_url(rel), lambda: self.fs.size(self.path(rel))))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a whole object so that readers see either nothing or all of it.

        Local paths: write a temporary sibling, fsync, rename. Object stores: one
        PUT (or one multipart upload), which the store makes visible only on completion.
        """
        path = self.path(rel)
        if _is_local(self.fs):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            self._retry(self.full_url(rel), lambda: self.fs.pipe_file(path, data))


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
