"""Server side of :mod:`stoker_lab.bench.origin`: runs inside ``python -m stoker.cli origin-server``.

* moto's WSGI application, wrapped in :class:`_Middleware`, which serves single
  ``Range: bytes=a-b`` / ``bytes=a-`` object GETs straight from the key's buffer
  (moto itself copies the whole object on every GET) and answers the counters endpoint
  ``GET /__stoker__/stats``;
* served by waitress (threaded, HTTP/1.1 keep-alive), so clients reuse connections
  the way they do with real S3;
* an asyncio TCP proxy (:class:`_Proxy`) in front of it that adds a per-request
  latency and caps bandwidth with one token bucket shared by all connections.

The server injects no faults: tests and ``stoker bench faults`` put
:class:`stoker_lab.bench.faultproxy.FaultProxy` in front of it for that.

Only path-style requests (``http://127.0.0.1:PORT/<bucket>/<key>``, what botocore sends
to a custom endpoint) get the fast path. Waitress drops request
headers whose names contain ``_`` (e.g. ``x-amz-meta-my_key``), unlike moto's own server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from http import HTTPStatus

from .throttle import _BUF, _Proxy

_ZERO_COPY_MIN = 1 << 16  # bodies this large are sent from a memoryview
_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)")
# Requests with any of these need moto's full semantics: no fast path.
_SLOW_HEADERS = (
    "HTTP_IF_MATCH",
    "HTTP_IF_NONE_MATCH",
    "HTTP_IF_MODIFIED_SINCE",
    "HTTP_IF_UNMODIFIED_SINCE",
    "HTTP_X_AMZ_SERVER_SIDE_ENCRYPTION_CUSTOMER_ALGORITHM",
)
_FAST_STORAGE = (None, "STANDARD", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "REDUCED_REDUNDANCY")
_REGION = "us-east-1"


def _xml_error(code: str, message: str, **extra: object) -> bytes:
    rest = "".join(f"<{k}>{v}</{k}>" for k, v in extra.items())
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message>{rest}<RequestId>{uuid.uuid4().hex}</RequestId>"
        "</Error>"
    ).encode()


def _reply(start_response, status: int, body: bytes, content_type: str) -> list[bytes]:
    try:
        line = f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        line = f"{status} Error"
    start_response(line, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


class _Middleware:
    """WSGI wrapper around moto: fast ranged GETs, counters and their endpoint."""

    def __init__(self, app, fast_range: bool = True):
        self.app = app
        self.fast_range = fast_range
        self.proxy = None  # set to the _Proxy once it runs, for its counters
        self._lock = threading.Lock()
        self.counters = dict(requests=0, object_gets=0, ranged_gets=0, passthrough=0, bytes_served=0)

    def _add(self, **delta: int) -> None:
        with self._lock:
            for name, n in delta.items():
                self.counters[name] += n

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__stoker__/"):
            return self._control(environ, start_response, path)
        self._add(requests=1)
        bucket, key = self._bucket_key(environ)
        if environ["REQUEST_METHOD"] == "GET" and key:
            self._add(object_gets=1)
            if self.fast_range:
                resp = self._fast_range(environ, start_response, bucket, key)
                if resp is not None:
                    return resp
        self._add(passthrough=1)
        return self._counted(self.app(environ, start_response))

    def _counted(self, chunks):
        n = 0
        try:
            for chunk in chunks:
                n += len(chunk)
                yield chunk
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
            self._add(bytes_served=n)

    @staticmethod
    def _bucket_key(environ) -> tuple[str, str]:
        """(bucket, key) of a path-style request, or ("", "") for virtual-host style."""
        host = environ.get("HTTP_HOST", "").split(":")[0]
        if host != "localhost" and not re.fullmatch(r"[\d.]+", host):
            return "", ""
        raw = environ.get("RAW_URI") or environ.get("REQUEST_URI") or urllib.parse.quote(environ.get("PATH_INFO", ""))
        path = urllib.parse.unquote(raw.split("?", 1)[0])
        bucket, _, key = path.lstrip("/").partition("/")
        return bucket, key

    def _fast_range(self, environ, start_response, bucket: str, key_name: str):
        """Serve a single-range GET from the key's buffer; None means 'let moto do it'."""
        if environ.get("QUERY_STRING") or any(h in environ for h in _SLOW_HEADERS):
            return None
        m = _RANGE_RE.fullmatch(environ.get("HTTP_RANGE", "").strip())
        if m is None:
            return None
        start, end = int(m[1]), (int(m[2]) if m[2] else None)
        if end is not None and end < start:
            return None  # S3 ignores such a range: moto answers with the whole object
        key = _lookup_key(bucket, key_name)
        if key is None:
            return None
        with key.lock:
            size, etag = key.size, key.etag
            if start < size:
                stop = size - 1 if end is None else min(end, size - 1)
                if (
                    start == 0
                    and stop == size - 1
                    and key.checksum_algorithm
                    and environ.get("HTTP_X_AMZ_CHECKSUM_MODE") == "ENABLED"
                ):
                    return None  # full-object read with checksums: moto adds the headers
                try:
                    key._value_buffer.seek(start)
                    body = key._value_buffer.read(stop - start + 1)
                except ValueError:  # buffer closed: the key was just deleted or replaced
                    return None
        if start >= size:
            body = _xml_error(
                "InvalidRange", "The requested range is not satisfiable", RangeRequested=m[0], ActualObjectSize=size
            )
            self._add(bytes_served=len(body))
            return _reply(start_response, 416, body, "application/xml")
        headers = [(k.title() if not k.startswith("x-amz-") else k, str(v)) for k, v in key.metadata.items()]
        if not any(k.lower() == "content-type" for k, _ in headers):
            headers.append(("Content-Type", "binary/octet-stream"))
        headers += [
            ("Content-Length", str(len(body))),
            ("Content-Range", f"bytes {start}-{stop}/{size}"),
            ("Accept-Ranges", "bytes"),
            ("ETag", etag),
            ("Last-Modified", key.last_modified_RFC1123),
            ("x-amz-request-id", uuid.uuid4().hex),
        ]
        if key.version_id != "null":
            headers.append(("x-amz-version-id", str(key.version_id)))
        start_response("206 Partial Content", headers)
        self._add(ranged_gets=1, bytes_served=len(body))
        wrapper = environ.get("wsgi.file_wrapper")
        if wrapper is not None and len(body) >= _ZERO_COPY_MIN:
            return wrapper(_BytesFile(body))  # waitress sends straight from it
        return [body]

    def _control(self, environ, start_response, path: str):
        """``GET /__stoker__/stats``: the counters as JSON; anything else under the prefix: 404."""
        method, status = environ["REQUEST_METHOD"], 200
        if path == "/__stoker__/stats" and method == "GET":
            with self._lock:
                out = dict(self.counters)
            if self.proxy is not None:
                out.update({f"proxy_{k}": v for k, v in self.proxy.stats.items()})
        else:
            status, out = 404, {"error": f"no control endpoint {method} {path}"}
        return _reply(start_response, status, json.dumps(out).encode(), "application/json")


class _BytesFile:
    """Seekable read-only file over ``bytes`` whose reads are zero-copy memoryviews.

    For ``wsgi.file_wrapper``: waitress then sends a large body from it in socket-buffer
    sized slices instead of first copying it into its output buffer.
    """

    def __init__(self, data: bytes):
        self._view, self._pos = memoryview(data), 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, n: int = -1) -> memoryview:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos : end]
        self._pos = max(self._pos, end)
        return out

    def close(self) -> None:
        pass


def _lookup_key(bucket: str, key_name: str):
    """The latest plain, unencrypted FakeKey for bucket/key in moto's backend, or None."""
    from moto.s3.models import FakeKey, s3_backends

    where = s3_backends.bucket_accounts.get(bucket)
    if where is None:
        return None
    partition, account = where
    found = s3_backends[account][partition].buckets.get(bucket)
    if found is None or key_name not in found.keys:
        return None
    key = found.keys[key_name]
    if not isinstance(key, FakeKey) or key.encryption is not None or key.storage_class not in _FAST_STORAGE:
        return None
    return key


def _http_server(app, threads: int = 32, host: str = "127.0.0.1"):
    """A waitress server for ``app`` on ``host`` (ephemeral port), not yet running."""
    import logging

    from waitress.channel import HTTPChannel
    from waitress.server import create_server
    from waitress.task import WSGITask

    class Task(WSGITask):
        def get_environment(self):
            environ = super().get_environment()
            if "RAW_URI" not in environ:  # moto matches S3 keys against the raw path
                parts = self.request.first_line.split(b" ")
                environ["RAW_URI"] = parts[1].decode("latin-1") if len(parts) == 3 else ""
            return environ

    class Channel(HTTPChannel):
        task_class = Task

        def send_continue(self):
            # waitress 3.0 marks a request incomplete after its 100 Continue, so one with
            # no body (Content-Length: 0, as aiobotocore sends for empty PUTs) would never
            # be served. A 100 is optional: skip it when the body is already complete.
            if self.request.completed:
                self.request.expect_continue = False
                return
            super().send_continue()

    logging.getLogger("waitress").setLevel(logging.ERROR)  # no per-request or queue logs
    server = create_server(
        app,
        host=host,
        port=0,
        threads=threads,
        connection_limit=4096,
        channel_timeout=600,
        recv_bytes=1 << 18,
        inbuf_overflow=1 << 27,
        outbuf_overflow=1 << 30,
    )  # keep bodies in memory
    server.adj.socket_options = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),  # per connection
        (socket.SOL_SOCKET, socket.SO_SNDBUF, _BUF * 4),
    ]
    server.channel_class = Channel
    return server


def serve(
    latency_ms: float,
    bandwidth_MBps: float,
    ready_file: str | None = None,
    buckets: tuple[str, ...] = (),
    fast_range: bool = True,
    parent_pid: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready: Callable[[dict], None] | None = None,
) -> None:
    """Run moto plus the throttling proxy until SIGINT (Ctrl-C), or until ``parent_pid`` exits.

    ``host``: the address both listen on (default loopback; a namespace cluster gives the
    origin namespace's own address so that its hosts reach it over their links). ``port``: the
    endpoint's (the proxy's) port; 0 picks a free one. ``bandwidth_MBps`` is in megabytes per
    second (1e6 bytes/s; 0 = unlimited), latency in milliseconds. Once both listen, writes
    ``{endpoint_url, direct_url, pid}`` as JSON to ``ready_file`` (atomically) and calls
    ``on_ready`` with it. On SIGINT both stop, ``ready_file`` is removed and it returns (the
    objects were in memory: nothing is left behind). Raises OSError (EADDRINUSE) naming ``host``
    and ``port`` when the port is taken, and whatever moto or waitress raise on start-up.
    """
    from moto.server import DomainDispatcherApplication, create_backend_app

    mw = _Middleware(DomainDispatcherApplication(create_backend_app), fast_range)
    server = _http_server(mw, host=host)
    threading.Thread(target=server.run, daemon=True, name="moto").start()
    if buckets:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        for name in buckets:
            s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(name, _REGION)

    proxy = _Proxy(server.effective_port, latency_ms / 1e3, bandwidth_MBps * 1e6, host)
    loop = asyncio.new_event_loop()
    try:
        listener = loop.run_until_complete(asyncio.start_server(proxy.handle, host, port, limit=_BUF))
    except OSError as exc:
        server.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        taken = OSError(f"port {port} on {host} is taken (another server listens there): choose a free one with --port")
        taken.errno = errno.EADDRINUSE
        raise taken from None
    threading.Thread(target=loop.run_forever, daemon=True, name="proxy").start()
    mw.proxy = proxy
    info = {
        "endpoint_url": f"http://{host}:{listener.sockets[0].getsockname()[1]}",
        "direct_url": f"http://{host}:{server.effective_port}",
        "pid": os.getpid(),
    }
    if ready_file:
        from stoker._atomic import umask_mode, write_atomic

        write_atomic(ready_file, json.dumps(info).encode(), mode=umask_mode())
    if on_ready is not None:
        on_ready(info)
    try:
        while parent_pid is None or os.getppid() == parent_pid:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        loop.call_soon_threadsafe(listener.close)
        server.close()
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
