"""A process's links to the peers' data endpoints (``stoker.cluster.service.peerlinks``), against a
real ``DataEndpoint`` with a small handler (no Ray): many threads share one connection, replies
come back in another order than the requests (a slow fill does not hold up the hits behind it),
the bytes in flight stay under the bound, and a link that breaks is opened again."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.cluster.service import peerwire as pw
from stoker.cluster.service.endpoint import DataEndpoint
from stoker.cluster.service.peerlinks import PeerLinks
from stoker.errors import PeerUnavailable

SECRET = os.urandom(32)
DREF = {"url": "memory://blocks", "storage_options": {}, "version": "v1", "block_bytes": 1 << 16}
KEY = pw.dataset_key("v1", 1 << 16)
BLOCKS = [os.urandom(1 << 16) for _ in range(12)]


class _Blocks:
    """Blocks 0-11; even ones are "cached" (answered at once, from a file with sendfile), odd ones
    need a "fill" (answered from the pool, after ``fill_s``)."""

    def __init__(self, tmp_path, fill_s: float = 0.0):
        self.fill_s, self.served, self.order = fill_s, 0, []
        self.filling = self.most_filling = 0  # fills in progress now, and at most
        self.path = tmp_path / "blocks"
        self.path.write_bytes(b"".join(BLOCKS))
        self.lock = threading.Lock()

    def serve_hit(self, op, key, b, start, stop, reply):
        if key != KEY:
            reply.status(pw.UNKNOWN_DATASET)
            return True
        if b % 2:
            return False
        self._note(b)  # before the reply, as in serve
        fd = os.open(self.path, os.O_RDONLY)
        try:
            reply.file(pw.FROM_CACHE, fd, b * (1 << 16) + start, stop - start)
        finally:
            os.close(fd)
        return True

    def serve(self, op, key, b, start, stop, prior, wait_s, reply):
        with self.lock:
            self.filling += 1
            self.most_filling = max(self.most_filling, self.filling)
        time.sleep(self.fill_s)
        with self.lock:
            self.filling -= 1
        self._note(b)  # before the reply: the client may look at ``order`` as soon as it has its bytes
        reply.data(pw.FROM_ORIGIN, BLOCKS[b][start:stop])

    def open(self, dref):
        return KEY

    def _note(self, b):
        with self.lock:
            self.served += 1
            self.order.append(b)


@pytest.fixture
def endpoint(tmp_path):
    handler = _Blocks(tmp_path)
    ep = DataEndpoint(handler, SECRET, "127.0.0.1")
    yield ep, handler
    ep.close()


def test_many_threads_share_one_connection_and_get_their_own_bytes(endpoint):
    ep, handler = endpoint
    handler.fill_s = 0.02
    links = PeerLinks(SECRET, timeout_s=30.0, max_inflight_bytes=3 << 16)  # at most 3 blocks in flight
    try:

        def one(k):
            b, start = k % 12, (k * 97) % 1000
            source, data = links.read(ep.address, "peer", DREF, pw.READ, b, start, 1 << 16)
            return source, bytes(data) == BLOCKS[b][start:], b

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(96)))
        assert all(ok for _, ok, _ in got)
        assert {s for s, _, b in got if b % 2 == 0} == {"cache"} and {s for s, _, b in got if b % 2} == {"origin"}
        assert len(links) == 1  # one connection for every thread
        assert 1 <= handler.most_filling <= 3  # never more asked for at once than the bound
    finally:
        links.close()


def test_a_slow_fill_does_not_hold_up_the_hits_behind_it(tmp_path):
    handler = _Blocks(tmp_path, fill_s=1.0)
    ep = DataEndpoint(handler, SECRET, "127.0.0.1")
    links = PeerLinks(SECRET, timeout_s=30.0)
    try:
        links.ping(ep.address, "peer")
        slow = threading.Thread(target=links.read, args=(ep.address, "peer", DREF, pw.READ, 1, 0, 10))
        slow.start()
        deadline = time.monotonic() + 10
        while not handler.order and time.monotonic() < deadline and slow.is_alive():
            links.read(ep.address, "peer", DREF, pw.READ, 0, 0, 10)  # a hit, on the same connection
        slow.join(30)
        assert handler.order[0] == 0 and 1 in handler.order  # the hit was answered before the fill
    finally:
        links.close()
        ep.close()


def test_a_broken_link_fails_its_requests_and_the_next_read_opens_a_new_one(endpoint):
    ep, handler = endpoint
    links = PeerLinks(SECRET, timeout_s=30.0)
    try:
        assert bytes(links.read(ep.address, "peer", DREF, pw.READ, 0, 0, 100)[1]) == BLOCKS[0][:100]
        first = links.link(ep.address, "peer")
        first.close()  # as a reset would
        assert first.broken
        with pytest.raises(PeerUnavailable):
            first.request(pw.PING, b"\0" * 16)
        assert bytes(links.read(ep.address, "peer", DREF, pw.READ, 2, 0, 100)[1]) == BLOCKS[2][:100]
        assert links.link(ep.address, "peer") is not first
    finally:
        links.close()


def test_an_unknown_dataset_is_opened_on_the_peer_then_read(tmp_path):
    handler = _Blocks(tmp_path)
    opened = []
    known = {"yes": False}

    def serve_hit(op, key, b, start, stop, reply):
        if not known["yes"]:
            reply.status(pw.UNKNOWN_DATASET, "not opened")
            return True
        return _Blocks.serve_hit(handler, op, key, b, start, stop, reply)

    def open_(dref):
        opened.append(dref)
        known["yes"] = True
        return KEY

    handler.serve_hit, handler.open = serve_hit, open_
    ep = DataEndpoint(handler, SECRET, "127.0.0.1")
    links = PeerLinks(SECRET, timeout_s=30.0)
    try:
        assert bytes(links.read(ep.address, "peer", DREF, pw.READ, 4, 0, 64)[1]) == BLOCKS[4][:64]
        assert opened == [DREF]  # the peer (a restarted service) was told the dataset, once
    finally:
        links.close()
        ep.close()


def test_links_are_per_process(endpoint):
    import pickle

    ep, _ = endpoint
    links = PeerLinks(SECRET, timeout_s=30.0)
    try:
        links.ping(ep.address, "peer")
        copy = pickle.loads(pickle.dumps(links))  # as a spawned worker gets it
        assert len(copy) == 0 and copy.secret == SECRET
        copy.ping(ep.address, "peer")
        assert len(copy) == 1 and copy.link(ep.address, "peer") is not links.link(ep.address, "peer")
        copy.close()
    finally:
        links.close()
