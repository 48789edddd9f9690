"""Ranged reads from an ``http(s)://`` origin, through fsspec's ``HTTPFileSystem`` and its aiohttp session.

Two guards that the S3 path has, and plain fsspec does not:

* **A stall timeout.** ``storage_options["config_kwargs"]`` takes ``read_timeout`` (seconds a
  request may wait for the next bytes of its answer, head or body; default
  :data:`stoker.storage.retry.DEFAULT_REQUEST_TIMEOUT_S`) and ``connect_timeout`` (default
  :data:`stoker.storage.retry.DEFAULT_CONNECT_TIMEOUT_S`), the same names and defaults as on S3,
  made into the session's ``aiohttp.ClientTimeout(sock_read=..., sock_connect=..., total=None)``.
  A stalled answer then fails with a timeout, which :func:`stoker.storage.retry.classify` retries;
  an answer that keeps sending bytes is never cut (botocore has no total limit either). A
  ``client_kwargs["timeout"]`` of the user's own is kept as given.
* **An uncompressed answer.** Every ranged GET sends ``Accept-Encoding: identity``. aiohttp's
  default, ``gzip, deflate``, lets a server apply ``Range`` to the gzipped representation
  (RFC 9110, section 14.1.2: a range is of the selected representation, content coding included),
  and a slice of a gzip stream cannot be decoded. A 206 that carries a ``Content-Encoding``
  anyway (a server or proxy that compresses whatever is asked) fails at once: the same request
  gets the same answer, so it is not retried, and the error says the server compressed a
  ranged answer (:func:`stoker.storage.retry.protocol_fault`).
"""

from __future__ import annotations

import fsspec.asyn
from fsspec.exceptions import FSTimeoutError

from .retry import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, protocol_fault

__all__ = ["http_options", "read_range"]

#: The ``config_kwargs`` an ``http(s)://`` origin understands (the S3 spelling; seconds).
TIMEOUT_KEYS = ("read_timeout", "connect_timeout")


def _seconds(config: dict, name: str, default: float) -> float:
    value = config.get(name, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"storage_options config_kwargs {name} must be a number of seconds, got {value!r}") from None
    if not 0.0 < seconds < float("inf"):
        raise ValueError(f"storage_options config_kwargs {name} must be > 0 and finite (seconds), got {value!r}")
    return seconds


def http_options(storage_options: dict) -> dict:
    """fsspec's options for an ``http(s)://`` origin from stoker's ``storage_options``: ``config_kwargs``
    (``read_timeout``, ``connect_timeout``; defaults as on S3) taken out and made into the aiohttp
    session's timeout, unless ``client_kwargs`` has a ``timeout`` of its own. Raises ValueError
    for a timeout that is not a positive number, or another ``config_kwargs`` key (they are
    botocore's, which an HTTP origin does not use)."""
    import aiohttp

    opts = dict(storage_options)
    config = dict(opts.pop("config_kwargs", None) or {})
    other = sorted(set(config) - set(TIMEOUT_KEYS))
    if other:
        raise ValueError(
            f"storage_options config_kwargs {other} do not apply to an http(s):// origin: it takes "
            f"{' and '.join(TIMEOUT_KEYS)} (seconds)"
        )
    read_s = _seconds(config, "read_timeout", DEFAULT_REQUEST_TIMEOUT_S)
    connect_s = _seconds(config, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    client = dict(opts.get("client_kwargs") or {})
    client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s))
    opts["client_kwargs"] = client
    return opts


def read_range(fs, url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``url`` with one GET through ``fs`` (an fsspec ``HTTPFileSystem``;
    its request options and headers are sent too), asking for ``Accept-Encoding: identity``.

    Returns the body as sent: the caller checks its length (a 200, a server that ignored
    ``Range``, sends the whole object). Raises FileNotFoundError for 404, aiohttp's
    ``ClientResponseError`` for another error status (its status is classified as on S3), and
    the error of :func:`stoker.storage.retry.protocol_fault` (an OSError that is not retried) for
    a 206 with a ``Content-Encoding`` other than identity, TimeoutError (retried) naming the
    timeouts for an answer that stalled or a connection that did not open in time.
    """
    try:
        return fsspec.asyn.sync(fs.loop, _get_range, fs, url, start, end)
    except FSTimeoutError as exc:  # fsspec's stand-in for aiohttp's timeout, without its message
        cause = exc.__cause__
        what = f"{type(cause).__name__}: {cause}" if cause is not None and str(cause) else "timed out"
        limits = getattr(fs, "client_kwargs", {}).get("timeout")
        if limits is not None:
            what += (
                f" (no byte for read_timeout {limits.sock_read} s, or no connection within connect_timeout "
                f"{limits.sock_connect} s)"
            )
        raise TimeoutError(what) from exc


async def _get_range(fs, url: str, start: int, end: int) -> bytes:
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers["Accept-Encoding"] = "identity"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        r.raise_for_status()
        coding = (r.headers.get("Content-Encoding") or "").strip()
        if r.status == 206 and coding.lower() not in ("", "identity"):
            raise protocol_fault(
                f"the server compressed a ranged answer: HTTP 206 with Content-Encoding: {coding} for "
                f"Range: bytes={start}-{end - 1}, although the request asked for Accept-Encoding: "
                "identity. A range of a compressed representation cannot be decoded into the "
                "object's bytes; turn compression off for these files on the server (or the proxy "
                "or CDN in front of it)"
            )
        return await r.read()
