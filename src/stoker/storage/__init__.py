"""Origin access through fsspec: ranged reads with retries bounded in time, whole-object writes.

:class:`Origin` and what it promises are described in this package's README.md; which failures
are retried, and for how long: :mod:`stoker.storage.retry`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field

import fsspec
import fsspec.asyn

from .._atomic import umask_mode, write_atomic
from ..errors import OriginError, OriginNotFoundError, OriginPermissionError  # noqa: F401 - re-exported
from .retry import (
    BACKOFF_CAP_S,
    BUGS,
    UNREACHABLE_BUDGET_S,
    CONFIG_ERRORS,
    DEFAULT_BACKOFF_S,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,  # noqa: F401
    DEFAULT_RETRY_BUDGET_S,
    RETRY_BUDGET_ENV,
    Failure,
    SharedBackoff,
    wrong_answer,
    classify,
    full_jitter_s,
    resolve_retry_budget_s,
)
from ._native_s3 import NativeS3Reader
from . import _http
from ._s3_config import credential_hint

log = logging.getLogger(__name__)

__all__ = [
    "Origin",
    "OriginError",
    "OriginNotFoundError",
    "OriginPermissionError",
    "OriginCounters",
    "url_to_fs",
    "join",
    "absolute_url",
    "DEFAULT_RETRY_BUDGET_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "RETRY_BUDGET_ENV",
]


_INHERITED: list = []
_AMBIENT = threading.local()  # .deadline: the earliest deadline of the shared budgets this thread is in


def _forget_inherited_sessions() -> None:
    """In a forked child, detach the finalizers of s3fs sessions inherited from the parent.

    Each s3fs instance registers ``weakref.finalize(self, close_session, loop, client)``.
    In a child those belong to the parent's event loop; when fsspec drops its inherited
    instance cache they are collected, and closing them from the child's loop fails with
    "attached to a different loop" noise (or worse, touches the parent's sockets). The
    parent still owns and closes them.
    """
    with contextlib.suppress(Exception):  # best effort; CPython internals
        # finalize._registry is a CPython internal that typeshed leaves out
        for fin, info in list(weakref.finalize._registry.items()):  # type: ignore[attr-defined]  # noqa: SLF001
            if getattr(info.func, "__name__", "") == "close_session":
                owner = info.weakref()
                if owner is not None:
                    _INHERITED.append(owner)  # never collected here: no "unclosed session" noise
                fin.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_sessions)


def _s3_defaults(storage_options: dict) -> dict:
    """Bound s3fs's own retries and timeouts so that our retry loop stays in charge."""
    opts = dict(storage_options)
    cfg = dict(opts.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    cfg.setdefault("read_timeout", DEFAULT_REQUEST_TIMEOUT_S)  # a stalled GET is retried, not waited on
    cfg.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = cfg
    return opts


def url_to_fs(url: str, storage_options: dict | None = None):
    """Return ``(filesystem, path)`` for an fsspec URL (``s3://``, ``file://``, ``memory://``, a path).

    S3 and ``http(s)://`` get a stall timeout on every request: ``config_kwargs``'
    ``read_timeout`` (default :data:`DEFAULT_REQUEST_TIMEOUT_S`) and ``connect_timeout``, in
    seconds, the same names on both (:mod:`stoker.storage._http`). Raises ValueError for an
    ``http(s)://`` timeout that is not a positive number or a ``config_kwargs`` key it does not take."""
    opts = dict(storage_options or {})
    proto = url.split("://", 1)[0] if "://" in url else "file"
    if proto in ("s3", "s3a"):
        opts = _s3_defaults(opts)
    elif proto in _HTTP:
        opts = _http.http_options(opts)
    fs, path = fsspec.core.url_to_fs(url, **opts)
    if proto in ("s3", "s3a"):
        # s3fs retries throttling errors itself (5 tries, growing back-off) inside each of
        # our attempts; one retry loop, ours, keeps the total wait bounded and visible.
        fs.retries = 1
    return fs, path


def absolute_url(url: str) -> str:
    """The name of a dataset that means the same from every process and working directory, as
    node-wide views show it (``stoker cache status``, ``stoker top``, the metrics): a local path
    (no scheme) made absolute (``~`` expanded); a URL with a scheme as given; no trailing ``/``."""
    url = str(url)
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    return url.rstrip("/") or url


def join(url: str, *parts: str) -> str:
    """Join URL path parts with '/' (fsspec URLs use '/' on every platform)."""
    out = url.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


_HTTP = ("http", "https")


def _is_s3(url: str) -> bool:
    return url.split("://", 1)[0] in ("s3", "s3a")


def _is_http(url: str) -> bool:
    return url.split("://", 1)[0] in _HTTP


@dataclass
class OriginCounters:
    """Bytes and requests actually received from the origin by one process."""

    bytes: int = 0
    requests: int = 0
    retries: int = 0
    errors: int = 0

    def snapshot(self) -> dict:
        return {"bytes": self.bytes, "requests": self.requests, "retries": self.retries, "errors": self.errors}


@dataclass
class Origin:
    """Read/write access to one dataset root at an fsspec URL.

    ``url`` is the dataset root; paths given to methods are relative to it.
    ``storage_options`` are passed to fsspec (for S3: ``endpoint_url``, ``key``, ``secret``, ...;
    for S3 and ``http(s)://``, ``config_kwargs={"read_timeout": s}`` sets the per-request stall
    timeout, default :data:`DEFAULT_REQUEST_TIMEOUT_S`).
    ``retry_budget_s``: seconds one operation keeps retrying failures that can clear before
    :class:`OriginError` (None: ``$STOKER_RETRY_BUDGET_S``, else
    :data:`~stoker.storage.retry.DEFAULT_RETRY_BUDGET_S` = 30 s; 0: one try). An operation ends within
    the budget plus at most one request timeout. ``backoff_s``: the first back-off ceiling (s).
    ``attempts``: an optional cap on tries as well (None: only the time budget bounds them).
    The object is picklable (the filesystem and the shared back-off are re-created in each process).
    Raises ValueError for a negative or non-numeric budget.
    """

    url: str
    storage_options: dict = field(default_factory=dict)
    attempts: int | None = None
    backoff_s: float = DEFAULT_BACKOFF_S
    counters: OriginCounters = field(default_factory=OriginCounters)
    retry_budget_s: float | None = None

    def __post_init__(self):
        self.url = os.fspath(self.url).rstrip("/")  # a pathlib.Path is a local path
        self.retry_budget_s = resolve_retry_budget_s(self.retry_budget_s)
        self.reached = False  # a request of this process got an answer (see UNREACHABLE_BUDGET_S)
        self._fs = None
        self._root = None
        self._native = None
        self.backoff = SharedBackoff(self.backoff_s)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fs"] = None
        state["_root"] = None
        state["_native"] = None  # each process opts in itself (use_native)
        state["counters"] = OriginCounters()
        state["backoff"] = None  # threads of one process share one; locks do not pickle
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.backoff = SharedBackoff(self.backoff_s)

    def use_native(self) -> bool:
        """Serve :meth:`read_range` with obstore in this process (S3 only; see
        :mod:`stoker.storage._native_s3`). Call it only in a process that will not fork afterwards.
        Its endpoint, region, profile, credentials and addressing style are those botocore
        resolves for s3fs from ``storage_options`` and the AWS environment and config files
        (:mod:`stoker.storage._s3_config`). Returns whether it is on (False: not S3, obstore
        missing, ``STOKER_NATIVE_S3=0``, or a setting obstore cannot take, which is logged once)."""
        if os.environ.get("STOKER_NATIVE_S3", "1") == "0":
            return False
        self._native = NativeS3Reader.create(self.url, self.storage_options)
        return self._native is not None

    @property
    def fs(self):
        if self._fs is None:
            self._fs, self._root = url_to_fs(self.url, self.storage_options)
        return self._fs

    @property
    def is_local(self) -> bool:
        """Whether the origin is this machine's filesystem (a path or ``file://``)."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol in ("file", "local")

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

    def retry(self, what: str, fn, start=None, end=None):
        """Call ``fn()`` under this origin's retry policy and return what it returns.

        Retries failures that can clear (:func:`stoker.storage.retry.classify`) with full-jitter
        back-off for at most ``retry_budget_s`` seconds; waits behind the shared back-off while
        the origin throttles. Every request of this origin goes through it; other modules use it
        for calls of their own on :attr:`fs` (a listing, a delete). ``what``: the URL that errors
        name; ``start``/``end``: the byte range, if any. Raises :class:`OriginError`
        (``OriginNotFoundError`` / ``OriginPermissionError`` for 404 / 403) naming ``what``, the
        range and the S3 code."""
        budget_s = self.retry_budget_s
        assert budget_s is not None  # resolved to seconds by __post_init__
        t0 = time.monotonic()
        ambient = getattr(_AMBIENT, "deadline", None)
        deadline = t0 + budget_s if ambient is None else min(t0 + budget_s, ambient)
        cap_s = min(BACKOFF_CAP_S, max(self.backoff_s, budget_s / 4))  # several tries per budget
        op = _Operation(what, start, end, t0, deadline, budget_s, cap_s)
        last: tuple[BaseException, Failure] | None = None
        while True:
            go, probe = self.backoff.wait_turn(op.deadline, first=op.tries == 0)
            if not go:  # the origin throttled all along (or the process is stopping)
                exc, failure = last if last else (None, self.backoff.last or Failure(retry=True))
                why = (
                    "cancelled: the reading process is stopping"
                    if self.backoff.cancelled
                    else f"the origin kept throttling; retry budget {budget_s:g} s spent"
                )
                raise self._error(op, exc, failure, why) from exc
            op.tries += 1
            sent_at = time.monotonic()
            try:
                result = fn()
            except BUGS:
                self.backoff.done(sent_at, probe, Failure(retry=False))
                raise
            except Exception as exc:  # noqa: BLE001 - storage backends raise many types
                failure = classify(exc)
                self.backoff.done(sent_at, probe, failure, cap_s)
                self.counters.errors += 1
                last = (exc, failure)
                self._wait_or_raise(op, exc, failure, sent_at)
                continue
            self.backoff.done(sent_at, probe, None)
            self.reached = True
            return result

    def _wait_or_raise(self, op: _Operation, exc: Exception, failure: Failure, sent_at: float) -> None:
        """After try ``op.tries``, sent at ``sent_at`` (monotonic s), failed with ``exc``: raise
        :class:`OriginError` when ``failure`` cannot clear or the budget is spent, else log the
        retry and wait out the back-off (while throttled, ``wait_turn`` waits instead)."""
        if not failure.retry:
            shown: BaseException = exc
            if failure.credentials and failure.code is None and _is_s3(self.url):
                # a HEAD's answer has no body: ask once for the S3 code
                shown, failure = self._denied_code(op.what, exc, failure)
            raise self._error(op, shown, failure, "not retried") from exc
        now = time.monotonic()
        never_reached = failure.unreachable and not self.reached  # probably a wrong URL
        if never_reached:
            op.deadline = min(op.deadline, op.t0 + UNREACHABLE_BUDGET_S)
        if now >= op.deadline or (self.attempts is not None and op.tries >= self.attempts):
            why = (
                f"the origin was never reached: check the URL, host and port (gave up after {UNREACHABLE_BUDGET_S:g} s)"
                if never_reached
                else f"retry budget {op.budget_s:g} s spent"
            )
            raise self._error(op, exc, failure, why) from exc
        self.counters.retries += 1
        # the first retry of an operation and one every 5 s of retrying are warnings, the rest debug
        loud = op.tries == 1 or int((now - op.t0) / 5) > int((sent_at - op.t0) / 5)
        log.log(
            logging.WARNING if loud else logging.DEBUG,
            "retrying %s (attempt %d, %.1f of %g s): %s",
            op.what,
            op.tries,
            now - op.t0,
            op.budget_s,
            _describe(exc, failure),
        )
        if not failure.throttled:  # throttling: wait_turn holds every thread back instead
            wait_s = failure.retry_after_s
            if wait_s is None:
                wait_s = full_jitter_s(op.tries, self.backoff_s, op.cap_s)
            self.backoff.pause(max(0.0, min(wait_s, op.deadline - now)))

    def _denied_code(self, what: str, exc: BaseException, failure: Failure) -> tuple[BaseException, Failure]:
        """The S3 code of a refusal that came without one (botocore's HEAD answers have no body):
        one ranged GET of the first byte of ``what``, whose refusal carries the code
        (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, ``ExpiredToken``, ...). Returns that
        GET's ``(exception, failure)`` when it was refused with a code, else the ones given."""
        try:
            _proto, path = fsspec.core.split_protocol(what)
            self.fs.cat_file(path, start=0, end=1)
        except BUGS:
            raise
        except Exception as probe:  # noqa: BLE001 - any refusal with a code will do
            self.counters.errors += 1
            probed = classify(probe)
            if probed.code is not None and probed.credentials:
                return probe, probed
        return exc, failure

    def _error(self, op: _Operation, exc, failure: Failure, why: str) -> OriginError:
        cls = OriginError
        if isinstance(exc, FileNotFoundError) or failure.status == 404:
            cls = OriginNotFoundError
        elif isinstance(exc, PermissionError) or failure.credentials:
            cls = OriginPermissionError
        if failure.code in CONFIG_ERRORS:
            why = "a configuration error: not retried"
        hint = ""
        if failure.credentials and not failure.retry and _is_s3(self.url):
            hint = f"; {credential_hint(self.storage_options)}"
            if failure.code == "AccessDenied" or (failure.status == 403 and failure.code is None):
                hint += (
                    "; S3 also answers so for an object that does not exist when these credentials may "
                    "not list the bucket (s3:ListBucket): check the URL too"
                )
        return cls(
            op.what,
            f"{_describe(exc, failure)} ({why}){hint}",
            op.start,
            op.end,
            op.tries,
            code=failure.code,
            status=failure.status,
            elapsed_s=time.monotonic() - op.t0,
        )

    def shared_budget(self) -> _SharedBudget:
        """Origin operations of this thread inside the block share one retry budget of
        ``retry_budget_s`` seconds from now (nested blocks keep the earliest deadline). A sample
        read that first waits for another process's fill of its block, which is retrying, then
        gets the rest of the budget, not a fresh one: the read still ends within the budget
        (plus one try of its own, at least, and one request timeout). A context manager (a small
        class, not a generator: every sample read enters one)."""
        return _SharedBudget(self.retry_budget_s)

    def read_range(self, rel: str, start: int, end: int):
        """Read bytes ``[start, end)`` of object ``rel`` with one ranged GET (retried).

        Returns a bytes-like object: ``bytes`` from fsspec, obstore's read-only buffer when
        obstore serves the read (:meth:`use_native`; not copied: ``len``, slicing a
        ``memoryview`` of it, xxhash and ``os.write`` take it as it is). A caller that must hand
        out ``bytes`` copies it (``bytes(data)``).

        An answer of another length than asked (a proxy or server that ignored ``Range`` and
        sent the whole object, a cut or padded body) is a failure that can clear: it is sent
        again within the retry budget, the same on every read path (fsspec and obstore), and its
        bytes count as received. Raises :class:`OriginError` when the budget is spent (its
        message says when the origin ignored ``Range``: one that never honours it cannot serve
        a dataset), ``FileNotFoundError`` (:class:`OriginNotFoundError`) at once when the object
        does not exist. Every path asks for the object's bytes uncompressed (``Accept-Encoding:
        identity``); an ``http(s)://`` answer compressed anyway raises :class:`OriginError` at
        once, saying so (:mod:`stoker.storage._http`).
        """
        if end <= start:
            return b""
        expected = end - start
        native = self._native
        if native is not None:
            key = native.key(self.url, rel)  # from the URL: no s3fs filesystem in this process

            def get():
                return native.read_range(key, start, end)
        elif _is_http(self.url):
            path = self.path(rel)

            def get():
                return _http.read_range(self.fs, path, start, end)
        else:
            path = self.path(rel)

            def get():
                return self.fs.cat_file(path, start=start, end=end)

        def checked():
            data = get()
            if len(data) != expected:
                self.counters.bytes += len(data)  # received, then thrown away
                size = self._size_if_short(rel, len(data), expected)
                raise wrong_answer(len(data), expected, start, end, object_bytes=size)
            return data

        data = self.retry(self.full_url(rel), checked, start, end)
        self.counters.requests += 1
        self.counters.bytes += len(data)
        return data

    def _size_if_short(self, rel: str, got: int, expected: int) -> int | None:
        """After a short answer (``got`` < ``expected`` bytes): the object's size now (one HEAD), so
        that an object shorter than the index says fails at once; None for a long answer, or
        when the HEAD fails (the read is then retried as any wrong answer)."""
        if got >= expected:
            return None
        try:
            path = self.path(rel)
            self._fresh(path)
            size = self.fs.info(path).get("size")
        except Exception:  # noqa: BLE001 - only the explanation is lost
            return None
        return None if size is None else int(size)

    def read(self, rel: str) -> bytes:
        """Read a whole object (retried). Raises :class:`OriginError` / ``FileNotFoundError``."""
        path = self.path(rel)
        data = self.retry(self.full_url(rel), lambda: self.fs.cat_file(path))
        self.counters.requests += 1
        self.counters.bytes += len(data)
        return data

    # -- metadata: never from a cached listing ---------------------------------
    # fsspec filesystems are cached per process and keep the listings they made (s3fs's, the
    # http filesystem's "dircache"); a long-lived process would compare a dataset re-packed by
    # another process with what it listed hours ago. Every metadata call here forgets the
    # cached entries of its path first, so it asks the origin (a LIST, or a HEAD).
    def _fresh(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception as exc:  # noqa: BLE001 - a backend without a cache, or a bad path: ask anyway
            log.debug("could not drop fsspec's cached listing of %s: %s", path, exc)

    def _ask(self, rel: str, call):
        """``call(path)`` of ``rel``'s path, retried, with the cached entries of the path forgotten first."""
        path = self.path(rel)

        def ask():
            self._fresh(path)
            return call(path)

        return self.retry(self.full_url(rel), ask)

    def exists(self, rel: str) -> bool:
        """Whether object (or directory) ``rel`` exists now (asked of the origin, retried)."""
        return self._ask(rel, self.fs.exists)

    def info(self, rel: str) -> dict:
        """fsspec's details of object ``rel`` (``size``; ``ETag`` or ``mtime`` where the origin gives
        them), asked of the origin now (a HEAD or a listing; retried). Raises
        :class:`OriginNotFoundError` when it does not exist, :class:`OriginError` when the origin fails."""
        return self._ask(rel, self.fs.info)

    def size(self, rel: str) -> int:
        """Bytes of object ``rel`` now (see :meth:`info`). Raises :class:`OriginError` when the origin
        gives no size (an HTTP server that sends no ``Content-Length``)."""
        size = self.info(rel).get("size")
        if size is None:
            raise OriginError(self.full_url(rel), "the origin gives no size for this object (no Content-Length)")
        return int(size)

    def ls(self, rel: str) -> list[dict]:
        """The entries of directory ``rel`` with fsspec's details (``name``, ``size`` or None,
        ``type``, ETag or mtime where given), listed at the origin now (retried). An HTTP origin
        lists the links of the directory's index page, without sizes. Raises
        :class:`OriginNotFoundError` when the directory does not exist."""
        return self._ask(rel, lambda path: self.fs.ls(path, detail=True))

    def write_atomic(self, rel: str, data) -> None:
        """Write a whole object (``data``: bytes-like) so that readers see either nothing or all of it.

        Local paths: write a temporary sibling (``<name>.tmp-<pid>-<rand>``, created 0600 with
        ``O_EXCL | O_NOFOLLOW``: nobody reads it half-written), fsync, give it the mode a plain
        write would have (0666 less the umask), rename (:func:`stoker._atomic.write_atomic`).
        Object stores: one PUT (or one multipart upload), which the store makes visible only
        on completion.
        """
        path = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            write_atomic(path, data, mode=umask_mode(), fsync=True)
        else:
            body = data if isinstance(data, bytes) else bytes(data)  # fsspec backends take bytes
            self.retry(self.full_url(rel), lambda: self.fs.pipe_file(path, body))


@dataclass
class _Operation:
    """One call of :meth:`Origin.retry`: what its errors name (``what``, ``start``, ``end``), its
    clock (monotonic seconds), budget and back-off ceiling (seconds), and the tries sent so far."""

    what: str
    start: int | None
    end: int | None
    t0: float
    deadline: float
    budget_s: float
    cap_s: float
    tries: int = 0


class _SharedBudget:
    """The context of :meth:`Origin.shared_budget`."""

    __slots__ = ("budget_s", "prev")

    def __init__(self, budget_s):
        self.budget_s = budget_s

    def __enter__(self) -> None:
        prev = self.prev = getattr(_AMBIENT, "deadline", None)
        mine = time.monotonic() + self.budget_s
        _AMBIENT.deadline = mine if prev is None else min(prev, mine)

    def __exit__(self, *exc) -> None:
        _AMBIENT.deadline = self.prev


def _describe(exc: BaseException | None, failure: Failure) -> str:
    """One line for logs and errors: the S3 code and status first, then the client's message."""
    if exc is None:
        return failure.label() or "throttled"
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    text = (
        f"{type(exc).__name__}: {first}" if first and not getattr(exc, "bare", False) else first or type(exc).__name__
    )
    label = failure.label()
    return f"{label}: {text}" if label and label != type(exc).__name__ and label not in first else text
