"""A small web server on 127.0.0.1 that serves a directory with byte ranges, the ``http://`` origin of
`stoker bench faults`: directory pages with links, ``Content-Length`` on HEAD and GET, and a
``Range: bytes=a-b`` GET answered 206 with ``Content-Range``. It runs in daemon threads of the
calling process; ``with`` stops it.

With ``gzip="asked"`` it compresses as a web server with gzip on does: a GET whose
``Accept-Encoding`` lists ``gzip`` (q above 0) is answered with the gzipped file and
``Content-Encoding: gzip``, and its ``Range`` applies to the gzipped bytes (RFC 9110, section
14.1.2, allows it; a slice of a gzip stream cannot be decoded); a GET that asks for ``identity``
gets the file as it is. ``gzip="always"`` compresses whatever the request asks (a server or proxy
that refuses identity). HEAD answers are never compressed.
"""

from __future__ import annotations

import gzip as gzip_mod
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
GZIP_MODES = (None, "asked", "always")


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` value lists ``gzip`` or ``*`` with a q above 0 (no header:
    False, as nginx and Apache decide)."""
    for item in (accept_encoding or "").split(","):
        name, _, params = item.partition(";")
        q = params.strip().removeprefix("q=")
        try:
            weight = float(q) if q else 1.0
        except ValueError:
            weight = 1.0
        if name.strip().lower() in ("gzip", "*") and weight > 0:
            return True
    return False


class RangeFileServer:
    """Serves ``root`` at :meth:`url`; ``requests`` counts the requests answered, ``compressed`` the
    GETs answered gzipped, ``compressed_ranges`` the ranged ones among them (206 answers),
    ``identity_gets`` the ranged GETs that asked for ``identity``.
    ``gzip``: one of :data:`GZIP_MODES` (see the module docstring). Raises ValueError for another."""

    def __init__(self, root: str, gzip: str | None = None):
        if gzip not in GZIP_MODES:
            raise ValueError(f"gzip must be one of {GZIP_MODES}, got {gzip!r}")
        self.root, self.requests, self.gzip = os.path.abspath(root), 0, gzip
        self.compressed = self.compressed_ranges = self.identity_gets = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: every answer has a Content-Length

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._answer(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                server._count("requests")
                path = os.path.normpath(os.path.join(server.root, unquote(self.path.split("?")[0]).lstrip("/")))
                if not path.startswith(server.root) or not os.path.exists(path):
                    return self._send(404, b"not found")
                if os.path.isdir(path):
                    links = "".join(
                        f'<a href="{quote(n)}{"/" if os.path.isdir(os.path.join(path, n)) else ""}">{n}</a>\n'
                        for n in sorted(os.listdir(path))
                    )
                    return self._send(200, f"<html><body>\n{links}</body></html>".encode(), head, "text/html")
                with open(path, "rb") as f:
                    data = f.read()
                m = _RANGE.match((self.headers.get("Range") or "").strip())
                accept = self.headers.get("Accept-Encoding")
                if m and (accept or "").strip().lower() == "identity":
                    server._count("identity_gets")
                extra: dict = {}
                if not head and (server.gzip == "always" or (server.gzip == "asked" and accepts_gzip(accept))):
                    data = gzip_mod.compress(data, mtime=0)  # the representation Range now applies to
                    extra["Content-Encoding"] = "gzip"
                    server._count("compressed")
                if not m:
                    return self._send(200, data, head, extra=extra)
                start = int(m.group(1))
                end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    return self._send(416, b"", head, extra={"Content-Range": f"bytes */{len(data)}"})
                crange = f"bytes {start}-{end}/{len(data)}"
                if extra:
                    server._count("compressed_ranges")
                self._send(206, data[start : end + 1], head, extra={**extra, "Content-Range": crange})

            def _send(self, status, body, head=False, ctype="application/octet-stream", extra=None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def url(self, rel: str = "") -> str:
        """``http://127.0.0.1:PORT/rel``."""
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{rel.lstrip('/')}"

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> RangeFileServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
