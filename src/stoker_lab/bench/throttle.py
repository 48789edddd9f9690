"""The emulated origin's throttling TCP proxy: per-request latency, aggregate bandwidth cap.

Runs in the origin server process (its own asyncio loop); see :class:`_Proxy` for the latency
model and :class:`_RequestFramer` for how requests are found on a persistent connection."""

from __future__ import annotations

import asyncio
import socket
import time

_BUF = 1 << 20  # proxy read / write buffer, bytes


class _TokenBucket:
    """Aggregate rate limit (bytes/s) shared by all connections of one event loop."""

    def __init__(self, rate_Bps: float | None):
        self.rate = rate_Bps if rate_Bps and rate_Bps > 0 else None
        self.capacity = max(256 * 1024, self.rate * 0.01) if self.rate else 0.0
        self.tokens, self.t = self.capacity, time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate) - n
        self.t = now
        if self.tokens < 0:  # in debt: wait until our bytes would have been sent
            await asyncio.sleep(-self.tokens / self.rate)


class _RequestFramer:
    """Finds where HTTP/1.x requests start in one connection's client->server byte stream.

    Minimal parser of request framing only: request line and headers up to the blank
    line, then a ``Content-Length`` body or a ``chunked`` body (chunk sizes, data,
    trailers). Anything it cannot follow (a head over 64 KiB, a bad chunk size) makes it
    ``lost``; the proxy then falls back to a heuristic.
    """

    _MAX_HEAD, _MAX_LINE = 1 << 16, 1 << 12

    def __init__(self):
        self.state = "head"  # head | body | size | data | trailer | lost
        self.pending = b""  # incomplete head or line carried over from the last feed
        self.left = 0  # body or chunk bytes still to pass

    @property
    def lost(self) -> bool:
        return self.state == "lost"

    def _until(self, data: bytes, i: int, sep: bytes, limit: int) -> tuple[bytes | None, int]:
        """(text before ``sep``, offset after it) or (None, len(data)) if not there yet."""
        buf = self.pending + data[i : i + limit]
        pos = buf.find(sep, max(0, len(self.pending) - len(sep) + 1))
        if pos < 0:
            if len(buf) >= limit:
                self.state = "lost"
            self.pending = buf
            return None, len(data)
        end = i + pos + len(sep) - len(self.pending)
        self.pending = b""
        return buf[:pos], end

    def feed(self, data: bytes) -> list[int]:
        """Offsets in ``data`` at which a new request begins."""
        starts, i, n = [], 0, len(data)
        while i < n and self.state != "lost":
            if self.state in ("body", "data"):
                take = min(self.left, n - i)
                i, self.left = i + take, self.left - take
                if not self.left:
                    self.state = "head" if self.state == "body" else "size"
            elif self.state == "head":
                if not self.pending:
                    starts.append(i)
                head, i = self._until(data, i, b"\r\n\r\n", self._MAX_HEAD)
                if head is not None:
                    self._begin_body(head)
            else:  # a chunk-size line, or a trailer line
                line, i = self._until(data, i, b"\r\n", self._MAX_LINE)
                if line is None:
                    continue
                if self.state == "trailer":
                    self.state = "trailer" if line else "head"
                    continue
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    self.state = "lost"
                    continue
                self.state, self.left = ("data", size + 2) if size else ("trailer", 0)
        return starts

    def _begin_body(self, head: bytes) -> None:
        length, chunked = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    self.state = "lost"
                    return
        if chunked:
            self.state = "size"
        else:
            self.state, self.left = ("body", length) if length > 0 else ("head", 0)


class _Proxy:
    """TCP proxy adding ``latency_s`` once per HTTP request, and a bandwidth cap.

    Latency model: every HTTP request - the first on a connection or a later one on a
    reused (keep-alive) connection - is held back ``latency_s`` before its first byte is
    forwarded to the server; the rest of the request and everything after it on that
    connection queue behind it, in order. Request boundaries come from
    :class:`_RequestFramer`, so a large upload body arriving in many TCP reads pays the
    latency once, and a ``100 Continue`` exchange does not pay it twice. Opening a TCP
    connection costs no latency and responses are not delayed, only bandwidth-limited, so
    one request costs ``latency_s`` plus its transfer time at the capped rate. If the
    framing cannot be followed, a connection falls back to "client bytes arriving after
    response bytes began a new request".

    Bandwidth: one token bucket per direction shared by all connections, each capped at
    ``bandwidth_Bps`` bytes/s (None or 0: unlimited).
    """

    def __init__(self, target_port: int, latency_s: float, bandwidth_Bps: float | None, target_host: str = "127.0.0.1"):
        self.target_port, self.latency_s, self.target_host = target_port, latency_s, target_host
        self.down, self.up = _TokenBucket(bandwidth_Bps), _TokenBucket(bandwidth_Bps)
        self.stats = dict(connections=0, requests=0, bytes_down=0, bytes_up=0)

    async def handle(self, creader, cwriter) -> None:
        self.stats["connections"] += 1
        try:
            sreader, swriter = await asyncio.open_connection(self.target_host, self.target_port, limit=_BUF)
        except OSError:
            cwriter.close()
            return
        for w in (cwriter, swriter):
            w.transport.set_write_buffer_limits(high=_BUF)
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replied = [False]  # response bytes seen since the last request (fallback only)
        await asyncio.gather(
            self._upstream(creader, swriter, replied),
            self._downstream(sreader, cwriter, replied),
            return_exceptions=True,
        )

    async def _upstream(self, reader, writer, replied: list) -> None:
        framer = _RequestFramer()
        try:
            while data := await reader.read(_BUF):
                if framer.lost:
                    starts = [0] if replied[0] else []
                else:
                    starts = framer.feed(data)
                replied[0] = False
                done = 0
                for start in starts:
                    if start > done:
                        await self._send(writer, data[done:start])
                    done = start
                    self.stats["requests"] += 1
                    if self.latency_s > 0:
                        await asyncio.sleep(self.latency_s)
                await self._send(writer, data[done:] if done else data)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()  # ends the other direction too

    async def _send(self, writer, data: bytes) -> None:
        await self.up.take(len(data))
        self.stats["bytes_up"] += len(data)
        writer.write(data)
        await writer.drain()

    async def _downstream(self, reader, writer, replied: list) -> None:
        try:
            while data := await reader.read(_BUF):
                replied[0] = True
                await self.down.take(len(data))
                self.stats["bytes_down"] += len(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
