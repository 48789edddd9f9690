"""Cluster reads: a block router for :class:`stoker.store.dataset.Dataset` (local → peer → origin).

:class:`BlockRouter` is the :class:`stoker.store.blocks.Router` of a rank's block reader (its
``caches``, ``local`` and ``read``): a rank reads through ``ds.with_reader(BlockReader(ds,
router=router))`` (:func:`stoker.cluster.jobs.job._rank_main`); the shared Dataset is not changed.
The router tells the dataset which blocks this node's cache holds (the blocks placed on this
node by :mod:`stoker.cluster.placement`) and reads the others from the node that owns them,
through that node's cache service; if the owner is down, slow or gone, it reads the origin
(a *fallback*): the failed call is the only stall; until a background thread's ping (every
``retry_s`` seconds) finds the owner back, its blocks are read from the origin without calling it, so a
restarted service rejoins by itself. A block whose owner changed when the dataset's members last
grew (``prior``: its previous owner, :mod:`stoker.cluster.handoff`) is filled from the previous
owner's cache first: by this rank when this node owns it now, else by the owner's service, which
the read names the previous owner to. Every byte is counted in the rank's :class:`ByteCounters`
(local / peer / origin / peer_origin / handoff / fallbacks).

Ray calls work only in the process that joined Ray (the training worker). The loader's decode
workers and prefetcher are forked children; they reach peers through a relay: a thread of the
training worker serving a Unix socket (mode 0600 in a private directory, HMAC challenge with a
random key: ``multiprocessing.connection``), raw bytes in both directions (no pickle).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np

from ..._procs import left_by_dead
from ...errors import PeerUnavailable
from ...store.checks import checked_or_none
from ..counters import ByteCounters
from ..identity import node_label

log = logging.getLogger(__name__)

_REQ = struct.Struct("<iqqqii")  # node index, block, start, stop, previous owner (-1: none), mode
_READ, _CACHED = 0, 1  # modes: a read the node may fill (service read), a cache-only read (read_cached)
#: Reply kind of a relayed read, by the source the service named.
_KINDS = {"cache": b"C", "origin": b"O", "handoff": b"H"}
_SOURCES = {v: k for k, v in _KINDS.items()}  # reply kind -> source
#: The counter a peer's answer is counted in, by the source the peer named (else peer_origin).
_COUNTED_AS = {"cache": "peer", "handoff": "handoff"}


class BlockRouter:
    """Where a dataset's blocks live in the cluster, and reads of the ones not on this node.

    ``dref``: the dataset as the peers open it (:func:`stoker.cluster.service.cache_service.dataset_ref`);
    ``nodes``: node ids (hex), the placement members; ``owner``: int array (num_blocks,), index
    into ``nodes`` of each block's owner; ``me``: index of this node in ``nodes`` (-1: this node
    caches nothing of the dataset); ``counters``: the rank's :class:`ByteCounters`;
    ``timeout_s``: longest wait for one peer read (then the origin); ``retry_s``: how long a
    peer that failed is skipped; ``prior``: int array (num_blocks,), index into ``nodes`` of each
    block's previous owner, -1 where it has none to ask
    (:func:`stoker.cluster.handoff.prior_owner`; None: no block has one); ``names``: how warnings
    and errors name each of ``nodes`` (:func:`stoker.cluster.identity.node_label`: the node's
    cache directory, as ``stoker cache status`` prints it; None: ``Ray node <id>``). Picklable (a
    copy in a forked child uses the relay).
    """

    def __init__(
        self,
        dref: dict,
        nodes: list[str],
        owner: np.ndarray,
        me: int,
        counters: ByteCounters,
        timeout_s: float = 30.0,
        retry_s: float = 1.0,
        prior: np.ndarray | None = None,
        names: list[str] | None = None,
    ):
        self.dref, self.url = dict(dref), dref["url"]
        self.nodes, self.owner, self.me = list(nodes), np.asarray(owner, dtype=np.int64), int(me)
        self.names = [node_label(n) for n in self.nodes] if names is None else list(names)
        self.prior = np.full(len(self.owner), -1, dtype=np.int64) if prior is None else np.asarray(prior, np.int64)
        self.counters, self.timeout_s, self.retry_s = counters, float(timeout_s), float(retry_s)
        self.relay_address: str | None = None
        self.relay_key: bytes | None = None
        self._ray_pid = os.getpid()
        self._init_local()

    def _init_local(self):
        # peer -> its cache service's Ray actor handle (Any: ray.actor.ActorHandle types no remote method)
        self._handles: dict[int, Any] = {}
        self._down_until: dict[int, float] = {}
        self._suspect: set[int] = set()  # peers whose last call failed: not called on the read path
        self._probing: dict[int, threading.Thread] = {}  # peer -> the thread that pings it while suspect
        self._probe_lock = threading.Lock()
        self._gone: set[int] = set()  # peers whose node Ray lists as dead (a node id never comes back)
        self._alive: tuple[float, frozenset] = (-float("inf"), frozenset())  # (when, alive node ids)
        self._tls = threading.local()

    def __getstate__(self):
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_handles", "_down_until", "_suspect", "_probing", "_probe_lock", "_gone", "_alive", "_tls")
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_local()

    # -- the Dataset's side ---------------------------------------------------
    def caches(self, b: int) -> bool:
        """Whether block ``b`` belongs in this node's cache."""
        return self.me >= 0 and int(self.owner[b]) == self.me

    def local(self, nbytes: int, b: int | None = None) -> None:
        """Count ``nbytes`` of a sample served by this node's cache or staging area (block ``b``):
        as local, or where the block came from if this rank fetched it this epoch
        (:meth:`stoker.cluster.counters.ByteCounters.credit`)."""
        if b is None:
            self.counters.add(local=nbytes)
        else:
            self.counters.credit(b, nbytes)

    def read(self, ds, b: int, start: int, stop: int, block: bool = False) -> bytes:
        """Shard bytes ``[start, stop)`` of block ``b``: from its owning peer, else the origin; a
        whole block of this node whose owner changed comes from its previous owner's cache first
        (:meth:`handoff`).

        ``block``: the whole block is being fetched (into the cache or staging; its samples are
        counted as they are read, :meth:`local`); else a sample's bytes, counted now.
        The caller verifies the bytes against the index. Raises what the origin raises
        (:class:`stoker.storage.OriginError`) when the origin fails too.
        """
        o, p = int(self.owner[b]), int(self.prior[b])
        if block and o == self.me and p >= 0:
            data = self.handoff(ds, b, p, start, stop)
            if data is not None:
                self._count(b, "handoff", len(data), block)
                return data
        if o != self.me and time.monotonic() >= self._down_until.get(o, 0.0):
            try:
                source, data = self._peer_read(o, b, start, stop, p)
            except Exception as exc:  # noqa: BLE001 - any failure of a peer: read the origin
                self._failed("peer", o, ds, b, exc)
            else:
                self._count(b, _COUNTED_AS.get(source, "peer_origin"), len(data), block)
                return data
        data = ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop)
        self._count(b, "origin", len(data), block)
        return data

    def handoff(self, ds, b: int, p: int, start: int, stop: int) -> bytes | None:
        """Whole block ``b`` from the cache of its previous owner ``p`` (index into ``nodes``),
        verified against the index (:func:`stoker.store.checks.verify_block`); None when
        that node does not hold it, is down or suspect, does not answer within ``timeout_s``, or
        sends bytes that fail the check (logged; the caller then reads the origin). The previous
        owner never goes to the origin for it
        (:meth:`stoker.cluster.service.cache_service.CacheService.read_cached`)."""
        if p == self.me or time.monotonic() < self._down_until.get(p, 0.0):
            return None
        try:
            data = self._peer_cached(p, b, start, stop)
        except Exception as exc:  # noqa: BLE001 - any failure of the previous owner: read the origin
            self._failed("previous owner", p, ds, b, exc)
            return None
        return checked_or_none(ds, b, data, f"its previous owner {self.names[p]}")

    def _failed(self, role: str, o: int, ds, b: int, exc: Exception) -> None:
        """A call to node ``o`` (the block's ``role``: "peer" or "previous owner") for block ``b``
        failed: logged, the node skipped for ``retry_s`` seconds, a fallback counted."""
        log.warning(
            "%s %s unavailable for block %s of %s (%s); reading the origin",
            role,
            self.names[o],
            ds.blocks.name(b),
            self.url,
            exc,
        )
        self._down_until[o] = time.monotonic() + self.retry_s
        self._handles.pop(o, None)
        self.counters.add(fallbacks=1)

    def _count(self, b: int, source: str, nbytes: int, block: bool) -> None:
        if block:
            self.counters.tag(b, source, nbytes)
        else:  # a sample's bytes: read and received at once
            self.counters.add(**{source: nbytes, "fetch_" + source: nbytes})

    # -- peers ----------------------------------------------------------------------
    def _peer_read(self, o: int, b: int, start: int, stop: int, prior: int = -1) -> tuple[str, bytes]:
        if os.getpid() == self._ray_pid:
            return self.ray_read(o, b, start, stop, prior)
        reply = self._relay_call(o, b, start, stop, prior, _READ)
        if reply is None:
            raise PeerUnavailable(f"the relay's cache-only answer to a read of {self.names[o]}")
        return reply

    def _peer_cached(self, o: int, b: int, start: int, stop: int) -> bytes | None:
        if os.getpid() == self._ray_pid:
            return self.ray_read_cached(o, b, start, stop)
        reply = self._relay_call(o, b, start, stop, -1, _CACHED)
        return None if reply is None else reply[1]

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

    def ray_read(self, o: int, b: int, start: int, stop: int, prior: int = -1) -> tuple[str, bytes]:
        """A peer read through Ray (only in the process that joined Ray): ``(source, bytes)``, the
        source as the peer's service names it (:meth:`stoker.cluster.service.cache_service.CacheService.read`;
        ``prior``: index of the block's previous owner, which the peer fills it from first, -1:
        none). Raises PeerUnavailable.

        A peer whose call failed (dead, restarting, timed out after ``timeout_s``) is *suspect*:
        it costs that one stall, and later reads of its blocks raise PeerUnavailable at once
        without calling it, until :meth:`_watch`'s ping (every ``retry_s`` seconds, while Ray
        lists its node as alive) answers (module doc).
        """
        extra = (self.nodes[prior], self.timeout_s / 2) if 0 <= prior != o else ()
        source, data = self._call(o, "read", self.dref, int(b), int(start), int(stop), *extra)
        return source, self._sized(o, data, stop - start)

    def ray_read_cached(self, o: int, b: int, start: int, stop: int) -> bytes | None:
        """A cache-only read of peer ``o`` through Ray
        (:meth:`stoker.cluster.service.cache_service.CacheService.read_cached`): the bytes, or None when its cache does
        not hold the block. Raises PeerUnavailable as :meth:`ray_read` (a suspect peer is not called)."""
        data = self._call(o, "read_cached", self.dref, int(b), int(start), int(stop))
        return None if data is None else self._sized(o, data, stop - start)

    def _sized(self, o: int, data, nbytes: int) -> bytes:
        """``data`` from peer ``o`` when it is ``nbytes`` bytes; else raises PeerUnavailable."""
        if not isinstance(data, bytes) or len(data) != nbytes:
            raise PeerUnavailable(f"cache service of {self.names[o]} sent {len(data)} bytes, expected {nbytes}")
        return data

    def _call(self, o: int, method: str, *args):
        """``method(*args)`` of peer ``o``'s cache service, waited for at most ``timeout_s``
        (suspect peers: :meth:`ray_read`). Raises PeerUnavailable."""
        import ray

        from .cache_service import get_service

        if o in self._suspect:
            self._probe(o)
            raise PeerUnavailable(
                f"cache service of {self.names[o]}: its last call failed; "
                f"reading the origin until a ping (every {self.retry_s} s) answers"
            )
        try:
            h = self._handles.get(o)
            if h is None:
                h = self._handles[o] = get_service(self.nodes[o])
            return ray.get(getattr(h, method).remote(*args), timeout=self.timeout_s)
        except (ValueError, ray.exceptions.RayError) as exc:
            self._suspect.add(o)
            self._handles.pop(o, None)
            self._probe(o)  # watched from now on, so it is known to be back before a read wants it
            raise PeerUnavailable(f"cache service of {self.names[o]}: {type(exc).__name__}: {exc}") from exc

    def connect(self) -> list[str]:
        """Reach every peer that owns blocks, before the first read: look up each one's cache
        service and ping them all at once (at most ``timeout_s`` in all), so that neither the
        lookups nor the first call's connection set-up fall on the read path, one peer at a time.
        A peer that does not answer is suspect from the start (its blocks come from the origin
        until a ping answers, as after a failed read). Returns the node ids of those peers."""
        import ray

        from .cache_service import get_service

        asked = np.union1d(self.owner, self.prior)  # owners, and previous owners to hand blocks off
        peers = sorted({int(o) for o in asked if 0 <= o < len(self.nodes) and o != self.me})
        refs, failed = {}, []
        for o in peers:
            try:
                h = get_service(self.nodes[o])
                refs[o] = (h, h.ping.remote())
            except (ValueError, ray.exceptions.RayError) as exc:
                log.debug("peer %s not found: %s", self.names[o], exc)
                failed.append(o)
        ready, _ = (
            ray.wait([r for _, r in refs.values()], num_returns=len(refs), timeout=self.timeout_s) if refs else ([], [])
        )
        done = set(ready)
        for o, (h, ref) in refs.items():
            try:
                if ref not in done:
                    raise TimeoutError(f"no answer within {self.timeout_s} s")
                ray.get(ref)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                log.debug("peer %s did not answer: %s", self.names[o], exc)
                failed.append(o)
            else:
                self._handles[o] = h
        for o in failed:
            self._suspect.add(o)
            self._probe(o)
        return sorted(self.nodes[o] for o in failed)

    def suspects(self) -> list[str]:
        """Node ids of the peers whose cache service is suspect now: its last call failed and no
        ping has answered since (their blocks are read from the origin meanwhile)."""
        return sorted(self.nodes[o] for o in set(self._suspect))

    def _probe(self, o: int) -> None:
        """Make sure a background thread watches suspect peer ``o`` (:meth:`_watch`)."""
        with self._probe_lock:
            t = self._probing.get(o)
            if o in self._gone or (t is not None and t.is_alive()):
                return
            t = self._probing[o] = threading.Thread(
                target=self._watch, args=(o,), name=f"stoker-probe-{o}", daemon=True
            )
        t.start()

    def _watch(self, o: int) -> None:
        """Ping suspect peer ``o`` every ``retry_s`` seconds (each ping at most ``timeout_s``) until
        it answers (then it is no longer suspect and reads go to it again) or Ray lists its node
        as dead (a dead node id never comes back: it stays suspect, its blocks come from the
        origin)."""
        import ray

        from .cache_service import get_service

        while o in self._suspect:
            t0 = time.monotonic()
            if not self._node_alive(o):
                self._gone.add(o)
                return
            try:
                h = get_service(self.nodes[o])
                ray.get(h.ping.remote(), timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - still down: reads keep going to the origin
                log.debug("peer %s still unavailable: %s", self.names[o], exc)
            else:
                self._handles[o] = h
                self._suspect.discard(o)
                return
            time.sleep(max(0.0, self.retry_s - (time.monotonic() - t0)))

    def _relay_call(self, o: int, b: int, start: int, stop: int, prior: int, mode: int) -> tuple[str, bytes] | None:
        """A peer read for a forked child through the relay: ``(source, bytes)``, or None when a
        cache-only read (``mode`` ``_CACHED``) found the block not held. Raises PeerUnavailable."""
        if self.relay_address is None:
            raise PeerUnavailable("no relay to the peers in this process (not the Ray worker)")
        conn = getattr(self._tls, "conn", None)
        if conn is None or getattr(self._tls, "pid", None) != os.getpid():
            conn = self._tls.conn = Client(self.relay_address, family="AF_UNIX", authkey=self.relay_key)
            self._tls.pid = os.getpid()
        try:
            conn.send_bytes(_REQ.pack(o, b, start, stop, prior, mode))
            reply = conn.recv_bytes()
        except (OSError, EOFError) as exc:
            self._tls.conn = None
            raise PeerUnavailable(f"relay {self.relay_address}: {exc}") from exc
        kind, data = reply[:1], reply[1:]
        if kind == b"E":
            raise PeerUnavailable(data.decode(errors="replace"))
        if kind == b"N":
            return None
        return _SOURCES.get(kind, "origin"), data

    # -- the relay, run by the Ray worker ------------------------------------------
    def start_relay(self) -> "Relay":
        """Serve peer reads for this process's forked children; returns the :class:`Relay`."""
        relay = Relay(self)
        self.relay_address, self.relay_key = relay.address, relay.authkey
        return relay


RELAY_PREFIX = "stoker-relay-"


def sweep_relay_dirs(root: str | None = None) -> list[str]:
    """Remove the relay directories (``stoker-relay-<pid>-*`` under ``root``, default the
    temporary directory) of this user whose process is gone: a Ray worker ended with ``os._exit``
    or a signal runs no exit hook, so the next relay of the machine removes what it left.
    Directories of live processes, of other users, and names not of this form are kept. Returns
    the paths removed."""
    removed: list[str] = []
    for path, st in left_by_dead(root or tempfile.gettempdir(), RELAY_PREFIX):
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Relay:
    """A Unix-socket server in the Ray worker that performs peer reads for its child processes.

    One thread per connection; requests are fixed-size structs, replies a kind byte (``C``:
    from the peer's cache, ``O``: the peer fetched from the origin, ``H``: the peer filled it
    from the block's previous owner, ``N``: a cache-only read found the block not held, ``E``:
    error text) and the bytes. :meth:`close` stops it and removes its directory (``stoker-relay-<pid>-*``, mode
    0700); so does the interpreter's exit without :meth:`close`, and a process that ended
    without either leaves it to the next relay's :func:`sweep_relay_dirs`.
    """

    def __init__(self, router: BlockRouter):
        self._router = router
        sweep_relay_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{RELAY_PREFIX}{os.getpid()}-")  # mode 0700
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
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
                o, b, start, stop, prior, mode = _REQ.unpack(req)
                try:
                    if mode == _CACHED:
                        held = self._router.ray_read_cached(o, b, start, stop)
                        reply = b"N" if held is None else b"C" + held
                    else:
                        source, data = self._router.ray_read(o, b, start, stop, prior)
                        reply = _KINDS.get(source, b"O") + data
                except Exception as exc:  # noqa: BLE001 - reported to the child, which reads the origin
                    reply = b"E" + str(exc).encode()
                try:
                    conn.send_bytes(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self._cleanup()
