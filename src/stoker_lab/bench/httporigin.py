"""A small web server on 127.0.0.1 that serves a directory with byte ranges, the ``http://`` origin of
`stoker bench faults`: directory pages with links, ``Content-Length`` on HEAD and GET, and a
``Range: bytes=a-b`` GET answered 206 with ``Content-Range``. It runs in daemon threads of the
calling process; ``with`` stops it.
"""

from __future__ import annotations

import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeFileServer:
    """Serves ``root`` at :meth:`url`; ``requests`` counts the requests answered."""

    def __init__(self, root: str):
        self.root, self.requests = os.path.abspath(root), 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._answer(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                server.requests += 1
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
                if not m:
                    return self._send(200, data, head)
                start = int(m.group(1))
                end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    return self._send(416, b"", head, extra={"Content-Range": f"bytes */{len(data)}"})
                crange = f"bytes {start}-{end}/{len(data)}"
                self._send(206, data[start : end + 1], head, extra={"Content-Range": crange})

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
