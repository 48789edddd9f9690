"""A cache service's data endpoint: a TCP listener that serves its node cache's block bytes.

Ray carries the control plane (membership, placement, leases, where this endpoint listens); the
bytes of blocks travel here, in the format of :mod:`stoker.cluster.service.peerwire`: a cached
block's range goes out with one ``os.sendfile`` from its cache file (the memory tier is files in
``/dev/shm``, the same call), a block the node must fill first from a pool thread with one
``sendall``. No Ray object, no pickle, no copy into a message.

Threads: one accepts; one per connection authenticates it (:func:`~stoker.cluster.service.peerwire.server_handshake`,
within ``handshake_s``; a client that fails gets nothing and no cache file is opened for it) and
then reads its requests, answering the cache hits itself; requests that need a fill go to a
pool of ``fill_threads``, so a slow fill does not hold up the hits behind it on the same
connection. At most ``max_pending`` requests per connection are being served at once; past that
the connection's thread stops reading it (TCP's window then holds the client back).

Requests are served by a *handler* (the cache service, :class:`Handler`): it alone knows the
datasets, and refuses blocks and ranges outside the dataset it names. A handler's error (a
refused request, the origin failing a fill) is answered ``ERROR`` with its message on a
connection that goes on; only a reply that breaks off mid-way (:class:`_ReplyFailed`) closes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from . import peerwire as pw

log = logging.getLogger(__name__)

#: Longest wait for a client's half of the challenge, seconds.
HANDSHAKE_S = 5.0
#: Connections served at once; more wait in the listen backlog.
MAX_CONNECTIONS = 256


class _ReplyFailed(OSError):
    """A reply broke off mid-way (the connection failed, or the cache file ended short after its
    header went out): the connection is closed, and its client sees a short or missing reply
    (it reads the origin or retries). Any other error of a handler is answered ``ERROR``."""


class Reply:
    """How a handler answers one request on its connection (thread-safe: replies of one
    connection never interleave). Exactly one of its methods is called per request; each raises
    :class:`_ReplyFailed` when the reply cannot be sent whole."""

    def __init__(self, conn: _Connection, rid: int):
        self._conn, self._rid = conn, rid

    def data(self, status: int, body) -> None:
        """Answer ``status`` with ``body`` (a bytes-like object, sent as it is)."""
        with self._conn.send_lock:
            try:
                self._conn.sock.sendall(pw.REPLY.pack(self._rid, status, len(body)))
                if len(body):
                    self._conn.sock.sendall(body)
            except OSError as exc:
                raise _ReplyFailed(f"reply to request {self._rid} broke off: {exc}") from exc

    def file(self, status: int, fd: int, offset: int, length: int) -> None:
        """Answer ``status`` with ``length`` bytes of open file ``fd`` from ``offset``
        (``os.sendfile``: the kernel copies them from the page cache to the socket).
        :class:`_ReplyFailed` also when the file is shorter (its client sees a short body)."""
        with self._conn.send_lock:
            sock = self._conn.sock
            try:
                # MSG_MORE: the header waits for the body's first segment (TCP_NODELAY would send it
                # alone: one more packet, and one more wake-up of the receiver, per block)
                sock.sendall(pw.REPLY.pack(self._rid, status, length), socket.MSG_MORE if length else 0)
                sent = 0
                while sent < length:
                    k = os.sendfile(sock.fileno(), fd, offset + sent, length - sent)
                    if k == 0:
                        raise OSError(f"cache file ended {length - sent} bytes short of the range")
                    sent += k
            except OSError as exc:
                raise _ReplyFailed(f"reply to request {self._rid} broke off: {exc}") from exc

    def status(self, status: int, message: str = "") -> None:
        """Answer ``status`` with a short UTF-8 message (``ERROR``, ``NOT_HELD``, ``UNKNOWN_DATASET``, ``OK``)."""
        self.data(status, message.encode()[:4096])


class Handler(Protocol):
    """What a data endpoint asks of its cache service."""

    def serve_hit(self, op: int, key: bytes, b: int, start: int, stop: int, reply: Reply) -> bool:
        """Answer a request from the cache alone if it can (True); False: it needs :meth:`serve`
        (a fill, a handoff, or a slow answer). Raises for a request it refuses (message sent)."""

    def serve(
        self, op: int, key: bytes, b: int, start: int, stop: int, prior: str | None, wait_s: float, reply: Reply
    ) -> None:
        """Answer a request that may need a fill (in a pool thread)."""

    def open(self, dref: dict) -> bytes:
        """Open the dataset of ``dref`` (the reference :func:`stoker.cluster.service.cache_service.dataset_ref`
        gives) for requests; returns its key (:func:`stoker.cluster.service.peerwire.dataset_key`)."""


class _Connection:
    def __init__(self, sock: socket.socket, max_pending: int):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.pending = threading.BoundedSemaphore(max_pending)  # requests being served at once


class DataEndpoint:
    """The listener (module doc). ``handler``: the cache service (:class:`Handler`); ``secret``:
    the cluster's data-plane secret (:func:`stoker.cluster.service.peerwire.cluster_secret`);
    ``host``/``port``: where to listen (the node's cluster address; port 0: any free one);
    ``public_host``: the address peers connect to, when ``host`` is not one (a wildcard such as
    ``0.0.0.0``; default ``host``); ``fill_threads``: the pool for requests that need a fill;
    ``max_pending``: requests of one connection served at once. OSError when the address cannot
    be bound. :meth:`close` stops it and closes every connection.

    Counters (connections since it started): ``accepted`` passed the challenge, ``refused``
    failed it; :meth:`stats`."""

    def __init__(
        self,
        handler: Handler,
        secret: bytes,
        host: str,
        port: int = 0,
        fill_threads: int = 16,
        max_pending: int = 64,
        handshake_s: float = HANDSHAKE_S,
        public_host: str | None = None,
    ):
        self._handler, self._secret = handler, bytes(secret)
        self._max_pending, self._handshake_s = int(max_pending), float(handshake_s)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, int(port)))
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(128)
        self.host, self.port = host, self._listener.getsockname()[1]
        self.public_host = public_host or host
        self._pool = ThreadPoolExecutor(max(1, int(fill_threads)), thread_name_prefix="stoker-data-fill")
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.accepted = 0  # connections that passed the challenge
        self.refused = 0  # connections that failed the challenge
        threading.Thread(target=self._accept, name="stoker-data-accept", daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` peers reach the endpoint at (``public_host``, the port it listens on)."""
        return self.public_host, self.port

    def stats(self) -> dict:
        """``{host, port, public_host, accepted, refused, open}``: where it listens, and its
        connections (counts: passed the challenge, failed it, open now)."""
        with self._lock:
            now = len(self._conns)
        return {
            "host": self.host,
            "port": self.port,
            "public_host": self.public_host,
            "accepted": self.accepted,
            "refused": self.refused,
            "open": now,
        }

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if self._closed:  # accepted as it closed: not served
                sock.close()
                return
            if not self._slots.acquire(timeout=self._handshake_s):
                sock.close()
                continue
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._connection, args=(sock,), name="stoker-data-conn", daemon=True).start()

    def _connection(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._handshake_s)
            if not pw.server_handshake(sock, self._secret):
                with self._lock:
                    self.refused += 1
                log.warning("data endpoint %s:%s: a client failed the challenge; closed", self.host, self.port)
                return
            with self._lock:
                self.accepted += 1
            sock.settimeout(None)
            self._requests(_Connection(sock, self._max_pending))
        except OSError as exc:
            log.debug("data endpoint connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()
            self._slots.release()

    def _requests(self, conn: _Connection) -> None:
        """Read and answer ``conn``'s requests until it closes."""
        head = memoryview(bytearray(pw.REQUEST.size))
        while not self._closed:
            try:
                pw.recv_into_exactly(conn.sock, head)
            except OSError:
                return  # the client closed between requests (or the connection broke)
            op, rid, key, b, start, stop, prior, wait_s = pw.REQUEST.unpack(head)
            reply = Reply(conn, rid)
            if op == pw.PING:
                reply.status(pw.OK)
                continue
            if op == pw.OPEN:
                self._open(conn, reply, stop - start)
                continue
            if op not in (pw.READ, pw.CACHED) or not 0 <= start <= stop or stop - start > pw.MAX_BODY:
                reply.status(pw.ERROR, f"bad request: op {op}, range [{start}, {stop})")
                continue
            try:
                if self._handler.serve_hit(op, key, b, start, stop, reply):
                    continue
            except _ReplyFailed:
                raise  # the reply broke off: the connection is done
            except Exception as exc:  # noqa: BLE001 - refused or failed (a cache error too): told to the client
                reply.status(pw.ERROR, f"{type(exc).__name__}: {exc}")
                continue
            conn.pending.acquire()
            self._pool.submit(self._slow, conn, reply, op, key, b, start, stop, pw.node_id(prior), float(wait_s))

    def _open(self, conn: _Connection, reply: Reply, n: int) -> None:
        if not 0 <= n <= 1 << 20:
            reply.status(pw.ERROR, f"a dataset reference of {n} bytes")
            return
        body = pw.recv_exactly(conn.sock, n)
        try:
            key = self._handler.open(json.loads(body))
        except Exception as exc:  # noqa: BLE001 - told to the client
            reply.status(pw.ERROR, f"{type(exc).__name__}: {exc}")
        else:
            reply.data(pw.OK, key)

    def _slow(self, conn: _Connection, reply: Reply, op, key, b, start, stop, prior, wait_s) -> None:
        try:
            self._handler.serve(op, key, b, start, stop, prior, wait_s, reply)
        except _ReplyFailed as exc:  # the reply broke off: close the connection, its client retries
            log.debug("data endpoint: reply failed: %s", exc)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        except Exception as exc:  # noqa: BLE001 - the origin's errors too: told to the client, which reads the origin
            with contextlib.suppress(OSError):
                reply.status(pw.ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            conn.pending.release()

    def close(self) -> None:
        """Stop listening and close every connection (their clients read the origin or retry).
        The listening socket is shut down before it is closed: a thread blocked in ``accept``
        keeps a closed socket listening on Linux, which would still take connections (and keep
        the port from the next endpoint)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=False, cancel_futures=True)
