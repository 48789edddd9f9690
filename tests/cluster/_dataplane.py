"""Helpers of the data plane's tests: cache services in the test process without Ray, a TCP
proxy that records or cuts a connection, and the truth about a block's bytes."""

from __future__ import annotations

import contextlib
import socket
import threading

from stoker import CacheOptions
from stoker.cluster.service import cache_service as service_mod

#: The cluster secret of the services and clients made in the test process.
SECRET = b"k" * 32


class _Here:
    def __init__(self, nid: str):
        self.nid = nid

    def get_node_id(self) -> str:
        return self.nid


def no_ray(monkeypatch, node_ip: str = "127.0.0.1", node_id: str = "node-a") -> None:
    """What a cache service asks of Ray, stood in: its node, the cluster secret (:data:`SECRET`)
    and the node's address (``node_ip``)."""
    monkeypatch.setattr(service_mod.ray, "get_runtime_context", lambda: _Here(node_id))
    monkeypatch.setattr(service_mod.pw, "cluster_secret", lambda *a, **kw: SECRET)
    monkeypatch.setattr(service_mod.ray.util, "get_node_ip_address", lambda: node_ip)


def in_process_service(root, monkeypatch, node_ip: str = "127.0.0.1"):
    """A :class:`~stoker.cluster.service.cache_service.CacheService` of node ``node-a`` in this
    process (64 MiB under ``root``), its data endpoint on ``node_ip``; the caller closes it."""
    no_ray(monkeypatch, node_ip)
    return service_mod.CacheService("node-a", CacheOptions(cache_dir=str(root), cache_bytes=64 << 20))


def truth(ds, b: int, start: int, stop: int) -> bytes:
    """Shard bytes ``[start, stop)`` of block ``b`` of ``ds``, from its origin."""
    return bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop))


def whole(ds, b: int) -> tuple[int, int]:
    """The shard range ``(start, end)`` of block ``b``."""
    return int(ds.blocks.start[b]), int(ds.blocks.end[b])


def drain(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """Everything ``sock`` receives until the other side closes (or resets) it."""
    sock.settimeout(limit_s)
    got = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return bytes(got)


class Proxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (``(host, port)``). Its first
    connection's bytes are recorded each way (``sent``: client to server, ``received``: back);
    with ``cut_after``, that connection is cut (both sides shut down) once that many bytes came
    back from upstream, in the middle of whatever was on its way. Later connections pass whole.
    ``connections``: how many it took. :meth:`close` stops it."""

    def __init__(self, upstream: tuple[str, int], cut_after: int | None = None):
        self.upstream, self.cut_after = upstream, cut_after
        self.sent, self.received = bytearray(), bytearray()
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._one, args=(client, self.connections == 1), daemon=True)
            self._threads.append(t)
            t.start()

    def _one(self, client: socket.socket, first: bool) -> None:
        server = socket.create_connection(self.upstream)
        pair = (client, server)
        pumps = [
            threading.Thread(target=self._pump, args=(client, server, self.sent if first else None, None, pair)),
            threading.Thread(
                target=self._pump,
                args=(server, client, self.received if first else None, self.cut_after if first else None, pair),
            ),
        ]
        for p in pumps:
            p.start()
        for p in pumps:
            p.join(60)
        for s in pair:
            s.close()

    @staticmethod
    def _pump(src, dst, record: bytearray | None, limit: int | None, pair) -> None:
        n = 0
        with contextlib.suppress(OSError):
            while chunk := src.recv(1 << 16):
                if limit is not None and n + len(chunk) >= limit:
                    dst.sendall(chunk[: limit - n])
                    for s in pair:  # the cut: both ends see the connection end here
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)
                    return
                n += len(chunk)
                if record is not None:
                    record += chunk
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._accepting.join(30)
        for t in self._threads:
            t.join(60)
