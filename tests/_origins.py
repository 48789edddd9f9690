"""Origins that are not S3, for the tests of :mod:`stoker.storage` and the store: a small HTTP
file server on 127.0.0.1 (what ``python -m http.server`` serves, plus byte ranges) and an HTTP
proxy in front of an S3 endpoint that can answer chosen GETs wrongly.

Both take a ``rule(method, path, headers, n) -> action`` (``n``: 1-based count of the requests
seen; header names as sent) that decides what to do with each request:

* ``None``: answer it properly;
* ``"ignore-range"``: answer a ranged GET with the whole object and status 200, as a server or
  proxy that does not know ``Range`` does;
* ``("extra", k)``: answer with ``k`` bytes more than were asked for (a wrong length), the
  ``Content-Length`` matching what is sent;
* ``("short", k)``: answer with only the first ``k`` bytes of the right answer, the
  ``Content-Length`` matching what is sent;
* an int: answer with that HTTP status and an empty body (503: a server that is busy);
* ``"gzip"`` (:class:`FileServer` only): compress as a web server with gzip on does: when the
  request's ``Accept-Encoding`` lists ``gzip`` (with a non-zero q), the whole file is gzipped and
  ``Range`` is applied to the gzipped bytes (RFC 9110 allows it), answered 206 with
  ``Content-Encoding: gzip`` and a ``Content-Range`` over the gzipped length; a request that
  asks for ``identity`` gets the plain bytes. ``compressed`` counts the gzipped answers;
* ``"gzip-always"``: the same, whatever the request accepts (a server that refuses identity);
* ``("stall", s)`` (:class:`FileServer` only): send the head and half the body, then nothing
  for ``s`` seconds (or until the server stops), then close: a stalled answer;
  ``("stall", s, "head")``: the same before the head (the request is taken, no answer begins).

A wrongly answered S3 GET loses its ``x-amz-checksum-*`` headers, as a proxy that rewrites the
body would send it (the client then sees only the wrong length).

Each runs in daemon threads of the calling process (``with`` stops it); counters: ``requests``,
``faults`` and ``log`` (``(method, path, Range header, action)`` of every request).
"""

from __future__ import annotations

import gzip
import http.client
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

from stoker_lab.bench.httporigin import accepts_gzip

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def _apply(action, whole: bytes, start: int | None, end: int | None) -> tuple[int, bytes, str | None]:
    """(status, body, Content-Range or None) for a GET of ``whole`` asking ``[start, end]``
    (inclusive; ``start`` None: no Range) under ``action``."""
    if start is None or action == "ignore-range":
        return 200, whole, None
    end = len(whole) - 1 if end is None else min(end, len(whole) - 1)
    body = whole[start : end + 1]
    if isinstance(action, tuple) and action[0] == "extra":
        body += b"\0" * int(action[1])
    elif isinstance(action, tuple) and action[0] == "short":
        body = body[: int(action[1])]
    return 206, body, f"bytes {start}-{end}/{len(whole)}"


class _Server:
    """What both servers share: the HTTP server in a daemon thread, the rule and the counters."""

    def __init__(self, handler_cls, rule=None):
        self.rule = rule or (lambda *a: None)
        self.lock = threading.Lock()
        self.requests = 0
        self.faults = 0
        self.compressed = 0
        self.log: list = []
        self.released = threading.Event()  # set by stop(): stalled answers end
        handler_cls.owner = self
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def decide(self, method: str, path: str, headers) -> object:
        with self.lock:
            self.requests += 1
            n = self.requests
        action = self.rule(method, path, headers, n)
        with self.lock:
            self.faults += action is not None
            self.log.append((method, path, headers.get("Range"), action))
        return action

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: _Server

    def log_message(self, *args) -> None:
        pass

    def _send(
        self, status: int, body: bytes, headers: dict, head_only: bool = False, length: int | None = None
    ) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)


def _range(headers) -> tuple[int | None, int | None]:
    m = _RANGE.match((headers.get("Range") or "").strip())
    if not m:
        return None, None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) else None)


class FileServer(_Server):
    """Files under ``root`` over HTTP on 127.0.0.1, as ``python -m http.server`` serves them
    (an HTML listing with links for a directory, ``Content-Length`` on HEAD and GET), plus
    ranged GETs (206 and ``Content-Range``), so that a packed dataset can be read from it.
    ``url(rel)``: ``http://127.0.0.1:<port>/<rel>``."""

    def __init__(self, root: str, rule=None):
        self.root = os.path.abspath(root)

        class H(_Handler):
            def _file(self):
                rel = unquote(urlsplit(self.path).path).lstrip("/")
                return os.path.join(server.root, rel), rel

            def do_HEAD(self):  # noqa: N802 - http.server's name
                self._get(head_only=True)

            def do_GET(self):  # noqa: N802
                self._get()

            def _get(self, head_only: bool = False):
                path, rel = self._file()
                action = server.decide(self.command, self.path, self.headers)
                if isinstance(action, int):
                    return self._send(action, b"", {"Content-Type": "text/plain", "Retry-After": "0"}, head_only)
                if os.path.isdir(path):
                    links = "".join(
                        f'<li><a href="{quote(n)}{"/" if os.path.isdir(os.path.join(path, n)) else ""}">{n}</a></li>'
                        for n in sorted(os.listdir(path))
                    )
                    body = f"<html><body><ul>{links}</ul></body></html>".encode()
                    return self._send(200, body, {"Content-Type": "text/html; charset=utf-8"}, head_only)
                if not os.path.isfile(path):
                    return self._send(404, b"not found", {"Content-Type": "text/plain"}, head_only)
                with open(path, "rb") as f:
                    whole = f.read()
                start, end = _range(self.headers) if self.command == "GET" else (None, None)
                headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
                if action == "gzip-always" or (action == "gzip" and accepts_gzip(self.headers.get("Accept-Encoding"))):
                    whole = gzip.compress(whole, mtime=0)  # the representation that Range now applies to
                    headers["Content-Encoding"] = "gzip"
                    with server.lock:
                        server.compressed += 1
                    action = None
                stall_s = action[1] if isinstance(action, tuple) and action[0] == "stall" else None
                status, body, crange = _apply(None if stall_s is not None else action, whole, start, end)
                if crange:
                    headers["Content-Range"] = crange
                if stall_s is not None and not head_only:
                    return self._stall(status, body, headers, stall_s, before_head="head" in action)
                self._send(status, body, headers, head_only, length=len(whole) if head_only else None)

            def _stall(self, status: int, body: bytes, headers: dict, stall_s: float, before_head: bool) -> None:
                self.close_connection = True
                if before_head:
                    server.released.wait(stall_s)
                    return
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                server.released.wait(stall_s)

        server = self
        super().__init__(H, rule)

    def url(self, rel: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{rel.lstrip('/')}"


class S3Proxy(_Server):
    """An HTTP proxy on 127.0.0.1 in front of the S3 endpoint ``upstream`` (``http://host:port``):
    requests are forwarded as they are; a GET that the rule picks is answered wrongly from the
    upstream's whole object (see the module docstring). ``endpoint_url``: the proxy's address,
    for ``storage_options``."""

    def __init__(self, upstream: str, rule=None):
        up = urlsplit(upstream)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)

        class H(_Handler):
            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                action = server.decide(self.command, self.path, self.headers)
                if isinstance(action, int):
                    return self._send(
                        action, b"", {"Content-Type": "text/plain", "Retry-After": "0"}, self.command == "HEAD"
                    )
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                start, end = _range(self.headers)
                if action is not None and self.command == "GET" and start is not None:
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                conn = http.client.HTTPConnection(*server.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    keep = {
                        k: v
                        for k, v in resp.getheaders()
                        if k.lower() not in ("transfer-encoding", "connection", "content-length", "content-range")
                    }
                    head_length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    status = resp.status
                    if action is not None and self.command == "GET" and start is not None and status == 200:
                        status, data, crange = _apply(action, data, start, end)
                        keep = {k: v for k, v in keep.items() if not k.lower().startswith("x-amz-checksum")}
                        if crange:
                            keep["Content-Range"] = crange
                    else:
                        crange = resp.getheader("Content-Range")
                        if crange:
                            keep["Content-Range"] = crange
                finally:
                    conn.close()
                length = int(head_length) if head_length is not None else None
                self._send(status, data, keep, head_only=self.command == "HEAD", length=length)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any  # noqa: N815

        server = self
        super().__init__(H, rule)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def shard_gets(method: str, path: str, headers) -> bool:
    """Whether a request is a ranged GET of a shard (``.../shards/...``)."""
    return method == "GET" and bool(headers.get("Range")) and "/shards/" in path
