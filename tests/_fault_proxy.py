"""A small HTTP proxy on 127.0.0.1 that injects origin faults in front of an S3 endpoint.

``FaultProxy(upstream_url, rule)``: every request is passed to ``rule(method, path, headers)``,
which returns None (forward it upstream) or a :class:`Fault`: an S3 error answer (status, error
code, optional ``Retry-After`` seconds), a stall (status line and headers, then no body for
``stall_s`` seconds) or a connection reset (the socket is closed with no answer). The proxy runs
in daemon threads of the test process; ``stop()`` ends it. Test helper only.
"""
from __future__ import annotations

import http.client
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Fault:
    """What to answer instead of forwarding: ``kind`` is "error", "stall" or "reset".
    A stall lasts ``stall_s`` seconds or until ``released`` is set."""

    kind: str = "error"
    status: int = 503
    code: str = "SlowDown"
    retry_after_s: float | None = None
    stall_s: float = 0.0
    released: threading.Event = field(default_factory=threading.Event)


def _handler(proxy: "FaultProxy"):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            fault = proxy.rule(self.command, self.path, self.headers)
            with proxy.lock:
                proxy.requests += 1
                if fault is not None:
                    proxy.faults.append((self.command, self.path, fault.kind, fault.status))
            if fault is None:
                return self._forward(body)
            if fault.kind == "reset":
                # RST instead of FIN: the client sees "connection reset by peer"
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return None
            if fault.kind == "stall":
                rng = (self.headers.get("Range") or "").partition("=")[2]
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {rng}/{1 << 30}")
                self.send_header("Content-Length", "1048576")
                self.end_headers()
                self.wfile.flush()
                fault.released.wait(fault.stall_s)
                self.close_connection = True
                return None
            data = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                    f"<Message>injected {fault.code}</Message></Error>").encode()
            self.send_response(fault.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data)))
            if fault.retry_after_s is not None:
                self.send_header("Retry-After", str(fault.retry_after_s))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            return None

        def _forward(self, body):
            conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    return Handler


class FaultProxy:
    """Proxy to ``upstream_url`` (``http://host:port``) that answers what ``rule`` chooses.

    ``endpoint`` is its own URL; ``requests`` counts requests seen; ``faults`` lists
    (method, path, kind, status) of the faults served.
    """

    def __init__(self, upstream_url: str, rule=None):
        parsed = urllib.parse.urlsplit(upstream_url)
        self.upstream_host, self.upstream_port = parsed.hostname, parsed.port
        self.rule = rule or (lambda method, path, headers: None)
        self.lock = threading.Lock()
        self.requests = 0
        self.faults: list = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
