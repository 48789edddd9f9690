"""A process's link to a data endpoint, on its receiving side, without Ray: every reply's body
lands whole in its own buffer (received with ``MSG_WAITALL`` into a buffer that is not zeroed
first), however it is cut into segments and in whatever order replies come; a body cut short
fails every request in flight at once (never a hang, never a partial buffer delivered), and the
next request opens a new connection."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.cluster.service import peerwire as pw
from stoker.cluster.service.endpoint import DataEndpoint
from stoker.cluster.service.peerlinks import PeerLinks
from stoker.errors import PeerUnavailable

SECRET = b"s" * 32
DREF = {"url": "file:///unused", "version": "v1", "block_bytes": 1 << 20}
KEY = pw.dataset_key(DREF["version"], DREF["block_bytes"])
SIZES = (0, 1, 70_001, (1 << 20) + 3, 3 << 20)


class _Files:
    """A handler (:class:`stoker.cluster.service.endpoint.Handler`) that serves "block" ``b`` as
    file ``b``'s bytes ``[start, stop)`` with ``sendfile``; odd blocks go through the pool
    (``serve``) after a short wait, so replies overtake each other."""

    def __init__(self, paths):
        self.fds = [os.open(p, os.O_RDONLY) for p in paths]

    def serve_hit(self, op, key, b, start, stop, reply):
        if b % 2:
            return False
        reply.file(pw.FROM_CACHE, self.fds[b], start, stop - start)
        return True

    def serve(self, op, key, b, start, stop, prior, wait_s, reply):
        time.sleep(0.002)
        reply.data(pw.FROM_ORIGIN, os.pread(self.fds[b], stop - start, start))

    def open(self, dref):
        return KEY

    def close(self):
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def files(tmp_path):
    out = []
    for i, n in enumerate(SIZES):
        p = tmp_path / f"block{i}"
        p.write_bytes(os.urandom(n))
        out.append((str(p), p.read_bytes()))
    return out


def test_replies_land_whole_in_their_own_buffers_in_any_order(files):
    handler = _Files([p for p, _ in files])
    ep = DataEndpoint(handler, SECRET, "127.0.0.1", 0)
    links = PeerLinks(SECRET, timeout_s=60.0)
    want = [data for _, data in files]

    def one(i):
        b = i % len(files)
        start = (i * 7919) % (len(want[b]) + 1)  # a range inside the block, sometimes empty
        source, got = links.read(ep.address, "peer", DREF, pw.READ, b, start, len(want[b]))
        assert source == ("origin" if b % 2 else "cache")
        return b, start, got

    try:
        with ThreadPoolExecutor(8) as pool:
            for b, start, got in pool.map(one, range(200)):
                assert isinstance(got, memoryview) and got.nbytes == len(want[b]) - start
                assert got == want[b][start:] and bytes(got) == want[b][start:]
        assert len(links) == 1  # one connection for every thread of the process
    finally:
        links.close()
        ep.close()
        handler.close()


class _FakeEndpoint:
    """A data endpoint that speaks the challenge, then answers each read as ``behave(sock, rid, n)``
    says; ``behave`` returns False to close the connection. Accepts any number of connections."""

    def __init__(self, behave):
        self.behave = behave
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = self.srv.getsockname()
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                sock, _ = self.srv.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock):
        with sock:
            sock.settimeout(30)
            if not pw.server_handshake(sock, SECRET):
                return
            head = memoryview(bytearray(pw.REQUEST.size))
            try:
                while True:
                    pw.recv_into_exactly(sock, head)
                    _, rid, _, _, start, stop, _, _ = pw.REQUEST.unpack(head)
                    if self.behave(sock, rid, stop - start) is False:
                        return
            except OSError:
                return

    def close(self):
        self.srv.close()


def test_a_body_in_many_small_segments_is_received_whole():
    body = os.urandom(200_000)

    def trickle(sock, rid, n):
        sock.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, n))
        for i in range(0, n, 4096):
            sock.sendall(body[i : min(n, i + 4096)])
            if i % (16 * 4096) == 0:
                time.sleep(0.001)

    ep = _FakeEndpoint(trickle)
    links = PeerLinks(SECRET, timeout_s=60.0)
    try:
        source, got = links.read(ep.address, "peer", DREF, pw.READ, 0, 0, len(body))
        assert source == "cache" and got == body
    finally:
        links.close()
        ep.close()


def test_a_body_cut_short_fails_every_request_in_flight_and_the_next_read_reconnects():
    """Half a body, then the connection closes: the request it answered and every other one in
    flight fail with PeerUnavailable at once (each requester's lock released exactly once: no
    error in the receiver thread), no partial buffer is returned, and the next read opens a new
    connection."""
    body = os.urandom(1 << 20)
    cut = threading.Event()
    errors = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)

    def behave(sock, rid, n):
        if not cut.is_set():
            time.sleep(0.2)  # let the other requests arrive and wait
            cut.set()
            sock.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, n) + body[: n // 2])
            return False
        sock.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, n) + body[:n])
        return True

    ep = _FakeEndpoint(behave)
    links = PeerLinks(SECRET, timeout_s=60.0)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(links.read, ep.address, "peer", DREF, pw.READ, 0, 0, len(body)) for _ in range(6)]
            outcomes = [f.exception(timeout=60) for f in futures]
        assert all(isinstance(e, PeerUnavailable) for e in outcomes), outcomes
        assert time.monotonic() - t0 < 30  # failed at the cut, not after the 60 s timeout
        assert len(links) == 0
        source, got = links.read(ep.address, "peer", DREF, pw.READ, 0, 0, len(body))
        assert source == "cache" and got == body and ep.connections == 2
        assert errors == []
    finally:
        threading.excepthook = hook
        links.close()
        ep.close()


def test_a_reply_of_the_wrong_length_fails_the_link():
    def short(sock, rid, n):
        sock.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, n - 1) + b"x" * (n - 1))

    ep = _FakeEndpoint(short)
    links = PeerLinks(SECRET, timeout_s=30.0)
    try:
        with pytest.raises(PeerUnavailable, match="a body of 9 bytes for a range of 10"):
            links.read(ep.address, "peer", DREF, pw.READ, 0, 0, 10)
    finally:
        links.close()
        ep.close()
