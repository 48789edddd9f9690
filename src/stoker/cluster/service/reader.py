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
(local / peer / origin / peer_origin / handoff / fallbacks). What a peer sends is checked against
the index checksums (the block reader's ``verify``) before it is kept or delivered: bytes that
fail are refused and the origin read instead, a fallback counted; a node that sends
:data:`WRONG_IN_A_ROW` wrong blocks in a row is skipped for ``retry_s`` seconds.

Ray carries only the control plane here: the peers' data endpoints are looked up through their
services (:meth:`connect`), and Ray's node table says which nodes are gone. A block's bytes come
over the peer's data endpoint (:mod:`stoker.cluster.service.endpoint`), on this process's own
authenticated connection (:class:`stoker.cluster.service.peerlinks.PeerLinks`): the rank, its
prefetcher and its decode workers (forked or spawned copies of the router) each read peers
directly, with no hop through another process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from ...errors import ChecksumError, PeerUnavailable
from ...store.blocks import Verify
from ...store.checks import verify_block
from ..counters import ByteCounters
from ..identity import node_label
from . import peerwire as pw
from .peerlinks import PeerLinks

log = logging.getLogger(__name__)

#: The counter a peer's answer is counted in, by the source the peer named (else peer_origin).
_COUNTED_AS = {"cache": "peer", "handoff": "handoff"}
#: Blocks in a row whose bytes a node sent wrong before its reads are skipped for ``retry_s``
#: seconds: one damaged cache file costs a fallback per read of it, a node that answers every
#: block wrong (a broken disk, a bad build) costs this many, then one per ``retry_s``.
WRONG_IN_A_ROW = 3


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
    cache directory, as ``stoker cache status`` prints it; None: ``Ray node <id>``); ``secret``:
    the cluster's data-plane secret (default: asked of Ray,
    :func:`stoker.cluster.service.peerwire.cluster_secret`). Picklable: a copy in a worker process
    opens its own connections to the peers.
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
        secret: bytes | None = None,
    ):
        self.dref, self.url = dict(dref), dref["url"]
        self.nodes, self.owner, self.me = list(nodes), np.asarray(owner, dtype=np.int64), int(me)
        self.names = [node_label(n) for n in self.nodes] if names is None else list(names)
        self.prior = np.full(len(self.owner), -1, dtype=np.int64) if prior is None else np.asarray(prior, np.int64)
        self.counters, self.timeout_s, self.retry_s = counters, float(timeout_s), float(retry_s)
        self.links = PeerLinks(pw.cluster_secret() if secret is None else secret, self.timeout_s)
        self.endpoints: dict[int, tuple[str, int]] = {}  # peer -> (host, port) of its data endpoint
        self._ray_pid = os.getpid()
        self._init_local()

    def _init_local(self):
        self._down_until: dict[int, float] = {}
        self._wrong: dict[int, int] = {}  # node -> blocks in a row whose bytes it sent failed the check
        self._suspect: set[int] = set()  # peers whose last read failed: not asked on the read path
        self._probing: dict[int, threading.Thread] = {}  # peer -> the thread that pings it while suspect
        self._probe_lock = threading.Lock()
        self._gone: set[int] = set()  # peers whose node Ray lists as dead (a node id never comes back)
        self._alive: tuple[float, frozenset] = (-float("inf"), frozenset())  # (when, alive node ids)
        self._stop = threading.Event()  # set by close(): the probes end

    def __getstate__(self):
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_down_until", "_wrong", "_suspect", "_probing", "_probe_lock", "_gone", "_alive", "_stop")
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

    def read(self, ds, b: int, start: int, stop: int, block: bool = False, verify: Verify | None = None):
        """Shard bytes ``[start, stop)`` of block ``b`` (a bytes-like object): from its owning peer,
        else the origin; a whole block of this node whose owner changed comes from its previous
        owner's cache first (:meth:`handoff`).

        ``block``: the whole block is being fetched (into the cache or staging; its samples are
        counted as they are read, :meth:`local`); else a sample's bytes, counted now.
        ``verify`` (:data:`stoker.store.blocks.Verify`, what the block reader checks bytes with):
        a peer's bytes that fail it are refused (logged naming the peer and the block, a
        fallback counted, not counted as peer bytes) and the origin read instead; the origin's
        are checked with it too, and its ChecksumError raised. Every byte returned has passed it
        (None: unverified, except a previous owner's, always checked). Raises what the origin
        raises (:class:`stoker.storage.OriginError`) when the origin fails too.
        """
        o, p = int(self.owner[b]), int(self.prior[b])
        if block and o == self.me and p >= 0:
            data = self.handoff(ds, b, p, start, stop, verify)
            if data is not None:
                self._count(b, "handoff", len(data), block)
                return data
        if o != self.me and time.monotonic() >= self._down_until.get(o, 0.0):
            try:
                source, data = self.peer_read(o, b, start, stop, p)
            except PeerUnavailable as exc:
                self._failed("peer", o, ds, b, exc)
            else:
                if verify is None or self._passes(verify, data, "peer", o, ds, b):
                    self._count(b, _COUNTED_AS.get(source, "peer_origin"), len(data), block)
                    # a whole block goes to the cache or staging as it came; a sample's bytes are
                    # handed on, as ``bytes`` like the origin's (a view of the receive buffer is not picklable)
                    return data if block else bytes(data)
        data = ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop)
        if verify is not None:
            verify(data)
        self._count(b, "origin", len(data), block)
        return data

    def handoff(self, ds, b: int, p: int, start: int, stop: int, verify: Verify | None = None):
        """Whole block ``b`` from the cache of its previous owner ``p`` (index into ``nodes``),
        checked with ``verify`` (default :func:`stoker.store.checks.verify_block`); None when
        that node does not hold it, is down or suspect, does not answer within ``timeout_s``, or
        sends bytes that fail the check (logged, a fallback counted; the caller then reads the
        origin). The previous owner never goes to the origin for it (a cache-only read of its
        data endpoint)."""
        if p == self.me or time.monotonic() < self._down_until.get(p, 0.0):
            return None
        try:
            data = self.peer_cached(p, b, start, stop)
        except PeerUnavailable as exc:
            self._failed("previous owner", p, ds, b, exc)
            return None
        if data is None:
            return None
        check = verify if verify is not None else (lambda d: verify_block(ds, b, d))
        return data if self._passes(check, data, "previous owner", p, ds, b) else None

    def _passes(self, verify: Verify, data, role: str, o: int, ds, b: int) -> bool:
        """Whether ``data``, read from node ``o`` (the block's ``role``), passes ``verify``; when
        it does not (a damaged cache file there, a wrong answer), the bytes are refused: logged
        naming the node and block, a fallback counted. One wrong block does not make the node
        skipped (its other blocks may be right); :data:`WRONG_IN_A_ROW` wrong blocks in a row do,
        for ``retry_s`` seconds."""
        try:
            verify(data)
        except ChecksumError as exc:
            wrong = self._wrong[o] = self._wrong.get(o, 0) + 1
            skip = wrong >= WRONG_IN_A_ROW
            log.warning(
                "%s %s sent bytes of block %s of %s that fail the index checksums (sample %r); refused, "
                "reading the origin%s",
                role,
                self.names[o],
                ds.blocks.name(b),
                self.url,
                exc.key,
                f"; {wrong} wrong blocks in a row from it: its reads are skipped for {self.retry_s:g} s"
                if skip
                else "",
            )
            if skip:
                self._wrong[o] = 0
                self._down_until[o] = time.monotonic() + self.retry_s
            self.counters.add(fallbacks=1)
            return False
        self._wrong.pop(o, None)
        return True

    def _failed(self, role: str, o: int, ds, b: int, exc: Exception) -> None:
        """A read of node ``o`` (the block's ``role``: "peer" or "previous owner") for block ``b``
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
        self.counters.add(fallbacks=1)

    def _count(self, b: int, source: str, nbytes: int, block: bool) -> None:
        if block:
            self.counters.tag(b, source, nbytes)
        else:  # a sample's bytes: read and received at once
            self.counters.add(**{source: nbytes, "fetch_" + source: nbytes})

    # -- peers ----------------------------------------------------------------------
    def peer_read(self, o: int, b: int, start: int, stop: int, prior: int = -1) -> tuple[str, Any]:
        """Bytes ``[start, stop)`` of block ``b`` from peer ``o``'s data endpoint: ``(source,
        bytes)``, the source as the peer names it (``"cache"``, ``"origin"``: it filled the block
        from the origin, ``"handoff"``: from ``prior``, the index of the block's previous owner,
        -1: none). Raises PeerUnavailable.

        A peer whose read failed (dead, restarting, cut off, timed out after ``timeout_s``) is
        *suspect*: it costs that one stall, and later reads of its blocks raise PeerUnavailable
        at once without asking it, until :meth:`_watch`'s ping (every ``retry_s`` seconds)
        answers (module doc)."""
        prior_node = self.nodes[prior] if 0 <= prior != o else None
        source, data = self._ask(o, pw.READ, b, start, stop, prior_node, self.timeout_s / 2 if prior_node else 0.0)
        if source is None:
            raise PeerUnavailable(f"data endpoint of {self.names[o]}: a read answered 'not held'")
        return source, data

    def peer_cached(self, o: int, b: int, start: int, stop: int):
        """A cache-only read of peer ``o``: the bytes, or None when its cache does not hold the
        block (it never reads the origin for it). Raises PeerUnavailable as :meth:`peer_read`."""
        return self._ask(o, pw.CACHED, b, start, stop)[1] or None

    def _ask(self, o: int, op: int, b: int, start: int, stop: int, prior: str | None = None, wait_s: float = 0.0):
        if o in self._suspect:
            self._probe(o)
            raise PeerUnavailable(
                f"data endpoint of {self.names[o]}: its last read failed; "
                f"reading the origin until a ping (every {self.retry_s} s) answers"
            )
        try:
            addr = self.endpoints.get(o) or self._lookup(o)
            source, data = self.links.read(
                addr, self.names[o], self.dref, op, int(b), int(start), int(stop), prior, wait_s
            )
        except PeerUnavailable:
            self._suspect.add(o)
            self._probe(o)  # watched from now on, so it is known to be back before a read wants it
            raise
        if source is None:
            return None, None
        return source, data

    def _in_ray(self) -> bool:
        """Whether this is the process that joined Ray (the rank), not a forked or spawned copy."""
        return os.getpid() == self._ray_pid

    def _lookup(self, o: int) -> tuple[str, int]:
        """Peer ``o``'s data endpoint, asked of its cache service through Ray (only the rank can;
        a worker process uses what the rank knew when it was made). Raises PeerUnavailable."""
        if not self._in_ray():
            raise PeerUnavailable(f"the data endpoint of {self.names[o]} is not known in this worker process")
        import ray

        from .cache_service import endpoint_of

        try:
            self.endpoints[o] = endpoint_of(self.nodes[o], self.dref, self.timeout_s)
        except (ValueError, ray.exceptions.RayError) as exc:
            raise PeerUnavailable(f"cache service of {self.names[o]}: {type(exc).__name__}: {exc}") from exc
        return self.endpoints[o]

    def _node_alive(self, o: int) -> bool:
        """Whether Ray lists the node of peer ``o`` as alive (``ray.nodes()``, asked at most every
        ``retry_s`` seconds: a cheap call to Ray's control store, not to the peer); True outside
        the rank's process (a worker cannot ask Ray: it pings until the peer answers)."""
        if not self._in_ray():
            return True
        import ray

        when, alive = self._alive
        if time.monotonic() - when >= self.retry_s:
            try:
                alive = frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
            except Exception:  # noqa: BLE001 - no answer from Ray: try the peer as before
                return True
            self._alive = (time.monotonic(), alive)
        return self.nodes[o] in alive

    def connect(self) -> list[str]:
        """Reach every peer that owns blocks, before the first read: ask each one's cache service
        where its data endpoint listens (through Ray, all at once, at most ``timeout_s`` in all)
        and open an authenticated connection to it, so that neither the lookups nor the
        connection set-up fall on the read path. A peer that does not answer is suspect from the
        start (its blocks come from the origin until a ping answers, as after a failed read).
        Returns the node ids of those peers."""
        import ray

        from .cache_service import get_service

        asked = np.union1d(self.owner, self.prior)  # owners, and previous owners to hand blocks off
        peers = sorted({int(o) for o in asked if 0 <= o < len(self.nodes) and o != self.me})
        refs, failed = {}, []
        for o in peers:
            try:
                refs[o] = get_service(self.nodes[o]).endpoint.remote(self.dref)
            except (ValueError, ray.exceptions.RayError) as exc:
                log.debug("peer %s not found: %s", self.names[o], exc)
                failed.append(o)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s) if refs else ([], [])
        done = set(ready)
        for o, ref in refs.items():
            try:
                if ref not in done:
                    raise TimeoutError(f"no answer within {self.timeout_s} s")
                host, port = ray.get(ref)
                self.endpoints[o] = (str(host), int(port))
                self.links.ping(self.endpoints[o], self.names[o])
            except (TimeoutError, PeerUnavailable, ray.exceptions.RayError) as exc:
                log.warning("peer %s did not answer: %s", self.names[o], exc)
                failed.append(o)
        for o in failed:
            self._suspect.add(o)
            self._probe(o)
        return sorted(self.nodes[o] for o in failed)

    def suspects(self) -> list[str]:
        """Node ids of the peers that are suspect now: their last read failed and no ping has
        answered since (their blocks are read from the origin meanwhile)."""
        return sorted(self.nodes[o] for o in set(self._suspect))

    def _probe(self, o: int) -> None:
        """Make sure a background thread watches suspect peer ``o`` (:meth:`_watch`)."""
        with self._probe_lock:
            t = self._probing.get(o)
            if o in self._gone or self._stop.is_set() or (t is not None and t.is_alive()):
                return
            t = self._probing[o] = threading.Thread(
                target=self._watch, args=(o,), name=f"stoker-probe-{o}", daemon=True
            )
        t.start()

    def _watch(self, o: int) -> None:
        """Ping suspect peer ``o`` every ``retry_s`` seconds (each ping at most ``timeout_s``) until
        it answers (then it is no longer suspect and reads go to it again) or Ray lists its node
        as dead (a dead node id never comes back: it stays suspect, its blocks come from the
        origin). In the rank the ping asks the service through Ray where its endpoint is now (a
        restarted service may listen elsewhere) and then pings the endpoint; a worker process
        pings the endpoint it knows (a restarted service takes its old port when it is free).
        Ends when the router is closed."""
        while o in self._suspect and not self._stop.is_set():
            t0 = time.monotonic()
            if not self._node_alive(o):
                self._gone.add(o)
                return
            try:
                addr = self._lookup(o) if self._in_ray() else self.endpoints.get(o)
                if addr is None:
                    raise PeerUnavailable("no endpoint known")
                self.links.ping(addr, self.names[o])
            except Exception as exc:  # noqa: BLE001 - still down: reads keep going to the origin
                log.debug("peer %s still unavailable: %s", self.names[o], exc)
            else:
                self._suspect.discard(o)
                break
            self._stop.wait(max(0.0, self.retry_s - (time.monotonic() - t0)))
        if self._stop.is_set():
            self.links.close()  # closed during a ping: the connection it opened goes too

    def close(self) -> None:
        """Close this process's connections to the peers and end its background pings (each
        worker process closes its own as it exits). A ping left running would open connections
        again, for as long as the process lives (a pooled Ray worker outlives its job)."""
        self._stop.set()
        self.links.close()
