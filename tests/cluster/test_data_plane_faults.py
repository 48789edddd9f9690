"""Faults on the data plane: nothing wrong is stored or delivered, and nothing hangs.

A connection cut mid-body, a short body, a body of another length than asked, a peer that never
answers a connection, a service killed during reads: each costs a read of the origin within the
router's bounds (``timeout_s``, then the peer skipped for ``retry_s``, a fallback counted), and the
peer is read again once it answers. A peer that sends wrong bytes of the right length is refused
(every block and sample from a peer is checked against the index checksums before it is kept or
delivered) and the origin read instead.

All but the last test run without Ray: the rank's router is made in this process with the
cluster secret given, the peers are fakes or in-process services (tests/cluster/_dataplane.py);
the last kills a real service actor on the session's test cluster."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ray")

from _dataplane import SECRET, Proxy, in_process_service, truth, whole  # noqa: E402

from stoker.cluster.counters import ByteCounters  # noqa: E402
from stoker.cluster.service import cache_service as service_mod  # noqa: E402
from stoker.cluster.service import peerwire as pw  # noqa: E402
from stoker.cluster.service.endpoint import DataEndpoint  # noqa: E402
from stoker.cluster.service.peerlinks import PeerLink  # noqa: E402
from stoker.cluster.service.reader import BlockRouter  # noqa: E402
from stoker.errors import OriginError  # noqa: E402
from stoker.store.blocks import BlockReader  # noqa: E402
from stoker.store.checks import verify_block  # noqa: E402
from stoker.store.dataset import open_dataset  # noqa: E402

BLOCK = 64 << 10
#: Longest a test waits for anything (a guard against hanging, not a speed limit), seconds.
GUARD_S = 60.0


@pytest.fixture
def ds(packed_local):
    return open_dataset(packed_local, cache=False, block_bytes=BLOCK)


@pytest.fixture
def counters(ds):
    c = ByteCounters()
    c.size_tags(len(ds.blocks))
    yield c
    c.close()


def _router(ds, counters, address, monkeypatch, timeout_s=2.0, retry_s=0.2, nodes=("peer",), me=-1, prior=None):
    """A rank's router whose every block belongs to ``nodes[0]``, a peer whose data endpoint is at
    ``address`` (Ray's lookups stood in: the endpoint is known, the node alive)."""
    r = BlockRouter(
        service_mod.dataset_ref(ds),
        list(nodes),
        np.zeros(len(ds.blocks), np.int64),
        me,
        counters,
        timeout_s=timeout_s,
        retry_s=retry_s,
        prior=prior,
        secret=SECRET,
    )
    peer = 0 if me != 0 else 1
    r.endpoints[peer] = address
    monkeypatch.setattr(r, "_lookup", lambda o: address)
    monkeypatch.setattr(r, "_node_alive", lambda o: True)
    return r


def _wait(cond, what: str, every_s: float = 0.02) -> None:
    deadline = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {GUARD_S} s"
        time.sleep(every_s)


class FakeEndpoint:
    """A data endpoint that passes the challenge, answers pings, and answers every read with
    ``answer(conn, rid, b, start, stop)`` (each a fault). ``connections``: how many it took."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                assert pw.server_handshake(conn, SECRET)
                while True:
                    op, rid, _, b, start, stop, _, _ = pw.REQUEST.unpack(pw.recv_exactly(conn, pw.REQUEST.size))
                    if op == pw.PING:
                        conn.sendall(pw.REPLY.pack(rid, pw.OK, 0))
                    elif not self.answer(conn, rid, b, start, stop):
                        return  # the fault closed the connection
            except OSError:
                return

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


def _check(ds, b: int):
    """The block reader's check of block ``b``'s bytes."""
    return lambda data: verify_block(ds, b, data)


def _reads_right_from_the_origin(ds, r, counters, b: int) -> None:
    start, stop = whole(ds, b)
    got = r.read(ds, b, start, stop, block=True, verify=_check(ds, b))
    assert bytes(got) == truth(ds, b, start, stop)
    c = counters.read()
    assert c["fallbacks"] == 1 and c["fetch_peer"] == 0 and c["fetch_origin"] == stop - start


@pytest.mark.parametrize("fault", ["short body", "body of another length"])
def test_a_short_or_wrong_length_body_costs_one_origin_read(ds, counters, monkeypatch, fault):
    """The fake endpoint sends a header and fewer bytes than it says, then closes; or a header
    saying another length than the range asked for. The read is delivered from the origin, the
    link is dropped (its leftover bytes never read as another reply's): the next contact, the
    router's ping, comes on a new connection."""

    def short(conn, rid, b, start, stop):
        body = truth(ds, b, start, stop)
        conn.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, len(body)) + body[: len(body) // 2])
        return False

    def other_length(conn, rid, b, start, stop):
        body = truth(ds, b, start, stop)[:-1]
        conn.sendall(pw.REPLY.pack(rid, pw.FROM_CACHE, len(body)) + body)
        return True

    fake = FakeEndpoint(short if fault == "short body" else other_length)
    r = _router(ds, counters, fake.address, monkeypatch)
    try:
        _reads_right_from_the_origin(ds, r, counters, 1)
        _wait(lambda: fake.connections == 2, "the ping's new connection")  # the faulty one was dropped
    finally:
        r.close()
        fake.close()


def test_a_connection_cut_mid_body_is_read_from_the_origin_then_the_peer_again(tmp_path, ds, counters, monkeypatch):
    """A real service behind a proxy that cuts the first connection half-way through the first
    block's body: that read comes from the origin (the service's side of the cut closes its
    connection and goes on); after ``retry_s`` the router's ping opens a new connection and the
    next reads come from the peer."""
    svc = in_process_service(tmp_path / "root", monkeypatch)
    dref = service_mod.dataset_ref(ds)
    assert svc.fill(dref, list(range(4)))["filled"] == 4
    start, stop = whole(ds, 1)
    # what comes back before the body: the greeting, the server's proof, the read's reply header
    cut_after = len(pw.MAGIC) + pw.NONCE_BYTES + pw.PROOF_BYTES + pw.REPLY.size + (stop - start) // 2
    proxy = Proxy(svc.endpoint(), cut_after=cut_after)
    r = _router(ds, counters, proxy.address, monkeypatch)
    try:
        _reads_right_from_the_origin(ds, r, counters, 1)
        _wait(lambda: r.suspects() == [], "the ping after the cut")
        time.sleep(0.3)  # past retry_s (0.2 s) after the failed read: the peer is asked again
        for b in (2, 3):
            s, e = whole(ds, b)
            assert bytes(r.read(ds, b, s, e, block=True, verify=_check(ds, b))) == truth(ds, b, s, e)
        c = counters.read()
        assert c["fallbacks"] == 1 and c["fetch_peer"] == sum(e - s for s, e in (whole(ds, 2), whole(ds, 3)))
        assert proxy.connections == 2  # the cut one, and the one opened again
        assert svc.info()["data_endpoint"]["accepted"] == 2
    finally:
        r.close()
        proxy.close()
        svc.close()


class _Backlogged:
    """An address that never answers: a listener that never accepts, its backlog full, so the
    kernel drops every new connection's SYN (the client's connect waits, as for a node that is
    gone from the network) without a packet leaving the machine."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.address = self.sock.getsockname()
        self.queued = [socket.create_connection(self.address, timeout=5) for _ in range(1)]
        probe = socket.socket()
        probe.settimeout(0.3)
        with pytest.raises(OSError):  # the backlog is full: a connect gets no answer
            probe.connect(self.address)
        probe.close()

    def close(self):
        for s in self.queued:
            s.close()
        self.sock.close()


def test_a_node_that_never_answers_costs_one_connect_timeout(ds, counters, monkeypatch):
    """The first read waits the connect timeout (the router's ``timeout_s``, 1 s here), then the
    origin; the next reads (within ``retry_s``) go to the origin at once without trying the peer
    (only the background ping does), every one right; closing the router ends the ping at once."""
    dead = _Backlogged()
    others = set(threading.enumerate())
    r = _router(ds, counters, dead.address, monkeypatch, timeout_s=1.0, retry_s=30.0)  # skipped throughout
    asked = []
    real = r.links.read
    monkeypatch.setattr(r.links, "read", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    try:
        t0 = time.monotonic()
        _reads_right_from_the_origin(ds, r, counters, 1)
        assert time.monotonic() - t0 < GUARD_S
        for b in range(2, 6):
            s, e = whole(ds, b)
            assert bytes(r.read(ds, b, s, e, block=True, verify=_check(ds, b))) == truth(ds, b, s, e)
        assert len(asked) == 1 and r.suspects() == ["peer"]
        assert counters.read()["fallbacks"] == 1  # the one failed call; the rest were not asked
        probes = [t for t in threading.enumerate() if t.name == "stoker-probe-0" and t not in others]
        assert probes
        r.close()
        for t in probes:
            t.join(GUARD_S)
        assert not any(t.is_alive() for t in probes)  # closing ends the pings (no connection after)
    finally:
        r.close()
        dead.close()


# -- a peer that lies ---------------------------------------------------------------------------
class _Liar:
    """A data endpoint's handler that answers every read with the right number of wrong bytes
    (the right ones with one byte changed): a damaged cache file, or worse."""

    def __init__(self, ds):
        self.ds = ds
        self.answered = 0

    def serve_hit(self, op, key, b, start, stop, reply):
        body = bytearray(truth(self.ds, b, start, stop))
        body[len(body) // 2] ^= 0xFF
        self.answered += 1
        reply.data(pw.FROM_CACHE, body)
        return True


def test_a_peer_that_sends_wrong_bytes_is_refused_and_the_origin_read(ds, counters, monkeypatch):
    """End to end through a rank's dataset: every sample read (peer bytes checked by the sample's
    checksum) and every block fetched (checked block-wise) is right, none of the lying peer's
    bytes is counted as read from it, and each refusal is a fallback."""
    liar = _Liar(ds)
    ep = DataEndpoint(liar, SECRET, "127.0.0.1", 0)
    r = _router(ds, counters, ep.address, monkeypatch, retry_s=0.0)
    routed = ds.with_reader(BlockReader(ds, router=r))
    try:
        ids = range(0, len(ds), 7)
        for i in ids:
            assert routed.read(i) == ds.read(i)
        b = 3
        assert bytes(routed.reader.fetch_block(b)) == truth(ds, b, *whole(ds, b))
        c = counters.read()
        assert liar.answered == len(ids) + 1  # every read asked the peer (it is not skipped: other blocks may be right)
        assert c["fallbacks"] == liar.answered and c["peer"] == 0 and c["fetch_peer"] == 0
        assert c["origin"] == sum(int(ds.index.length[i]) for i in ids)
        assert r.suspects() == []
    finally:
        r.close()
        ep.close()


def test_a_peer_that_sends_every_block_wrong_is_skipped_after_a_few(ds, counters, monkeypatch):
    """A node whose every answer fails the checksums (a broken disk, a bad build) is asked for
    WRONG_IN_A_ROW blocks, then skipped for ``retry_s``: the rest of the reads go straight to the
    origin, every byte delivered is right, and a node with one bad block in between right ones
    is never skipped (the count is of blocks in a row)."""
    from stoker.cluster.service.reader import WRONG_IN_A_ROW

    liar = _Liar(ds)
    ep = DataEndpoint(liar, SECRET, "127.0.0.1", 0)
    r = _router(ds, counters, ep.address, monkeypatch, retry_s=600.0)
    routed = ds.with_reader(BlockReader(ds, router=r))
    try:
        ids = range(0, len(ds), 5)
        assert len(ids) > WRONG_IN_A_ROW + 2
        for i in ids:
            assert routed.read(i) == ds.read(i)
        assert liar.answered == WRONG_IN_A_ROW
        c = counters.read()
        assert c["fallbacks"] == WRONG_IN_A_ROW and c["peer"] == 0
        assert c["origin"] == sum(int(ds.index.length[i]) for i in ids)
    finally:
        r.close()
        ep.close()


class _OneBadBlock(_Liar):
    """Right bytes, except for block ``bad``."""

    bad = 2

    def serve_hit(self, op, key, b, start, stop, reply):
        if b == self.bad:
            return super().serve_hit(op, key, b, start, stop, reply)
        self.answered += 1
        reply.data(pw.FROM_CACHE, bytearray(truth(self.ds, b, start, stop)))
        return True


def test_one_damaged_block_never_makes_its_node_skipped(ds, counters, monkeypatch):
    peer = _OneBadBlock(ds)
    ep = DataEndpoint(peer, SECRET, "127.0.0.1", 0)
    r = _router(ds, counters, ep.address, monkeypatch, retry_s=600.0)
    routed = ds.with_reader(BlockReader(ds, router=r))
    try:
        for _ in range(3):
            for b in (peer.bad, 0, 1, peer.bad):
                assert bytes(routed.reader.fetch_block(b)) == truth(ds, b, *whole(ds, b))
        assert peer.answered == 12  # every read asked it
        assert counters.read()["fallbacks"] == 6
    finally:
        r.close()
        ep.close()


def test_a_previous_owner_that_sends_wrong_bytes_is_never_cached(tmp_path, packed_local, ds, counters, monkeypatch):
    """The rank's node owns the blocks now; their previous owner hands them off with wrong bytes:
    the node cache keeps only the origin's, right, bytes."""
    cached = open_dataset(packed_local, str(tmp_path / "cache"), 64 << 20, block_bytes=BLOCK)
    liar = _Liar(cached)
    ep = DataEndpoint(liar, SECRET, "127.0.0.1", 0)
    prior = np.ones(len(cached.blocks), np.int64)
    # (retry_s=0: never skipped after wrong blocks in a row, so every handoff asks it)
    r = _router(cached, counters, ep.address, monkeypatch, nodes=("me", "before"), me=0, prior=prior, retry_s=0.0)
    routed = cached.with_reader(BlockReader(cached, router=r))
    try:
        for i in range(0, len(cached), 11):
            assert routed.read(i) == ds.read(i)
        held = [b for b in range(len(cached.blocks)) if cached.cache.contains(cached.version, cached.blocks.name(b))]
        assert held and liar.answered == len(held)
        for b in held:
            start, stop = whole(cached, b)
            assert bytes(cached.cache.read(cached.version, cached.blocks.name(b), 0, stop - start)) == truth(
                cached, b, start, stop
            )
        c = counters.read()
        assert c["fetch_handoff"] == 0 and c["fallbacks"] == len(held)
    finally:
        r.close()
        ep.close()


# -- the endpoint's side ------------------------------------------------------------------------
class _OriginFails:
    """A handler whose fills fail for block 0 (the origin refuses) and serve the others."""

    def __init__(self, ds):
        self.ds = ds

    def serve_hit(self, op, key, b, start, stop, reply):
        return False  # nothing cached: every read is a fill

    def serve(self, op, key, b, start, stop, prior, wait_s, reply):
        if b == 0:
            raise OriginError("s3://bucket/shard-0.tar", "SlowDown after 5 attempts")
        reply.data(pw.FROM_ORIGIN, truth(self.ds, b, start, stop))


def test_an_origin_error_behind_a_read_is_answered_and_the_connection_goes_on(ds):
    """The service's fill fails (an OSError of the origin's, not of the connection): the client
    gets ERROR with the reason, and the other requests on the same connection are answered (the
    connection used to be shut down, failing every read in flight on it)."""
    ep = DataEndpoint(_OriginFails(ds), SECRET, "127.0.0.1", 0)
    link = PeerLink(ep.address, SECRET, "peer", timeout_s=10.0)
    key = pw.dataset_key(ds.version, BLOCK)
    try:
        status, body = link.request(pw.READ, key, 0, *whole(ds, 0))
        assert status == pw.ERROR and b"OriginError" in bytes(body) and b"SlowDown" in bytes(body)
        assert not link.broken
        assert link.request(pw.READ, key, 1, *whole(ds, 1)) == (pw.FROM_ORIGIN, bytearray(truth(ds, 1, *whole(ds, 1))))
    finally:
        link.close()
        ep.close()


# -- a real service killed during reads ---------------------------------------------------------
def test_a_service_killed_during_reads_costs_fallbacks_then_serves_again_on_its_port(
    cluster, s3_dataset, tmp_path, fresh_services
):
    """Three threads of a rank read samples whose blocks all live on one node's service; that
    service is killed (Ray restarts it) in the middle: every sample delivered is right, the reads
    in flight and the next ones go to the origin (fallbacks counted), none waits past the
    bounds, and once the restarted service answers a ping (on the port its node had: its peers'
    links find it where they left it) the reads come from it again."""
    ray = pytest.importorskip("ray")
    from stoker.cluster.service.cache_service import alive_nodes, find_services, get_service, start_services

    url, opts = s3_dataset
    start_services(str(tmp_path / "cache"), 64 << 20)
    plain = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    dref = service_mod.dataset_ref(plain, opts)
    victim = alive_nodes()[1]["NodeID"]
    assert ray.get(get_service(victim).fill.remote(dref, list(range(len(plain.blocks)))), timeout=120)["failed"] == 0
    before = find_services()[victim]
    counters = ByteCounters()
    counters.size_tags(len(plain.blocks))
    r = BlockRouter(dref, [victim], np.zeros(len(plain.blocks), np.int64), -1, counters, timeout_s=10.0, retry_s=0.2)
    routed = plain.with_reader(BlockReader(plain, router=r))
    right = {i: plain.read(i) for i in range(len(plain))}
    wrong, reads, stop = [], [0], threading.Event()

    def reader(k: int) -> None:
        i = k
        while not stop.is_set():
            if routed.read(i % len(plain)) != right[i % len(plain)]:
                wrong.append(i)
            reads[0] += 1
            i += 3

    try:
        assert r.connect() == []
        threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(3)]
        for t in threads:
            t.start()
        _wait(lambda: counters.read()["peer"] > 0, "reads from the peer")
        ray.kill(get_service(victim), no_restart=False)
        _wait(lambda: counters.read()["fallbacks"] > 0, "a fallback after the kill")
        restarted = lambda: find_services().get(victim, before)["pid"] != before["pid"]  # noqa: E731
        _wait(restarted, "the restart", every_s=0.2)
        _wait(lambda: r.suspects() == [], "the ping that finds it back")
        peer_after = counters.read()["peer"]
        _wait(lambda: counters.read()["peer"] > peer_after, "reads from the restarted service")
        stop.set()
        for t in threads:
            t.join(GUARD_S)
        assert not any(t.is_alive() for t in threads)
        assert wrong == [] and reads[0] > 0
        after = find_services()[victim]
        assert after["data_endpoint"]["port"] == before["data_endpoint"]["port"]
        assert after["data_endpoint"]["host"] == "127.0.0.1"  # the node's address from Ray
    finally:
        stop.set()
        r.close()
        counters.close()
