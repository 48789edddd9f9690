"""A fault-injecting HTTP/1.1 proxy for `stoker bench faults`, in front of the emulated origin.

It sits between the loader and :class:`stoker_lab.bench.origin.LocalS3Origin`'s endpoint (itself
the throttling proxy of :mod:`stoker_lab.bench.throttle`), understands just enough HTTP to find
request and response boundaries on keep-alive connections (a ``Content-Length`` body, a
``chunked`` body, or none for ``HEAD``, 1xx, 204 and 304), and injects one kind of fault into
the requests its ``match`` predicate selects (by default: ranged GETs of shard objects):

* ``status``  - answer with an S3 XML error (503 ``SlowDown``, 500 ``InternalError``, ...,
  or the ``code`` given), with a ``Retry-After`` header when ``retry_after_s`` is set, without
  forwarding the request; the connection stays usable;
* ``reset``   - forward, pass the response head and half its body, then reset the TCP
  connection (``SO_LINGER`` 0: the client sees ECONNRESET mid-body);
* ``truncate`` - forward, pass the head and half the body, then close cleanly (FIN): the
  client gets fewer bytes than ``Content-Length`` promised;
* ``stall``   - forward, pass the response head, then send nothing for ``stall_s`` seconds, or
  until the plan's ``released`` event is set, before closing (a per-request read timeout is
  the client's only quick way out).

Which matching requests are hit: every ``every``-th one, at most ``count`` of them (None =
no limit), and, with ``burst_s``, only during the ``burst_s`` seconds that start at the first
matching request after :meth:`FaultProxy.set_fault` (an outage window). It runs its own
asyncio loop in a daemon thread of the caller; counters are read with :meth:`stats`. It is the
only fault injection of the emulated origin (which injects none itself): used by `stoker bench
faults` and by the tests of origin errors and retries.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_S3_CODES = {500: "InternalError", 503: "SlowDown", 403: "AccessDenied", 404: "NoSuchKey"}
_MAX_HEAD_BYTES = 1 << 16
_CHUNK_BYTES = 1 << 16
_RELEASE_POLL_S = 0.02  # how often a stall looks at its ``released`` event (seconds)
MODES = ("none", "status", "reset", "truncate", "stall")


def shard_gets(method: str, path: str, headers: dict) -> bool:
    """Default fault target: ranged GETs of a dataset's shard objects (``.../shards/...``)."""
    return method == "GET" and "range" in headers and "/shards/" in path


def object_gets(method: str, path: str, headers: dict) -> bool:
    """Every object GET, ranged or not: a path-style ``/<bucket>/<key>`` target with a key
    (bucket listings, ``/<bucket>?list-type=2...``, and HEADs are not matched)."""
    bucket, _, key = path.split("?", 1)[0].lstrip("/").partition("/")
    return method == "GET" and bool(bucket) and bool(key)


@dataclass
class Fault:
    """One fault plan. ``mode``: one of :data:`MODES`; ``status``: HTTP status for ``status``;
    ``every``: hit every n-th matching request; ``count``: most faults to inject (None = no
    limit); ``burst_s``: seconds the fault lasts from the first matching request (None = no
    window); ``stall_s``: seconds a ``stall`` holds the body back at most; ``match(method, path,
    headers)``: which requests are candidates (header names lower-case; :func:`shard_gets` by
    default, :func:`object_gets` for every object GET); ``code``: the S3 error
    code of a ``status`` answer (None = the usual one for ``status``: 503 ``SlowDown``, 500
    ``InternalError``, 403 ``AccessDenied``, 404 ``NoSuchKey``); ``retry_after_s``: seconds sent
    as the ``Retry-After`` header of a ``status`` answer (None = no header); ``released``: a
    stall ends as soon as this event is set (None = it runs its ``stall_s``)."""

    mode: str = "none"
    status: int = 503
    every: int = 1
    count: int | None = None
    burst_s: float | None = None
    stall_s: float = 20.0
    match: Callable[[str, str, dict], bool] = shard_gets
    code: str | None = None
    retry_after_s: float | None = None
    released: threading.Event | None = field(default=None, compare=False)


class _Head:
    """A parsed HTTP message head: first line, headers (lower-case names), raw bytes."""

    def __init__(self, raw: bytes):
        self.raw = raw
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()

    def without(self, name: str) -> bytes:
        """The raw head with every ``name`` header line (case-insensitive) left out."""
        lines = self.raw.decode("latin-1").split("\r\n")
        keep = [ln for ln in lines[1:] if ln.partition(":")[0].strip().lower() != name.lower()]
        return "\r\n".join([lines[0], *keep]).encode("latin-1")

    def body_kind(self, no_body: bool = False) -> tuple[str, int]:
        """("none" | "length" | "chunked" | "close", bytes)."""
        if no_body:
            return "none", 0
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            return "chunked", 0
        if "content-length" in self.headers:
            n = int(self.headers["content-length"])
            return ("length", n) if n > 0 else ("none", 0)
        return "none", 0


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    return _Head(raw)


async def _read_body(reader: asyncio.StreamReader, kind: str, n: int) -> bytes:
    """The whole body (raw bytes as sent on the wire, chunk framing included)."""
    if kind == "length":
        return await reader.readexactly(n)
    if kind != "chunked":
        return b""
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        out += line
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers up to the blank line
                t = await reader.readuntil(b"\r\n")
                out += t
                if t == b"\r\n":
                    return bytes(out)
        out += await reader.readexactly(size + 2)


async def _stall(fault: Fault) -> None:
    """Wait ``fault.stall_s`` seconds, or less if ``fault.released`` gets set (polled every
    ``_RELEASE_POLL_S`` seconds: a threading.Event cannot wake an asyncio loop by itself)."""
    end = time.monotonic() + fault.stall_s
    while fault.released is None or not fault.released.is_set():
        left_s = end - time.monotonic()
        if left_s <= 0:
            return
        await asyncio.sleep(left_s if fault.released is None else min(left_s, _RELEASE_POLL_S))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST instead of a FIN (the peer sees 'connection reset')."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """The proxy (context manager). ``upstream_url``: ``http://host:port`` of the origin
    endpoint. Attributes: ``endpoint_url`` (where clients connect). Raises OSError if it cannot
    listen on 127.0.0.1."""

    def __init__(self, upstream_url: str):
        u = urlsplit(upstream_url)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self._lock = threading.Lock()
        self._fault = Fault()
        self._matched = 0
        self._injected_plan = 0
        self._t_first: float | None = None
        self.counters = dict(requests=0, matched=0, faults_injected=0, stalls_open=0)
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, limit=_MAX_HEAD_BYTES)
        )
        self.endpoint_url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fault-proxy")
        self._thread.start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop listening and end the loop thread. Idempotent."""
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - best effort: the loop is stopped below anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def set_fault(self, fault: Fault | None = None) -> None:
        """Inject ``fault`` from now on (None = forward everything); restarts its count and window."""
        with self._lock:
            self._fault = fault or Fault()
            self._matched, self._injected_plan, self._t_first = 0, 0, None

    def stats(self) -> dict:
        """``{requests, matched, faults_injected}`` since the proxy started (counts), and
        ``stalls_open``: stalled answers whose connection is still held open now."""
        with self._lock:
            return dict(self.counters)

    def _decide(self, method: str, path: str, headers: dict) -> Fault | None:
        with self._lock:
            self.counters["requests"] += 1
            f = self._fault
            if f.mode == "none" or not f.match(method, path, headers):
                return None
            self.counters["matched"] += 1
            self._matched += 1
            now = time.monotonic()
            if self._t_first is None:
                self._t_first = now
            if f.burst_s is not None and now - self._t_first > f.burst_s:
                return None
            if self._matched % max(1, f.every) or (f.count is not None and self._injected_plan >= f.count):
                return None
            self._injected_plan += 1
            self.counters["faults_injected"] += 1
            return f

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                head = await _read_head(creader)
                if head is None:
                    return
                method, _, rest = head.first.partition(" ")
                path = rest.rsplit(" ", 1)[0]
                kind, size = head.body_kind()
                raw = head.raw
                if kind != "none" and head.headers.get("expect", "").lower() == "100-continue":
                    # the client waits for a go-ahead before its body (botocore's PUTs): the proxy
                    # gives it and forwards the request whole, without the Expect header
                    cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await cwriter.drain()
                    raw = head.without("expect")
                body = await _read_body(creader, kind, size)
                fault = self._decide(method, path, head.headers)
                if fault is not None and fault.mode == "status":
                    await self._status_reply(cwriter, fault, method, path)
                    continue
                if up is None:
                    up = await asyncio.open_connection(*self.upstream, limit=_MAX_HEAD_BYTES)
                up[1].write(raw + body)
                await up[1].drain()
                keep = await self._relay(up[0], cwriter, method, fault)
                if not keep:
                    return
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
            OSError,
            asyncio.CancelledError,
        ):  # cancelled: stop() is shutting the proxy down
            return
        finally:
            if up is not None:
                up[1].close()
            if not cwriter.transport.is_closing():
                cwriter.close()

    async def _status_reply(self, writer, fault: Fault, method: str, path: str) -> None:
        status = fault.status
        code = fault.code or _S3_CODES.get(status, "InternalError")
        retry_after = "" if fault.retry_after_s is None else f"Retry-After: {fault.retry_after_s:g}\r\n"
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>Injected by the stoker fault proxy</Message><Resource>{path}</Resource>"
            f"<RequestId>{uuid.uuid4().hex}</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n{retry_after}x-amz-request-id: {uuid.uuid4().hex}\r\n\r\n"
        ).encode()
        writer.write(head + (b"" if method == "HEAD" else body))
        await writer.drain()

    async def _relay(self, sreader, cwriter, method: str, fault: Fault | None) -> bool:
        """Pass one response (1xx interim responses included); True if the connection can go on."""
        while True:
            head = await _read_head(sreader)
            if head is None:
                return False
            status = int(head.first.split(" ", 2)[1])
            if status >= 200 or status == 101:
                break
            cwriter.write(head.raw)  # 100 Continue and friends: no body
        kind, n = head.body_kind(no_body=method == "HEAD" or status in (204, 304))
        if fault is not None and kind == "none":  # nothing to cut: not a fault after all
            with self._lock:
                self.counters["faults_injected"] -= 1
            fault = None
        if fault is None:
            cwriter.write(head.raw)
            if kind == "length":
                left = n
                while left:
                    chunk = await sreader.read(min(left, _CHUNK_BYTES))
                    if not chunk:
                        return False
                    cwriter.write(chunk)
                    left -= len(chunk)
                    await cwriter.drain()
            elif kind == "chunked":
                cwriter.write(await _read_body(sreader, kind, n))
            await cwriter.drain()
            return "close" not in head.headers.get("connection", "").lower()
        body = await _read_body(sreader, kind, n)
        cwriter.write(head.raw)
        if fault.mode == "stall":
            await cwriter.drain()
            with self._lock:
                self.counters["stalls_open"] += 1
            try:
                await _stall(fault)
            finally:
                with self._lock:
                    self.counters["stalls_open"] -= 1
            return False
        cwriter.write(body[: len(body) // 2])
        await cwriter.drain()
        if fault.mode == "reset":
            _reset(cwriter)
        return False
