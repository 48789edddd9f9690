"""A process's connections to the peers' data endpoints (:mod:`stoker.cluster.service.endpoint`).

One persistent, authenticated TCP connection per peer endpoint per process (:class:`PeerLink`),
shared by every thread of the process: requests are sent under a lock, each with its own id,
and one receiver thread reads the replies as they come (in any order) straight into the buffer
of the request they answer (``recv_into``). Several requests are in flight on a connection at
once, up to ``max_inflight_bytes`` of asked-for bytes per process over all its links
(:class:`InflightBytes`, the receiver's bound: a process that reads from many peers at once is
not flooded by them).

A connection that breaks (reset, cut mid-body, a short body, no reply within ``timeout_s``) fails
every request in flight on it with :class:`stoker.errors.PeerUnavailable`, and the next request
opens a new one. Links are per process: a forked child opens its own (:class:`PeerLinks` notices
the new pid), so a loader's prefetcher and decode workers read peers directly, each over its own
connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading

from ...errors import PeerUnavailable
from . import peerwire as pw

#: Bytes of requests in flight per process, over all its links (the receiver's bound).
MAX_INFLIGHT_BYTES = 64 << 20


class InflightBytes:
    """The bytes a process has asked its peers for and not yet received, bounded by ``limit``
    (a request larger than the bound goes alone). Thread-safe."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0
        self._cv = threading.Condition()

    def take(self, n: int, timeout_s: float, what: str) -> None:
        """Count ``n`` bytes in flight, first waiting up to ``timeout_s`` for room; PeerUnavailable
        (naming ``what``) when none comes."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self.used or self.used + n <= self.limit, timeout_s):
                raise PeerUnavailable(f"{what}: no room for {n} more bytes in flight in {timeout_s} s")
            self.used += n

    def give(self, n: int) -> None:
        """``n`` bytes of a request are no longer in flight (received, failed or timed out)."""
        with self._cv:
            self.used -= n
            self._cv.notify_all()


class _Waiting:
    """One request in flight: its reply's status and body, or the error that ended it. The
    requester waits on ``ready`` (a lock taken at creation), released exactly once by whoever
    took the request out of the link's table (the receiver thread, or :meth:`PeerLink._fail`): one
    futex wake per reply, where an Event costs a condition, its lock and a waiter lock."""

    __slots__ = ("buf", "ready", "status", "error", "n")

    def __init__(self, n: int):
        self.n = n
        self.buf: memoryview | None = None
        self.ready = threading.Lock()
        self.ready.acquire()
        self.status = -1
        self.error: BaseException | None = None

    def fail(self, why: str) -> None:
        self.error = PeerUnavailable(why)
        self.ready.release()


class PeerLink:
    """One authenticated connection to the data endpoint at ``address`` (``(host, port)``), its
    name for messages ``name``. Thread-safe. :meth:`request` raises PeerUnavailable for every
    fault of the peer or the link; :meth:`close` fails what is in flight and closes it."""

    def __init__(
        self,
        address: tuple[str, int],
        secret: bytes,
        name: str,
        timeout_s: float,
        budget: InflightBytes | None = None,
    ):
        self.address, self.name, self.timeout_s = (str(address[0]), int(address[1])), name, float(timeout_s)
        self._budget = budget or InflightBytes(MAX_INFLIGHT_BYTES)
        try:
            sock = socket.create_connection(self.address, timeout=min(self.timeout_s, 10.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            pw.client_handshake(sock, secret)
            sock.settimeout(None)
        except OSError as exc:
            with contextlib.suppress(UnboundLocalError, OSError):
                sock.close()
            raise PeerUnavailable(f"data endpoint of {name} at {self._where()}: {exc}") from exc
        self._sock = sock
        self._send_lock = threading.Lock()
        self._state = threading.Lock()  # guards _waiting, _next, _broken
        self._waiting: dict[int, _Waiting] = {}
        self._next = 0
        self._broken: str | None = None
        threading.Thread(target=self._receive, name=f"stoker-peer-{name}", daemon=True).start()

    def _where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    @property
    def broken(self) -> bool:
        """Whether the connection failed (a new link must be opened)."""
        return self._broken is not None

    def request(
        self,
        op: int,
        key: bytes,
        b: int = 0,
        start: int = 0,
        stop: int = 0,
        prior: str | None = None,
        wait_s: float = 0.0,
        body: bytes = b"",
    ) -> tuple[int, memoryview]:
        """Send one request and wait for its reply: ``(status, body)``. The body of a read is
        exactly ``stop - start`` bytes (anything else fails the link). Raises PeerUnavailable."""
        n = max(0, stop - start) if op in (pw.READ, pw.CACHED) else 0
        w = _Waiting(n)
        self._budget.take(n, self.timeout_s, f"data endpoint of {self.name}")
        with self._state:
            if self._broken is not None:
                self._budget.give(n)
                self._check()
            rid = self._next = (self._next + 1) & 0xFFFFFFFF
            self._waiting[rid] = w
        try:
            head = pw.REQUEST.pack(op, rid, key, b, start, stop, pw.node_bytes(prior), wait_s)
            with self._send_lock:
                self._sock.sendall(head + body if body else head)
            if not w.ready.acquire(timeout=self.timeout_s):
                self._fail(f"no reply within {self.timeout_s} s")
                raise PeerUnavailable(
                    f"data endpoint of {self.name} at {self._where()}: no reply within {self.timeout_s} s"
                )
        except PeerUnavailable:
            raise
        except OSError as exc:
            self._fail(str(exc))
            raise PeerUnavailable(f"data endpoint of {self.name} at {self._where()}: {exc}") from exc
        finally:
            with self._state:
                self._waiting.pop(rid, None)
            self._budget.give(n)
        if w.error is not None:
            raise PeerUnavailable(f"data endpoint of {self.name} at {self._where()}: {w.error}")
        assert w.buf is not None
        return w.status, w.buf

    def _check(self) -> None:
        if self._broken is not None:
            raise PeerUnavailable(f"data endpoint of {self.name} at {self._where()}: {self._broken}")

    def _receive(self) -> None:
        """The receiver thread: each reply's body straight into its request's buffer (one
        ``recv_into`` with ``MSG_WAITALL`` per body: :func:`stoker.cluster.service.peerwire.recv_into_exactly`)."""
        head = memoryview(bytearray(pw.REPLY.size))
        w = None
        try:
            while True:
                pw.recv_into_exactly(self._sock, head)
                rid, status, n = pw.REPLY.unpack(head)
                with self._state:
                    w = self._waiting.pop(rid, None)  # ours now: _fail no longer sees it
                if w is None:
                    raise PeerUnavailable(f"a reply to request {rid}, which is not in flight")
                if status in pw.SOURCES and n != w.n:
                    raise PeerUnavailable(f"a body of {n} bytes for a range of {w.n}")
                if n > pw.MAX_BODY:
                    raise PeerUnavailable(f"a body of {n} bytes")
                buf = pw.body_buffer(n)
                if n:
                    pw.recv_into_exactly(self._sock, buf)
                w.status, w.buf = status, buf
                w.ready.release()
                w = None
        except Exception as exc:  # noqa: BLE001 - a fault of the link (OSError), or no memory for a body
            why = str(exc) or type(exc).__name__
            if w is not None:
                w.fail(why)
            self._fail(why)

    def _fail(self, why: str) -> None:
        """Mark the link broken, fail everything in flight, close the socket."""
        with self._state:
            if self._broken is None:
                self._broken = why
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for w in waiting:
            w.fail(why)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Close the connection (requests in flight fail with PeerUnavailable)."""
        self._fail("closed")


class PeerLinks:
    """This process's links, one per peer endpoint, opened on first use and again after a fault
    (module doc). ``secret``: the cluster's data-plane secret; ``timeout_s``: longest wait for a
    connection or a reply. Picklable: a copy (in a spawned worker) or a fork opens its own."""

    def __init__(self, secret: bytes, timeout_s: float, max_inflight_bytes: int = MAX_INFLIGHT_BYTES):
        self.secret, self.timeout_s, self.max_inflight_bytes = bytes(secret), float(timeout_s), int(max_inflight_bytes)
        self._init_local()

    def _init_local(self) -> None:
        self._pid = os.getpid()
        self._budget = InflightBytes(self.max_inflight_bytes)
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"secret": self.secret, "timeout_s": self.timeout_s, "max_inflight_bytes": self.max_inflight_bytes}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_local()

    def link(self, address: tuple[str, int], name: str) -> PeerLink:
        """The open link to ``address`` (opened now if there is none or it broke). PeerUnavailable."""
        if os.getpid() != self._pid:  # a forked child: the parent's connections are not ours
            self._init_local()
        key = (str(address[0]), int(address[1]))
        link = self._links.get(key)
        if link is not None and not link.broken:
            return link
        with self._lock:
            link = self._links.get(key)
            if link is None or link.broken:
                link = self._links[key] = PeerLink(key, self.secret, name, self.timeout_s, self._budget)
        return link

    def read(
        self,
        address: tuple[str, int],
        name: str,
        dref: dict,
        op: int,
        b: int,
        start: int,
        stop: int,
        prior: str | None = None,
        wait_s: float = 0.0,
    ) -> tuple[str | None, memoryview]:
        """Shard bytes ``[start, stop)`` of block ``b`` of the dataset ``dref`` from the endpoint
        at ``address`` (``op``: :data:`~stoker.cluster.service.peerwire.READ` or
        :data:`~stoker.cluster.service.peerwire.CACHED`): ``(source, bytes)``, the bytes a
        ``memoryview`` (:func:`~stoker.cluster.service.peerwire.body_buffer`), source ``"cache"``,
        ``"origin"`` or ``"handoff"`` as the peer names it, or ``(None, <empty memoryview>)`` when
        a cache-only read found the block not held. The dataset is opened on the peer first if it
        does not know it (a restarted service). Raises PeerUnavailable (the peer's error
        message included when it answered one)."""
        key = pw.dataset_key(dref["version"], dref["block_bytes"])
        for attempt in (0, 1):
            link = self.link(address, name)
            status, body = link.request(op, key, b, start, stop, prior, wait_s)
            if status in pw.SOURCES:
                return pw.SOURCES[status], body
            if status == pw.NOT_HELD:
                return None, memoryview(b"")
            if status == pw.UNKNOWN_DATASET and attempt == 0:
                self.open(link, dref)
                continue
            raise PeerUnavailable(f"data endpoint of {name}: {bytes(body).decode(errors='replace')}")
        raise AssertionError("unreachable")

    def open(self, link: PeerLink, dref: dict) -> None:
        """Have the peer of ``link`` open the dataset ``dref``
        (:data:`~stoker.cluster.service.peerwire.OPEN`). Raises PeerUnavailable."""
        body = json.dumps(dref).encode()
        status, reply = link.request(pw.OPEN, b"\0" * 16, 0, 0, len(body), body=body)
        if status != pw.OK:
            raise PeerUnavailable(
                f"data endpoint of {link.name} cannot open {dref['url']}: {bytes(reply).decode(errors='replace')}"
            )

    def ping(self, address: tuple[str, int], name: str) -> None:
        """An authenticated round trip to the endpoint (a new connection if none is open). PeerUnavailable."""
        status, body = self.link(address, name).request(pw.PING, b"\0" * 16)
        if status != pw.OK:
            raise PeerUnavailable(f"data endpoint of {name}: {bytes(body).decode(errors='replace')}")

    def __len__(self) -> int:
        """How many links of this process are open now."""
        return 0 if os.getpid() != self._pid else sum(not link.broken for link in self._links.values())

    def close(self) -> None:
        """Close this process's links."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
