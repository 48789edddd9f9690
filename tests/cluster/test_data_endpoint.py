"""Nobody else reads the cache: the data endpoint of a cache service serves block bytes only to
a client that proves it holds the cluster's secret, and only blocks and ranges of a dataset the
service has opened.

Each refused client gets no body byte, and no cache file is opened for it: the service's handler
is never called for a client that fails the challenge, the dataset's cache is not asked (its
``with_fd``/``read``/``contains``/``fill``), and no file under the node's cache directory is
opened (a Python audit hook sees every ``open``/``os.open``). A good client's read, in the same
test, shows each of these signals does fire.

Also where the endpoint listens: the node's address from Ray, not every address, unless
``STOKER_DATA_HOST`` says so; ``STOKER_DATA_PORT`` honoured, and a bad one fails the service's
start with an error naming it; the port kept for a restarted service.

The services run in this process without Ray (their node id, the cluster secret and Ray's node
address stood in), over the local packed dataset; the last test starts services on nodes of the
test cluster with the variables in their environment."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading

import pytest

pytest.importorskip("ray")

from _dataplane import SECRET, Proxy, drain, in_process_service, no_ray, truth, whole  # noqa: E402

from stoker.cluster.service import cache_service as service_mod  # noqa: E402
from stoker.cluster.service import peerwire as pw  # noqa: E402
from stoker.cluster.service.endpoint import DataEndpoint  # noqa: E402
from stoker.cluster.service.peerlinks import PeerLink, PeerLinks  # noqa: E402
from stoker.errors import PeerUnavailable, ServiceStartError  # noqa: E402

BLOCK = 64 << 10
GREETING = len(pw.MAGIC) + pw.NONCE_BYTES

# -- what a request touched ---------------------------------------------------------------------
_WATCHED: list[str] = []  # directories whose file opens are recorded, while a test watches
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCHED or not isinstance(args[0], (str, bytes)):
        return
    path = os.fsdecode(args[0])
    if any(path.startswith(d) for d in _WATCHED):
        _OPENED.append(path)


sys.addaudithook(_audit)  # cheap while nothing is watched; an audit hook cannot be removed


class Touches:
    """What a service did for the requests made while it is watched: its endpoint handler's
    calls, its datasets' cache calls, and the files opened under its node cache directory."""

    def __init__(self, svc, monkeypatch):
        self.handler: list[str] = []
        self.cache: list[str] = []
        for name in ("serve_hit", "serve", "open"):
            monkeypatch.setattr(svc, name, self._spy(getattr(svc, name), self.handler, name))
        for ds in svc.opened_datasets():
            for name in ("with_fd", "read", "contains"):
                monkeypatch.setattr(ds.cache, name, self._spy(getattr(ds.cache, name), self.cache, name))
            monkeypatch.setattr(ds.reader, "fill_block", self._spy(ds.reader.fill_block, self.cache, "fill_block"))
        self._dir = os.path.realpath(svc.cache.cache_dir)

    @staticmethod
    def _spy(real, calls: list, name: str):
        def spied(*a, **kw):
            calls.append(name)
            return real(*a, **kw)

        return spied

    @contextlib.contextmanager
    def watching(self):
        self.handler.clear()
        self.cache.clear()
        _OPENED.clear()
        _WATCHED[:] = [self._dir]
        try:
            yield self
        finally:
            _WATCHED.clear()

    @property
    def opened(self) -> list[str]:
        return list(_OPENED)


@pytest.fixture
def served(tmp_path, packed_local, monkeypatch):
    """``(service, dataset, dref, touches)``: a service with the packed dataset opened and its
    blocks 0 and 1 cached (block 2 not), watched by a :class:`Touches`."""
    from stoker.store.dataset import open_dataset

    for var in (service_mod.DATA_HOST_ENV, service_mod.DATA_PORT_ENV):
        monkeypatch.delenv(var, raising=False)
    svc = in_process_service(tmp_path / "root", monkeypatch)
    ds = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    dref = service_mod.dataset_ref(ds)
    assert svc.fill(dref, [0, 1])["filled"] == 2
    try:
        yield svc, ds, dref, Touches(svc, monkeypatch)
    finally:
        svc.close()


def _request(dref, b: int, start: int, stop: int, op: int = pw.READ, rid: int = 1) -> bytes:
    key = pw.dataset_key(dref["version"], dref["block_bytes"])
    return pw.REQUEST.pack(op, rid, key, b, start, stop, pw.node_bytes(None), 0.0)


def _assert_untouched(t: Touches) -> None:
    assert t.handler == [], t.handler  # the service was never asked
    assert t.cache == [], t.cache  # nor its cache
    assert t.opened == [], t.opened  # and no file under the node cache was opened


# -- clients that lack the secret ---------------------------------------------------------------
def test_a_client_without_the_secret_gets_the_greeting_and_nothing_else(served):
    """It skips the challenge and sends a read of a cached block: the endpoint takes its first
    bytes for an answer to the challenge, finds them wrong and closes without a byte more."""
    svc, ds, dref, touches = served
    with touches.watching(), socket.create_connection(svc.endpoint()) as sock:
        hello = pw.recv_exactly(sock, GREETING)
        assert hello[:4] == pw.MAGIC
        start, stop = whole(ds, 0)
        sock.sendall(_request(dref, 0, start, stop))
        assert drain(sock) == b""  # no reply header, no body
        _assert_untouched(touches)
    assert svc.info()["data_endpoint"]["refused"] == 1


def test_a_client_that_says_nothing_is_dropped_without_touching_the_cache(served):
    svc, ds, dref, touches = served
    ep = DataEndpoint(svc, SECRET, "127.0.0.1", 0, handshake_s=0.5)  # the service's handler, a short wait
    try:
        with touches.watching(), socket.create_connection(ep.address) as sock:
            assert pw.recv_exactly(sock, GREETING)[:4] == pw.MAGIC
            assert drain(sock) == b""  # closed after the wait, without a word
            _assert_untouched(touches)
    finally:
        ep.close()


def test_a_client_with_a_wrong_secret_is_refused(served):
    svc, ds, dref, touches = served
    start, stop = whole(ds, 0)
    with touches.watching():
        with socket.create_connection(svc.endpoint()) as sock:
            with pytest.raises(PeerUnavailable, match="refused this client's proof"):
                pw.client_handshake(sock, b"w" * 32)
            with contextlib.suppress(OSError):  # closed by now: whatever it sends is not read
                sock.sendall(_request(dref, 0, start, stop))
            assert drain(sock) == b""
        links = PeerLinks(b"w" * 32, timeout_s=5.0)
        with pytest.raises(PeerUnavailable, match="another cluster's secret"):
            links.read(svc.endpoint(), "node-a", dref, pw.READ, 0, start, stop)
        links.close()
        _assert_untouched(touches)
    assert svc.info()["data_endpoint"]["refused"] == 2 and svc.info()["data_endpoint"]["accepted"] == 0


def test_a_replayed_exchange_is_refused_both_ways(served):
    """A good client's connection is recorded through a proxy (its challenge answer and a read);
    played back on a new connection, the endpoint's fresh nonce makes the old answer wrong: the
    connection is closed with no reply. Played back by a fake server to a client (a process that
    took the endpoint's port), the client's fresh nonce makes the old server proof wrong."""
    svc, ds, dref, touches = served
    start, stop = whole(ds, 0)
    rec = Proxy(svc.endpoint())
    good = PeerLinks(SECRET, timeout_s=10.0)
    assert good.read(rec.address, "node-a", dref, pw.READ, 0, start, stop) == ("cache", truth(ds, 0, start, stop))
    good.close()
    rec.close()
    captured = bytes(rec.sent)
    assert len(captured) == pw.NONCE_BYTES + pw.PROOF_BYTES + pw.REQUEST.size  # the answer, then the read

    with touches.watching(), socket.create_connection(svc.endpoint()) as sock:
        assert pw.recv_exactly(sock, GREETING)[:4] == pw.MAGIC  # a fresh nonce
        sock.sendall(captured)
        assert drain(sock) == b""
        _assert_untouched(touches)
    assert svc.info()["data_endpoint"]["refused"] == 1

    # the other way: a fake endpoint replays the server's side to a new client
    fake = socket.create_server(("127.0.0.1", 0))
    replayed = bytes(rec.received[: GREETING + pw.PROOF_BYTES])  # old greeting + old server proof

    def play():
        conn, _ = fake.accept()
        with conn:
            conn.sendall(replayed)
            drain(conn)

    t = threading.Thread(target=play, daemon=True)
    t.start()
    try:
        with pytest.raises(PeerUnavailable, match="proof is wrong"):
            PeerLink(fake.getsockname(), SECRET, "impostor", timeout_s=5.0)
    finally:
        fake.close()
        t.join(30)


# -- a client with the secret asks for what is not there -----------------------------------------
def test_requests_outside_the_datasets_blocks_are_refused_without_reading_the_cache(served):
    svc, ds, dref, touches = served
    link = PeerLink(svc.endpoint(), SECRET, "node-a", timeout_s=10.0)
    key = pw.dataset_key(dref["version"], dref["block_bytes"])
    other = pw.dataset_key("another-version", BLOCK)  # a dataset this service never opened
    s0, e0 = whole(ds, 0)
    s1, e1 = whole(ds, 1)
    n = len(ds.blocks)
    asks = {
        "another dataset's block": (pw.READ, other, 0, s0, e0),
        "a block past the last": (pw.READ, key, n, s0, e0),
        "a negative block": (pw.READ, key, -1, s0, e0),
        "a range past the block's end": (pw.READ, key, 0, s0, e0 + 1),
        "a range before the block's start": (pw.READ, key, 1, s1 - 1, e1),
        "another block's range": (pw.CACHED, key, 0, s1, e1),
        "a range backwards": (pw.READ, key, 0, e0, s0),
        "a range over the longest body": (pw.READ, key, 0, 0, pw.MAX_BODY + 1),
        "an unknown op": (99, key, 0, s0, e0),
    }
    try:
        with touches.watching():
            for what, (op, k, b, start, stop) in asks.items():
                status, body = link.request(op, k, b, start, stop)
                assert status in (pw.ERROR, pw.UNKNOWN_DATASET), what
                assert len(body) < 512 and truth(ds, 0, s0, s0 + 64) not in body, what  # a message only
                assert status != pw.ERROR or body, what  # the message says why
            _assert_untouched_cache(touches)
        # a refused request does not end the connection: the next good one is answered
        assert link.request(pw.READ, key, 0, s0, e0) == (pw.FROM_CACHE, bytearray(truth(ds, 0, s0, e0)))
    finally:
        link.close()


def _assert_untouched_cache(t: Touches) -> None:
    # the handler saw the requests (it is what refuses them) but read nothing for them
    assert t.cache == [], t.cache
    assert t.opened == [], t.opened


def test_the_refusal_names_the_block_and_the_dataset(served):
    svc, ds, dref, _ = served
    links = PeerLinks(SECRET, timeout_s=10.0)
    n = len(ds.blocks)
    s0, e0 = whole(ds, 0)
    try:
        with pytest.raises(PeerUnavailable, match=f"has no block {n}") as ei:
            links.read(svc.endpoint(), "node-a", dref, pw.READ, n, s0, e0)
        assert ds.url in str(ei.value)
        with pytest.raises(PeerUnavailable, match=rf"bytes \[{s0}, {e0 + 1}\) are not in block"):
            links.read(svc.endpoint(), "node-a", dref, pw.READ, 0, s0, e0 + 1)
    finally:
        links.close()


def test_a_good_client_is_served_and_each_signal_fires(served):
    """The control: a read of a cached block asks the handler and the cache and opens the
    block's file; a cache-only read of a block not held answers NOT_HELD with no body."""
    svc, ds, dref, touches = served
    s1, e1 = whole(ds, 1)
    s2, e2 = whole(ds, 2)
    links = PeerLinks(SECRET, timeout_s=10.0)
    try:
        with touches.watching():
            assert links.read(svc.endpoint(), "node-a", dref, pw.READ, 1, s1, e1) == ("cache", truth(ds, 1, s1, e1))
            assert "serve_hit" in touches.handler and "with_fd" in touches.cache
            assert any(ds.blocks.name(1) in p for p in touches.opened), touches.opened
            assert links.read(svc.endpoint(), "node-a", dref, pw.CACHED, 2, s2, e2) == (None, bytearray())
    finally:
        links.close()
    assert svc.info()["data_endpoint"]["accepted"] == 1


# -- where it listens ---------------------------------------------------------------------------
def test_the_endpoint_listens_on_the_nodes_address_from_ray_not_every_address(tmp_path, monkeypatch):
    monkeypatch.delenv(service_mod.DATA_HOST_ENV, raising=False)
    monkeypatch.delenv(service_mod.DATA_PORT_ENV, raising=False)
    svc = in_process_service(tmp_path / "root", monkeypatch, node_ip="127.0.0.2")  # the node's address, as Ray has it
    try:
        host, port = svc.endpoint()
        assert host == "127.0.0.2" and svc.info()["data_endpoint"]["host"] == "127.0.0.2"
        _ping((host, port))
        with pytest.raises(ConnectionRefusedError):  # another address of the machine: nothing listens there
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        svc.close()


def test_stoker_data_host_widens_it_and_peers_are_told_the_nodes_address(tmp_path, monkeypatch):
    """``STOKER_DATA_HOST=0.0.0.0`` listens on every address; the address the service gives its
    peers is still the node's (a peer told 0.0.0.0 would connect to its own host)."""
    monkeypatch.setenv(service_mod.DATA_HOST_ENV, "0.0.0.0")
    monkeypatch.delenv(service_mod.DATA_PORT_ENV, raising=False)
    svc = in_process_service(tmp_path / "root", monkeypatch, node_ip="127.0.0.2")
    try:
        host, port = svc.endpoint()
        assert host == "127.0.0.2" and svc.info()["data_endpoint"]["host"] == "0.0.0.0"
        _ping(("127.0.0.1", port))  # every address
    finally:
        svc.close()


def _ping(address) -> None:
    links = PeerLinks(SECRET, timeout_s=5.0)
    try:
        links.ping(address, "node-a")
    finally:
        links.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stoker_data_port_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv(service_mod.DATA_HOST_ENV, raising=False)
    port = _free_port()
    monkeypatch.setenv(service_mod.DATA_PORT_ENV, str(port))
    svc = in_process_service(tmp_path / "root", monkeypatch)
    try:
        assert svc.endpoint() == ("127.0.0.1", port)
    finally:
        svc.close()


@pytest.mark.parametrize("bad", ["http", "70000", "-1", "taken"])
def test_a_bad_stoker_data_port_fails_the_start_naming_it(tmp_path, monkeypatch, bad):
    monkeypatch.delenv(service_mod.DATA_HOST_ENV, raising=False)
    with contextlib.ExitStack() as stack:
        if bad == "taken":
            holder = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            bad = str(holder.getsockname()[1])
        monkeypatch.setenv(service_mod.DATA_PORT_ENV, bad)
        with pytest.raises(ServiceStartError, match=service_mod.DATA_PORT_ENV) as ei:
            in_process_service(tmp_path / "root", monkeypatch)
    assert bad in str(ei.value)


def test_a_stoker_data_host_not_on_the_node_fails_the_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(service_mod.DATA_HOST_ENV, "192.0.2.1")  # TEST-NET-1: no address of this machine
    monkeypatch.delenv(service_mod.DATA_PORT_ENV, raising=False)
    with pytest.raises(ServiceStartError, match=f"{service_mod.DATA_HOST_ENV}=192.0.2.1"):
        in_process_service(tmp_path / "root", monkeypatch)


def test_a_restarted_service_listens_on_the_port_its_node_had(tmp_path, monkeypatch):
    """The port is kept in ``<node cache dir>/.data-endpoint``: the next endpoint of the node takes
    it again (its peers' links find it where they left it); when another process holds it, any
    free port, recorded in its place."""
    monkeypatch.delenv(service_mod.DATA_HOST_ENV, raising=False)
    monkeypatch.delenv(service_mod.DATA_PORT_ENV, raising=False)
    no_ray(monkeypatch)
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    first = service_mod._listen(None, SECRET, str(node_dir))
    port = first.port
    first.close()
    again = service_mod._listen(None, SECRET, str(node_dir))
    assert again.port == port and (node_dir / ".data-endpoint").read_text() == str(port)
    again.close()
    with socket.create_server(("127.0.0.1", port)):  # taken by another process meanwhile
        moved = service_mod._listen(None, SECRET, str(node_dir))
    assert moved.port != port and (node_dir / ".data-endpoint").read_text() == str(moved.port)
    moved.close()


# -- on the test cluster: the variables in the environment of a node's `ray start` --------------
def test_the_variables_are_read_from_the_nodes_environment(cluster, tmp_path, fresh_services):
    """Two nodes join with the variables in their raylet's environment (what ``ray start`` on a
    node passes on to its actors): one listens on every address on a fixed port and tells its
    peers the node's address; the other's port is no port, so its service cannot start, and the
    error names the node and the variable."""
    from stoker.cluster.service.cache_service import find_services, start_services

    port = _free_port()
    loopback = {"num_cpus": 0, "object_store_memory": 100 << 20, "node_ip_address": "127.0.0.1"}
    good = cluster.add_node(
        resources={"data_env_good": 1},
        env_vars={service_mod.DATA_HOST_ENV: "0.0.0.0", service_mod.DATA_PORT_ENV: str(port)},
        **loopback,
    )
    bad = cluster.add_node(resources={"data_env_bad": 1}, env_vars={service_mod.DATA_PORT_ENV: "70000"}, **loopback)
    try:
        cluster.wait_for_nodes()
        down: dict = {}
        start_services(str(tmp_path / "cache"), 64 << 20, down=down)
        assert list(down) == [bad.node_id]
        assert "could not start" in down[bad.node_id] and f"{service_mod.DATA_PORT_ENV} must be" in down[bad.node_id]
        info = find_services()[good.node_id]["data_endpoint"]
        assert (info["host"], info["port"], info["public_host"]) == ("0.0.0.0", port, "127.0.0.1")
        others = [i["data_endpoint"] for n, i in find_services().items() if n != good.node_id]
        assert others and all(e["host"] == "127.0.0.1" for e in others)  # the node's address from Ray
    finally:
        service_mod.stop_services()
        for node in (good, bad):
            cluster.remove_node(node)
