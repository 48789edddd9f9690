"""The scheduler extender's HTTP server: waitress, with a body limit, idle timeout and fixed pool.

waitress (pure Python, no dependencies) parses HTTP; this module adds only the extender's WSGI
application and JSON error answers. What waitress enforces, before the application runs:

* ``max_body_bytes``: a longer body, declared or chunked, is refused with 413 without reading
  it to its end; a malformed, negative or duplicated ``Content-Length`` gets 400;
* ``idle_timeout_s``: a connection with no complete request and no traffic for this long is
  closed (checked every ``cleanup_interval_s``; both whole seconds, rounded up), so idle and
  slow-loris connections go away;
* ``threads``: a fixed pool runs the requests; at most ``connection_limit`` connections are
  accepted at once (the rest wait in the listen backlog).

Every answer is JSON (``{"Error": message}`` for errors), waitress's own refusals included:
400 for a request that is not JSON or not of the ExtenderArgs shape (the message names the field,
e.g. ``NodeNames[2]``), 404 for an unknown verb, 405 for a method other than GET/POST, 413 for a
body over the limit, 500 when the cache state cannot be read or has the wrong shape (naming the
file and the entry) or on any other fault; none stops the server. Each answer carries the cache
state's age in seconds in the header ``X-Stoker-State-Age`` (absent when the state has no time).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import create_server
from waitress.task import ErrorTask

from ...errors import ExtenderRequestError
from ...metrics import observe_extender

log = logging.getLogger(__name__)

AGE_HEADER = "X-Stoker-State-Age"
#: Requests run on this many threads (a request takes well under a millisecond).
THREADS = 4
#: Connections accepted at once; more wait in the listen backlog.
CONNECTION_LIMIT = 256


class _StateUnavailable(RuntimeError):
    """The cache state could not be had or has the wrong shape (answered with 500)."""


class _JsonErrorTask(ErrorTask):
    """waitress's own refusals (bad framing, body over the limit) as a JSON ``{"Error": ...}``."""

    def execute(self):
        e = self.request.error
        body = json.dumps({"Error": f"{e.code} {e.reason}: {e.body}"}).encode()
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class _Channel(HTTPChannel):
    error_task_class = _JsonErrorTask

    def recv(self, buffer_size):
        """As waitress's, but a client that ends its side of the connection in the middle of a
        request body still gets a 400 answer (its receiving side may be open) before the close."""
        req = self.request
        if req is None or not getattr(req, "headers_finished", False) or req.completed or self.requests:
            return super().recv(buffer_size)
        try:
            data = self.socket.recv(buffer_size)
        except BlockingIOError:
            return b""
        except OSError:
            self.handle_close()
            return b""
        if data:
            return data
        msg = (
            "chunked request body ended before its last chunk"
            if getattr(req, "chunked", False)
            else f"request body ended before its Content-Length of {getattr(req, 'content_length', '?')} bytes"
        )
        body = json.dumps({"Error": f"400 Bad Request: {msg}"}).encode()
        head = (
            f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):
            self.socket.send(head + body)  # a few hundred bytes: fits the empty send buffer
        log.warning("extender: %s", msg)
        self.handle_close()
        return b""


def _respond(start_response, code: int, body: object, extra: tuple | list = ()) -> list[bytes]:
    data = json.dumps(body).encode()
    reason = {
        200: "OK",
        400: "Bad Request",
        404: "Not Found",
        405: "Method Not Allowed",
        411: "Length Required",
        413: "Payload Too Large",
        500: "Internal Server Error",
    }.get(code, "Error")
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra]
    start_response(f"{code} {reason}", headers)
    return [data]


class _App:
    """The WSGI application: ``POST .../<verb>`` calls ``answer(verb, body bytes)``, which returns
    ``(JSON value, state age in seconds or None)``; ``GET`` is a health check (405 on the
    ``filter``/``prioritize`` paths, which take POST only)."""

    def __init__(self, answer):
        self.answer = answer

    def __call__(self, environ: dict, start_response) -> list[bytes]:
        method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
        verb = path.rstrip("/").rsplit("/", 1)[-1]
        if method in ("GET", "HEAD"):
            if verb in ("filter", "prioritize"):  # an extender verb read by GET: a client's mistake
                return _respond(start_response, 405, {"Error": f"method {method} not allowed on {path} (use POST)"})
            return _respond(start_response, 200, {"ok": True})
        if method != "POST":
            return _respond(start_response, 405, {"Error": f"method {method} not allowed (use POST)"})
        extra: list[tuple[str, str]] = []
        t0 = time.perf_counter()
        try:
            n = int(environ.get("CONTENT_LENGTH") or 0)  # waitress has checked it and read the body
            body, age = self.answer(verb, environ["wsgi.input"].read(n))
            code = 200
            if age is not None:
                extra.append((AGE_HEADER, f"{age:.1f}"))
        except ExtenderRequestError as exc:
            log.warning("extender %s: %s", path, exc)
            code, body = exc.code, {"Error": str(exc)}
        except _StateUnavailable as exc:
            log.error("extender %s: %s", path, exc)
            code, body = 500, {"Error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - answer, never drop the connection
            log.exception("extender %s failed", path)
            code, body = 500, {"Error": f"internal error: {type(exc).__name__}: {exc}"}
        observe_extender(verb, code, time.perf_counter() - t0)  # Prometheus, when it is served
        return _respond(start_response, code, body, extra)


class ExtenderServer:
    """A running extender (see :func:`stoker.cluster.extender.scoring.serve`): ``answer(verb, body)``
    gives each POST's JSON answer and the cache state's age (seconds, or None).

    ``server_address``: ``(host, port)``; :meth:`shutdown` stops serving (within about a second)
    and closes every connection; :meth:`server_close` is kept for callers of the former
    ``http.server`` based server (it does nothing more).
    """

    def __init__(
        self,
        answer,
        host: str,
        port: int,
        max_body_bytes: int,
        idle_timeout_s: float,
        cleanup_interval_s: float,
        threads: int = THREADS,
        connection_limit: int = CONNECTION_LIMIT,
    ):
        logging.getLogger("waitress").setLevel(logging.ERROR)  # no per-connection or queue-depth logs
        self._srv = create_server(
            _App(answer),
            host=host,
            port=port,
            threads=threads,
            connection_limit=connection_limit,
            # waitress takes whole seconds here: round up, at least 1 (0 would close every connection)
            channel_timeout=max(1, math.ceil(idle_timeout_s)),
            cleanup_interval=max(1, math.ceil(cleanup_interval_s)),
            max_request_body_size=int(max_body_bytes),
            max_request_header_size=64 << 10,
            ident="stoker-extender",
            expose_tracebacks=False,
            clear_untrusted_proxy_headers=True,
        )
        self._srv.channel_class = _Channel
        self.server_address = (self._srv.effective_host, self._srv.effective_port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stoker-extender", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            wasyncore.loop(timeout=0.5, map=self._srv._map, count=1)
        self._srv.task_dispatcher.shutdown()
        wasyncore.close_all(self._srv._map)

    def shutdown(self) -> None:
        """Stop serving and close the listening socket and every connection."""
        self._stop.set()
        self._thread.join(timeout=10)

    def server_close(self) -> None:
        """Nothing left to do after :meth:`shutdown` (kept for the ``http.server`` interface)."""
