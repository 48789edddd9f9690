"""Cluster reads: a block router for :class:`stoker.store.dataset.Dataset` (local → peer → origin).

The router tells the dataset which blocks this node's cache holds (the blocks placed on this
node by :mod:`stoker.cluster.placement`) and reads the others from the node that owns them,
through that node's cache service; if the owner is down, slow or gone, it reads the origin
(a *fallback*) and tries the owner again after ``retry_s`` seconds, so a restarted service
rejoins by itself. Every byte is counted in the rank's :class:`ByteCounters` (local / peer /
origin / peer_origin / fallbacks).

Ray calls work only in the process that joined Ray (the training worker). The loader's decode
workers and prefetcher are forked children; they reach peers through a relay: a thread of the
training worker serving a Unix socket (mode 0600 in a private directory, HMAC challenge with a
random key: ``multiprocessing.connection``), raw bytes in both directions (no pickle).
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener

import numpy as np

from ..errors import PeerUnavailable  # noqa: F401 - re-exported
from .counters import ByteCounters

log = logging.getLogger(__name__)

_REQ = struct.Struct("<iqqq")  # owner node index, block, start, stop


class BlockRouter:
    """Where a dataset's blocks live in the cluster, and reads of the ones not on this node.

    ``dref``: the dataset as the peers open it (:func:`stoker.cluster.service.dataset_ref`);
    ``nodes``: node ids (hex), the placement members; ``owner``: int array (num_blocks,), index
    into ``nodes`` of each block's owner; ``me``: index of this node in ``nodes`` (-1: this node
    caches nothing of the dataset); ``counters``: the rank's :class:`ByteCounters`;
    ``timeout_s``: longest wait for one peer read (then the origin); ``retry_s``: how long a
    peer that failed is skipped. Picklable (a copy in a forked child uses the relay).
    """

    def __init__(self, dref: dict, nodes: list[str], owner: np.ndarray,
                 me: int, counters: ByteCounters, timeout_s: float = 30.0, retry_s: float = 1.0):
        self.dref, self.url = dict(dref), dref["url"]
        self.nodes, self.owner, self.me = list(nodes), np.asarray(owner, dtype=np.int64), int(me)
        self.counters, self.timeout_s, self.retry_s = counters, float(timeout_s), float(retry_s)
        self.relay_address: str | None = None
        self.relay_key: bytes | None = None
        self._ray_pid = os.getpid()
        self._init_local()

    def _init_local(self):
        self._handles: dict[int, object] = {}
        self._down_until: dict[int, float] = {}
        self._suspect: set[int] = set()  # peers whose last call failed: their node is checked first
        self._alive: tuple[float, frozenset] = (-float("inf"), frozenset())  # (when, alive node ids)
        self._tls = threading.local()

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_handles", "_down_until", "_suspect", "_alive", "_tls")}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_local()

    # -- the Dataset's side ---------------------------------------------------
    def caches(self, b: int) -> bool:
        """Whether block ``b`` belongs in this node's cache."""
        return self.me >= 0 and int(self.owner[b]) == self.me

    def local(self, nbytes: int) -> None:
        """Count ``nbytes`` served by this node's cache."""
        self.counters.add(local=nbytes)

    def read(self, ds, b: int, start: int, stop: int) -> bytes:
        """Shard bytes ``[start, stop)`` of block ``b``: from its owning peer, else the origin.

        The caller verifies the bytes against the index. Raises what the origin raises
        (:class:`stoker.storage.OriginError`) when the origin fails too.
        """
        o = int(self.owner[b])
        if o != self.me and time.monotonic() >= self._down_until.get(o, 0.0):
            try:
                source, data = self._peer_read(o, b, start, stop)
            except Exception as exc:  # noqa: BLE001 - any failure of a peer: read the origin
                log.warning("peer %s unavailable for block %s of %s (%s); reading the origin",
                            self.nodes[o], ds.block_name(b), self.url, exc)
                self._down_until[o] = time.monotonic() + self.retry_s
                self._handles.pop(o, None)
                self.counters.add(fallbacks=1)
            else:
                self.counters.add(**{"peer" if source == "cache" else "peer_origin": len(data)})
                return data
        data = ds.origin.read_range(ds.index.shard_name(ds.block_shard[b]), start, stop)
        self.counters.add(origin=len(data))
        return data

    # -- peers ----------------------------------------------------------------------
    def _peer_read(self, o: int, b: int, start: int, stop: int) -> tuple[str, bytes]:
        if os.getpid() == self._ray_pid:
            return self.ray_read(o, b, start, stop)
        return self._relay_read(o, b, start, stop)

    def _node_alive(self, o: int) -> bool:
        """Whether Ray lists the node of peer ``o`` as alive (``ray.nodes()``, asked at most every
        ``retry_s`` seconds: a cheap call to Ray's control store, not to the peer)."""
        import ray
        when, alive = self._alive
        if time.monotonic() - when >= self.retry_s:
            try:
                alive = frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
            except Exception:  # noqa: BLE001 - no answer from Ray: try the peer as before
                return True
            self._alive = (time.monotonic(), alive)
        return self.nodes[o] in alive

    def ray_read(self, o: int, b: int, start: int, stop: int) -> tuple[str, bytes]:
        """A peer read through Ray (only in the process that joined Ray). Raises PeerUnavailable.

        After a failed call the peer is suspect: before it is called again its node must be
        alive in Ray's node table, so a peer on a dead node costs one failed call (one stall of
        at most ``timeout_s``), then an immediate PeerUnavailable (a read of the origin) until
        its node is back; a service restarting on a live node is called as usual.
        """
        import ray

        from .service import get_service
        if o in self._suspect and not self._node_alive(o):
            raise PeerUnavailable(f"cache service of node {self.nodes[o]}: the node is dead")
        try:
            h = self._handles.get(o)
            if h is None:
                h = self._handles[o] = get_service(self.nodes[o])
            source, data = ray.get(h.read.remote(self.dref, int(b), int(start), int(stop)),
                                  timeout=self.timeout_s)
        except (ValueError, ray.exceptions.RayError) as exc:
            self._suspect.add(o)
            self._handles.pop(o, None)
            raise PeerUnavailable(f"cache service of node {self.nodes[o]}: {type(exc).__name__}: {exc}") from exc
        self._suspect.discard(o)
        if not isinstance(data, bytes) or len(data) != stop - start:
            raise PeerUnavailable(f"cache service of node {self.nodes[o]} sent {len(data)} bytes, "
                                  f"expected {stop - start}")
        return source, data

    def _relay_read(self, o: int, b: int, start: int, stop: int) -> tuple[str, bytes]:
        if self.relay_address is None:
            raise PeerUnavailable("no relay to the peers in this process (not the Ray worker)")
        conn = getattr(self._tls, "conn", None)
        if conn is None or getattr(self._tls, "pid", None) != os.getpid():
            conn = self._tls.conn = Client(self.relay_address, family="AF_UNIX", authkey=self.relay_key)
            self._tls.pid = os.getpid()
        try:
            conn.send_bytes(_REQ.pack(o, b, start, stop))
            reply = conn.recv_bytes()
        except (OSError, EOFError) as exc:
            self._tls.conn = None
            raise PeerUnavailable(f"relay {self.relay_address}: {exc}") from exc
        kind, data = reply[:1], reply[1:]
        if kind == b"E":
            raise PeerUnavailable(data.decode(errors="replace"))
        return ("cache" if kind == b"C" else "origin"), data

    # -- the relay, run by the Ray worker ------------------------------------------
    def start_relay(self) -> "Relay":
        """Serve peer reads for this process's forked children; returns the :class:`Relay`."""
        relay = Relay(self)
        self.relay_address, self.relay_key = relay.address, relay.authkey
        return relay


class Relay:
    """A Unix-socket server in the Ray worker that performs peer reads for its child processes.

    One thread per connection; requests are fixed-size structs, replies a kind byte (``C``:
    from the peer's cache, ``O``: the peer fetched from the origin, ``E``: error text) and the
    bytes. :meth:`close` stops it and removes its directory.
    """

    def __init__(self, router: BlockRouter):
        self._router = router
        self._dir = tempfile.mkdtemp(prefix="stoker-relay-")  # mode 0700
        self.address = os.path.join(self._dir, "peers.sock")
        self.authkey = os.urandom(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        os.chmod(self.address, 0o600)
        self._closed = False
        threading.Thread(target=self._accept, name="stoker-relay", daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - closed, or a client failed the challenge
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            while True:
                try:
                    req = conn.recv_bytes(_REQ.size)
                except (OSError, EOFError):
                    return
                o, b, start, stop = _REQ.unpack(req)
                try:
                    source, data = self._router.ray_read(o, b, start, stop)
                    reply = (b"C" if source == "cache" else b"O") + data
                except Exception as exc:  # noqa: BLE001 - reported to the child, which reads the origin
                    reply = b"E" + str(exc).encode()
                try:
                    conn.send_bytes(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        shutil.rmtree(self._dir, ignore_errors=True)
