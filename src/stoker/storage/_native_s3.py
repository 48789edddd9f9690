"""Ranged S3 reads through obstore (Rust, object_store), for the processes that read the most.

s3fs (aiobotocore + aiohttp) spends about 3.6 ms of client CPU per MiB read here; obstore about
1.6 ms (measured against the emulated origin, 1 MiB ranged GETs; ``stoker bench cache`` /
``stoker demo`` report per-process CPU). In a cold epoch the block fetches are a fifth of the
CPU of a 2-core node, so the prefetch process and the decode workers read blocks with obstore
when it is installed and the dataset's storage options map onto it; everything else (listing,
writing, the training process's own reads) stays on fsspec.

Only leaf processes may use it: obstore runs a tokio runtime, and a process that forks after
using it hangs its children (reproduced here). :meth:`stoker.storage.Origin.use_native` is
called by the prefetch process and by the decode workers, which never fork.

Options understood (fsspec/s3fs spelling): ``endpoint_url`` (top level or in
``client_kwargs``), ``key``, ``secret``, ``token``, ``anon``, ``profile``,
``client_kwargs.region_name``, ``config_kwargs.s3.addressing_style`` and ``config_kwargs`` timeouts
(``read_timeout``: longest wait for the next bytes of an answer, default
:data:`stoker.storage.retry.DEFAULT_REQUEST_TIMEOUT_S`; ``connect_timeout``) and retries (ignored:
stoker's own retry loop, bounded in time, is in charge). What the options leave out (endpoint,
region, profile, credentials, addressing style, plain HTTP) comes from the AWS environment and
config files as botocore resolves them for s3fs (:mod:`stoker.storage._s3_config`). Any other
option (requester-pays, ``verify``, ...) or AWS setting (a CA bundle, FIPS) keeps the dataset on
s3fs, which is logged once.

obstore reports an S3 error answer only in its message ("... status code: 503 Service
Unavailable: <Error><Code>SlowDown</Code>..."); :meth:`NativeS3Reader.read_range` puts the S3 code
and HTTP status first in the error it raises, so that they survive into
:class:`stoker.storage.OriginError` (``Retry-After`` is not exposed by obstore).
"""

from __future__ import annotations

import logging
import os

from ._s3_config import note_fallback, resolve
from .retry import Failure, http_details, wrong_answer

log = logging.getLogger(__name__)

__all__ = ["NativeS3Reader"]

_USED_IN_PID: list[int] = []  # the pid that made a reader (obstore's runtime lives there)


def _warn_fork_after_use() -> None:
    if _USED_IN_PID and _USED_IN_PID[0] == os.getpid():
        log.error(
            "forking process %d after it read through obstore: the child may hang or crash "
            "(tokio); use Origin.use_native only in processes that do not fork",
            os.getpid(),
        )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_warn_fork_after_use)


class NativeS3Reader:
    """Ranged GETs on one bucket through ``obstore.store.S3Store``.

    Use :meth:`create`, which returns None where this reader cannot stand in for s3fs.
    """

    def __init__(self, store, bucket: str):
        self._store, self.bucket = store, bucket

    @classmethod
    def create(cls, url: str, storage_options: dict) -> "NativeS3Reader | None":
        """A reader for the bucket of ``url`` (``s3://bucket/...``), or None: not an S3 URL,
        obstore not installed, or settings it does not cover (see the module docstring; logged
        once per process and reason)."""
        proto, _, rest = url.partition("://")
        if proto not in ("s3", "s3a") or not rest:
            return None
        try:
            from obstore.store import S3Store
        except ImportError:
            return None
        bucket = rest.split("/", 1)[0]
        kw, reason = resolve(bucket, storage_options)
        if kw is None:
            note_fallback(url, str(reason))
            return None
        try:
            store = S3Store(bucket, retry_config={"max_retries": 0}, **kw)
        except Exception as exc:  # noqa: BLE001 - a configuration obstore rejects: stay on s3fs
            note_fallback(url, f"obstore rejects the settings: {exc}")
            return None
        if not _USED_IN_PID or _USED_IN_PID[0] != os.getpid():
            _USED_IN_PID[:] = [os.getpid()]
        return cls(store, bucket)

    def key(self, url: str, rel: str) -> str:
        """The object key (path inside the bucket) of ``rel`` under dataset root ``url``
        (``s3://bucket/prefix``), as s3fs would resolve it (``bucket/prefix/rel`` less the
        bucket), without building an s3fs filesystem."""
        rest = url.partition("://")[2].rstrip("/")
        prefix = rest.split("/", 1)[1] if "/" in rest else ""
        parts = [p.strip("/") for p in (prefix, rel) if p.strip("/")]
        return "/".join(parts)

    def read_range(self, key: str, start: int, end: int):
        """Bytes ``[start, end)`` of object ``key`` (path inside the bucket) with one GET, as
        obstore's buffer (``obstore.Bytes``: read-only, supports the buffer protocol and ``len``),
        not copied into a ``bytes`` object: the checksum and the cache write take it as it is;
        a caller that needs ``bytes`` copies it (``bytes(buf)``).

        Errors name the object and start with the S3 error code and HTTP status where the
        origin answered (``s3://b/k: SlowDown (HTTP 503): ...``); the obstore error is the cause.

        Raises:
            FileNotFoundError: the object does not exist.
            PermissionError: access denied or unauthenticated.
            OSError: the origin (or a proxy) answered with the whole object, ignoring ``Range``
                (an OSError: retried by the caller, as on the fsspec path).
            OSError: any other failure (the caller classifies it, retries what can clear, and reports it).
        """
        import obstore
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        try:
            return obstore.get_range(self._store, key, start=start, end=end)
        except (NotFoundError, FileNotFoundError) as exc:
            raise FileNotFoundError(self._message(key, exc)) from exc
        except (PermissionDeniedError, UnauthenticatedError, PermissionError) as exc:
            raise PermissionError(self._message(key, exc)) from exc
        except Exception as exc:  # noqa: BLE001 - obstore's generic errors: classified by the caller
            if "non-partial response" in str(exc):  # a 200 with the whole object: Range was ignored
                raise wrong_answer(None, end - start, start, end, range_ignored=True) from exc
            raise OSError(self._message(key, exc)) from exc

    def _message(self, key: str, exc: BaseException) -> str:
        """``s3://bucket/key: <S3 code> (HTTP <status>): <obstore's first line>``; obstore's
        messages carry a multi-line debug dump, of which the first line is kept."""
        status, code, _ = http_details(exc)
        label = Failure(retry=False, status=status, code=code).label()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = first.split(": <?xml", 1)[0][:300]  # the S3 answer's XML: its code is in the label
        head = f"{label}: " if label else ""
        return f"s3://{self.bucket}/{key}: {head}{type(exc).__name__}: {first}"
