"""The cache service: one Ray actor per node that owns the node's cache and serves it to peers.

Loaders on a node read the node cache directly (files on local disk or in /dev/shm: the cache
directory is shared by every process of the node); the service is how *other* nodes reach it.
Two planes: Ray carries the control plane (membership, placement, leases, fills for ``stoker
warm``, and where the service's data endpoint listens); a block's bytes never become a Ray
object: they go out of the service's own data endpoint (:mod:`stoker.cluster.service.endpoint`,
a TCP listener on the node's cluster address, authenticated with the cluster's secret), with
``sendfile`` from the cache file. It also fills the blocks its node owns
from the origin (single flight per block across the node, so a block is read from the origin
once however many jobs want it) and answers what it holds (for placement, ``stoker warm``
and the scheduler extender).

A service is pinned to its node (``NodeAffinitySchedulingStrategy(soft=False)``), detached and
restarted by Ray (``max_restarts=-1``), as this folder's README.md says; its cache directory is
named by the host (:mod:`stoker.cluster.identity`), so a restarted service, and a service of a
restarted Ray, has the blocks the old one held.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ...cache import DiskCache
from ...cache.spec import CacheOptions, with_shortcuts
from ...errors import ServiceStartError
from ...loader.prefetch.inflight import InflightGate, InflightTarget
from ...metrics import ServiceMetrics
from ...store.dataset import DEFAULT_BLOCK_BYTES, default_cache_dir, open_dataset
from ..handoff import PriorReads
from ..identity import claim_cache_dir, node_label
from ..membership import RECORD_SETS, merge
from ..placement import placement_keys  # noqa: F401 - re-exported: its callers import it from here
from ..registration import LEASE_S, lease
from . import peerwire as pw
from .endpoint import DataEndpoint, Reply
from .peerlinks import PeerLinks

log = logging.getLogger(__name__)

NAMESPACE = "stoker"
#: Concurrent requests one service handles (peer reads and fills, each in its own thread).
MAX_CONCURRENCY = 16
#: Where a service's data endpoint listens: ``STOKER_DATA_HOST`` (default the node's cluster
#: address, as Ray knows it; ``0.0.0.0`` only when set so, and peers are then told the node's
#: cluster address) and ``STOKER_DATA_PORT`` (1-65535; default, or 0: the port this node's
#: endpoint had before, else any free one), read in the service's process (the environment of
#: ``ray start`` on that node).
DATA_HOST_ENV, DATA_PORT_ENV = "STOKER_DATA_HOST", "STOKER_DATA_PORT"
#: Listening hosts that are no address a peer can connect to (every address of the node).
WILDCARD_HOSTS = ("0.0.0.0", "::")


def dataset_ref(ds, storage_options: dict | None = None) -> dict:
    """How a service finds a dataset: ``{url, storage_options, version, block_bytes}`` (plain data)."""
    return {
        "url": ds.url,
        "storage_options": dict(storage_options or {}),
        "version": ds.version,
        "block_bytes": ds.block_bytes,
    }


def service_name(node_id: str) -> str:
    return f"stoker-cache-{node_id}"


class CacheService:
    """The node cache of one node, as a Ray actor (see the module doc).

    ``node_id``: the Ray node (hex) it must run on (checked: RuntimeError otherwise);
    ``cache``: the node's :class:`stoker.CacheOptions` (:meth:`stoker.CacheOptions.for_node`: its
    budget in bytes, also the node's placement weight), whose ``cache_dir`` is the cluster cache
    root: the service takes its node's directory under it and keeps ``cache`` with that directory
    (:func:`stoker.cluster.identity.claim_cache_dir`: ``cache_key`` is the node's placement key,
    both stable across Ray restarts on the same host); ``node_name``: the name schedulers know
    the node by (Kubernetes node name; default: ``$NODE_NAME`` or the node id); ``lease_s``: how
    long its registration of a dataset on the node cache counts after the last request for it,
    seconds (default :data:`stoker.cluster.registration.LEASE_S`).
    """

    def __init__(self, node_id: str, cache: CacheOptions, node_name: str | None = None, lease_s: float | None = None):
        here = ray.get_runtime_context().get_node_id()
        if here != node_id:
            raise RuntimeError(f"cache service for {node_label(node_id)} started on {node_label(here)}")
        assert cache.cache_dir is not None  # the cluster cache root (start_services)
        self._claim = claim_cache_dir(cache.cache_dir, owner=node_id)  # held while this process lives
        self.node_id, self.cache_key = node_id, self._claim.key
        self.cache = dataclasses.replace(cache, cache_dir=self._claim.path)
        self.node_name = node_name or os.environ.get("NODE_NAME") or node_id
        self.lease_s = LEASE_S if lease_s is None else float(lease_s)
        self._renewed: dict = {}  # dataset key -> monotonic time of its last lease
        self._holders: dict[str, set] = {}  # dataset version -> tokens of the running jobs that announced it
        self._datasets: dict = {}
        self._claims: dict[str, dict[str, list[str]]] = {}  # version -> {"members", "known", "previous"}
        self._by_key: dict[bytes, tuple] = {}  # data-plane dataset key -> (dataset, dref)
        secret = pw.cluster_secret()
        self._links = PeerLinks(secret, timeout_s=30.0)  # this service's reads of other services
        self._addresses: dict[str, tuple[str, int]] = {}  # node id -> its data endpoint
        self._prior = PriorReads(
            self._read_prior
        )  # cache-only reads from blocks' previous owners (stoker.cluster.handoff)
        self._gates: dict = {}  # dataset url -> InflightGate shared by its fills
        self._lock = threading.Lock()
        self._metrics = ServiceMetrics(self.node_name)  # Ray's metrics export (stoker.metrics)
        self._endpoint = _listen(self, secret, self._claim.path)

    # -- datasets ---------------------------------------------------------
    def _open(self, dref: dict):
        """The dataset of ``dref`` (``{url, storage_options, version, block_bytes}``, see
        :func:`dataset_ref`) read through this node's cache; ValueError if its content version
        at the origin is not ``version`` (the requester and this node would disagree on blocks)."""
        url, storage_options, version = dref["url"], dref["storage_options"], dref["version"]
        key = (url, version, dref["block_bytes"])
        ds = self._datasets.get(key)
        if ds is None:
            with self._lock:
                ds = self._datasets.get(key)
                if ds is None:
                    ds = open_dataset(
                        url,
                        cache=self.cache,
                        storage_options=storage_options,
                        check=False,
                        block_bytes=dref["block_bytes"],
                    )
                    if ds.version != version:
                        raise ValueError(
                            f"{url} has content version {ds.version} at the origin, the requester has {version}"
                        )
                    self._datasets[key] = ds
                    self._by_key[pw.dataset_key(version, dref["block_bytes"])] = (ds, dict(dref))
                    lease(ds, 0.0)  # not read for a job yet (open_dataset registered it for good)
        return ds

    def opened_datasets(self) -> list:
        """The datasets this service has opened so far (:class:`stoker.store.dataset.Dataset`, one
        per URL, content version and block size), in the order they were opened; a new list."""
        return list(self._datasets.values())

    def _renew(self, ds) -> None:
        """Lease this service's registration of ``ds`` for ``lease_s`` more seconds (at most
        every quarter lease): the node cache counts the dataset as read while reads and fills
        for jobs come (questions such as :meth:`cached_bytes` do not count)."""
        key = ds.version
        now = time.monotonic()
        if now - self._renewed.get(key, -float("inf")) >= self.lease_s / 4:
            self._renewed[key] = now
            lease(ds, self.lease_s)

    # -- requests ---------------------------------------------------------
    def info(self) -> dict:
        """``{node_id, node_name, cache_dir, cache_key, cache_bytes, used_bytes, pid, cache,
        data_endpoint}`` (bytes; ``cache``: the node's :class:`stoker.CacheOptions`,
        ``cache_dir`` and ``cache_bytes`` its fields; ``data_endpoint``: where the data endpoint
        listens and its connections so far,
        :meth:`stoker.cluster.service.endpoint.DataEndpoint.stats`)."""
        ds_cache = next(iter(self._datasets.values())).cache if self._datasets else None
        used = ds_cache.used_bytes() if ds_cache is not None else _used_bytes(self.cache)
        return {
            "node_id": self.node_id,
            "node_name": self.node_name,
            "cache_dir": self.cache.cache_dir,
            "cache_key": self.cache_key,
            "cache_bytes": self.cache.cache_bytes,
            "used_bytes": int(used),
            "pid": os.getpid(),
            "cache": self.cache,
            "data_endpoint": self._endpoint.stats(),
        }

    def endpoint(self, dref: dict | None = None) -> tuple[str, int]:
        """``(host, port)`` of this service's data endpoint, where peers read its blocks
        (:mod:`stoker.cluster.service.endpoint`); ``dref``: a dataset to open for them first."""
        if dref is not None:
            self._open(dref)
        return self._endpoint.address

    # -- the data endpoint's requests (stoker.cluster.service.endpoint.Handler) -------------
    def _dataset(self, key: bytes, b: int, start: int, stop: int):
        """The dataset of data-plane ``key`` and the offset of ``start`` in block ``b``, or
        ``(None, 0)`` when this service has not opened it. ValueError for a block or range
        outside the dataset (nothing is read for such a request)."""
        found = self._by_key.get(key)
        if found is None:
            return None, 0
        ds = found[0]
        if not 0 <= b < len(ds.blocks):
            raise ValueError(f"{ds.url} has no block {b} ({len(ds.blocks)} blocks)")
        lo, hi = int(ds.blocks.start[b]), int(ds.blocks.end[b])
        if not lo <= start <= stop <= hi:
            raise ValueError(f"bytes [{start}, {stop}) are not in block {ds.blocks.name(b)} of {ds.url} ([{lo}, {hi}))")
        return ds, start - lo

    def serve_hit(self, op: int, key: bytes, b: int, start: int, stop: int, reply: Reply) -> bool:
        """A request answered from this node's cache with ``sendfile`` (True), or False when it
        needs :meth:`serve` (the block is not cached and ``op`` may fill it). A cache-only read
        of a block not held is answered ``NOT_HELD``; an unknown dataset ``UNKNOWN_DATASET``."""
        ds, rel = self._dataset(key, b, start, stop)
        if ds is None:
            reply.status(pw.UNKNOWN_DATASET, "dataset not opened by this service")
            return True
        self._renew(ds)
        n = stop - start

        def send(fd: int) -> bool:
            if os.fstat(fd).st_size < rel + n:  # a damaged block: serve() reads it, drops it and fills again
                return False
            reply.file(pw.FROM_CACHE, fd, rel, n)
            return True

        if ds.cache.with_fd(ds.version, ds.blocks.name(b), send):
            self._metrics.served_bytes(n, "cache")
            return True
        if op == pw.CACHED and not ds.cache.contains(ds.version, ds.blocks.name(b)):
            reply.status(pw.NOT_HELD)
            return True
        return False

    def serve(
        self, op: int, key: bytes, b: int, start: int, stop: int, prior: str | None, wait_s: float, reply: Reply
    ) -> None:
        """A request that :meth:`serve_hit` could not answer, in the endpoint's pool: the block is
        filled first (:meth:`read`), or a cache-only read answers what the cache holds now."""
        ds, _ = self._dataset(key, b, start, stop)
        if ds is None:
            reply.status(pw.UNKNOWN_DATASET, "dataset not opened by this service")
            return
        dref = self._by_key[key][1]
        if op == pw.CACHED:
            data = self.read_cached(dref, b, start, stop)
            if data is None or len(data) != stop - start:
                reply.status(pw.NOT_HELD)
            else:
                reply.data(pw.FROM_CACHE, data)
            return
        source, data = self.read(dref, b, start, stop, prior, wait_s or None)
        reply.data(pw.STATUS_OF[source], data)

    def open(self, dref: dict) -> bytes:
        """Open the dataset of ``dref`` for the data endpoint's requests; its key."""
        self._open(dref)
        return pw.dataset_key(dref["version"], dref["block_bytes"])

    def read(
        self,
        dref: dict,
        b: int,
        start: int,
        stop: int,
        prior: str | None = None,
        prior_timeout_s: float | None = None,
    ):
        """Shard bytes ``[start, stop)`` of block ``b`` (a range inside the block), for the data
        endpoint (not called by peers through Ray: block bytes never travel as Ray objects).

        Returns ``(source, data)``: source ``"cache"`` when this node held the block (also when
        another fill brought it in while this read waited for it), ``"handoff"`` when it filled
        it from ``prior``, the node that owned the block before the dataset's members last grew
        (a cache-only read of that node's data endpoint, waited for at most ``prior_timeout_s``,
        default :data:`stoker.cluster.handoff.PRIOR_TIMEOUT_S`: :mod:`stoker.cluster.handoff`),
        ``"origin"`` when it had to fetch it from the origin (the block is then admitted here if
        the budget allows, so the next reader of any job finds it). Errors (origin, checksum)
        propagate to the caller.
        """
        ds = self._open(dref)
        self._renew(ds)
        version = ds.version
        name = ds.blocks.name(b)
        rel = start - int(ds.blocks.start[b])
        data = ds.cache.read(version, name, rel, stop - start)
        if data is not None:
            self._metrics.served_bytes(stop - start, "cache")
            return "cache", data
        first, got = self._prior.source(ds, dref, prior if prior != self.node_id else None, prior_timeout_s)
        status, block = ds.reader.fill_block(b, blocking=True, first_source=first)
        if block is None:  # this node's budget is full: pass the range through
            shard = ds.index.shard_name(ds.blocks.shard[b])
            out = ds.origin.read_range(shard, start, stop)
        else:
            out = memoryview(block)[rel : rel + stop - start]
        source = (
            "cache"
            if status == "cached"
            else ("handoff" if block is not None and block is got.get(int(b)) else "origin")
        )
        self._metrics.served_bytes(len(out), source)
        return source, out

    def read_cached(self, dref: dict, b: int, start: int, stop: int):
        """Shard bytes ``[start, stop)`` of block ``b`` when this node's cache holds the block, else
        None: never from the origin (what a handoff asks of a previous owner,
        :mod:`stoker.cluster.handoff`; peers ask it over the data endpoint)."""
        ds = self._open(dref)
        self._renew(ds)
        data = ds.cache.read(ds.version, ds.blocks.name(b), start - int(ds.blocks.start[b]), stop - start)
        if data is None:
            return None
        self._metrics.served_bytes(stop - start, "cache")
        return data

    def _read_prior(self, node: str, dref: dict, b: int, start: int, stop: int, timeout_s: float):
        """A cache-only read of block ``b`` from the data endpoint of ``node`` (its address asked
        of its service through Ray once): the bytes, or None when it does not hold the block.
        Raises PeerUnavailable or a Ray error when it is unreachable."""
        addr = self._addresses.get(node)
        if addr is None:
            addr = self._addresses[node] = endpoint_of(node, dref, timeout_s)
        try:
            source, data = self._links.read(addr, node_label(node), dref, pw.CACHED, b, start, stop)
        except Exception:
            self._addresses.pop(node, None)  # asked again next time: it may have restarted elsewhere
            raise
        return None if source is None else data

    def fill(self, dref: dict, blocks: list[int], concurrency: int = 8, prior: dict | None = None) -> dict:
        """Fill ``blocks`` (block ids) from the origin into this node's cache, at least
        ``concurrency`` ranged GETs at a time and more while the origin's measured
        bandwidth-delay product asks for them (one :class:`stoker.loader.prefetch.inflight.InflightTarget`
        per dataset, shared by this service's concurrent fills). A block that fails (origin error after its retries, checksum
        mismatch, a cache disk error) is counted and named, and the others go on.

        ``prior``: ``{block id: node id}``, the node that owned the block before the dataset's
        members last grew; such a block is filled from that node's cache when it holds it
        (:meth:`read`, :mod:`stoker.cluster.handoff`), else from the origin.

        Returns ``{filled, cached, refused, busy, failed, origin_bytes, handoff_bytes, errors}``:
        block counts by outcome, bytes fetched from the origin and from previous owners by this
        call, and ``errors``: ``{shard name: reason}`` for the shards of the failed blocks (one
        reason per shard, the first met).
        """
        ds = self._open(dref)
        self._renew(ds)
        version = ds.version
        out: dict[str, Any] = {
            "filled": 0,
            "cached": 0,
            "refused": 0,
            "busy": 0,
            "failed": 0,
            "origin_bytes": 0,
            "handoff_bytes": 0,
            "errors": {},
        }
        prior = {int(k): v for k, v in (prior or {}).items() if v != self.node_id}

        with self._lock:
            gate = self._gates.get(ds.url)
            if gate is None or gate.target.floor != max(1, int(concurrency)):
                gate = self._gates[ds.url] = InflightGate(InflightTarget(concurrency))

        def fetch(b):
            if ds.cache.contains(version, ds.blocks.name(b)):
                return "cached"
            first, got = self._prior.source(ds, dref, prior.get(int(b)))
            status, data = ds.reader.fill_block(int(b), blocking=True, first_source=first)
            return "handed" if status == "filled" and data is not None and data is got.get(int(b)) else status

        def one(b):
            try:
                return gate.run(lambda: fetch(b), int(ds.blocks.nbytes(int(b))), lambda st: st == "filled"), None
            except Exception as exc:  # noqa: BLE001 - reported per shard; the other blocks go on
                return "failed", f"{type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(max(1, min(len(blocks), gate.target.ceiling))) as pool:
            for b, (status, reason) in zip(blocks, pool.map(one, blocks)):
                if status == "handed":  # filled from the block's previous owner
                    out["filled"] += 1
                    out["handoff_bytes"] += int(ds.blocks.nbytes(int(b)))
                    continue
                out[status] = out.get(status, 0) + 1
                if status == "filled":  # fetched from the origin by this call
                    out["origin_bytes"] += int(ds.blocks.nbytes(int(b)))
                elif reason is not None:
                    shard = ds.index.shard_name(ds.blocks.shard[int(b)])
                    out["errors"].setdefault(shard, reason)
                    log.warning("warm-up of %s block %s (%s) failed: %s", ds.url, b, shard, reason)
        self._metrics.filled(out)
        self.cached_bytes(dref)  # sets the held-bytes gauge
        return out

    def cached_blocks(self, dref: dict) -> list[int]:
        """Ids of the blocks of the dataset this node's cache holds now."""
        ds = self._open(dref)
        return [b for b in range(len(ds.blocks)) if ds.cache.contains(ds.version, ds.blocks.name(b))]

    def hold(self, dref: dict, token: str) -> None:
        """A job (``token``, unique per job) starts reading the dataset through this node: its
        registration here now ends when the last such job calls :meth:`release` (or at the
        latest ``lease_s`` after the last request, for a job whose driver died)."""
        self._open(dref)
        with self._lock:
            self._holders.setdefault(dref["version"], set()).add(token)

    def release(self, dref: dict, token: str) -> bool:
        """Job ``token`` is done with the dataset. When no announced job holds it any more, this
        service's registration of it on the node cache ends now instead of ``lease_s`` later (a
        job that follows at once gets the budget at once); a later request leases it again.
        Returns whether the registration ended."""
        version = dref["version"]
        with self._lock:
            held = self._holders.get(version, set())
            held.discard(token)
            if held:
                return False
            self._holders.pop(version, None)
            self._renewed.pop(version, None)  # the next request leases again at once
        ds = self._datasets.get((dref["url"], version, dref["block_bytes"]))
        if ds is not None:
            lease(ds, 0.0)
        return ds is not None

    def cached_bytes(self, dref: dict) -> int:
        """Bytes of the dataset this node's cache holds now."""
        ds = self._open(dref)
        held = int(sum(int(ds.blocks.nbytes(b)) for b in self.cached_blocks(dref)))
        self._metrics.held_bytes(ds.url, ds.version, held)
        return held

    def claim(self, version: str, members: list[str], known: list[str] | None = None) -> list[str]:
        """Record the nodes a dataset version is placed on, first claim wins; returns the
        recorded members (so every job places a dataset on the same nodes). ``known``: the nodes
        with a service at the time (default ``members``), to tell later which nodes joined. In
        memory: after a restart of this service the next job's claim records again."""
        with self._lock:
            rec = self._claims.setdefault(
                version, {"members": list(members), "known": list(known or members), "previous": []}
            )
            return list(rec["members"])

    def record(self, version: str) -> dict | None:
        """The record of ``version`` (``{"members": [...], "known": [...], "previous": [...]}``:
        :mod:`stoker.cluster.membership`), None when there is none."""
        with self._lock:
            rec = self._claims.get(version)
            return {k: list(rec.get(k, [])) for k in RECORD_SETS} if rec else None

    def known(self, version: str) -> list[str]:
        """The nodes the record of ``version`` has seen ([] when there is none)."""
        with self._lock:
            rec = self._claims.get(version)
            return list(rec["known"]) if rec else []

    def widen(self, version: str, members: list[str], known: list[str], previous: list[str] | None = None) -> list[str]:
        """Add ``members``, ``known`` and ``previous`` (the members before their last growth) to
        the record of ``version`` (:func:`stoker.cluster.membership.merge`: sets only grow, so
        jobs that widen at once agree); returns the recorded members."""
        with self._lock:
            rec = self._claims.get(version, {})
            self._claims[version] = merge([rec, {"members": members, "known": known, "previous": previous or []}])
            return list(self._claims[version]["members"])

    def ping(self) -> str:
        return self.node_id

    def close(self) -> None:
        """Stop the data endpoint and close this service's connections to others (a service in
        a test process; a service actor ends with its process)."""
        self._endpoint.close()
        self._links.close()
        self._metrics.flush()


def _listen(handler, secret: bytes, node_dir: str) -> DataEndpoint:
    """The data endpoint of a service (module doc; :data:`DATA_HOST_ENV`): on ``STOKER_DATA_PORT``
    when set, else on the port this node's endpoint had before (kept in ``<node cache
    dir>/.data-endpoint``, so a restarted service is found where its peers' links left it) when
    free, else any. Peers are told the node's cluster address when it listens on a wildcard.
    ServiceStartError naming the setting when the address cannot be bound or the port is not one."""
    node_ip = ray.util.get_node_ip_address()
    host = os.environ.get(DATA_HOST_ENV) or node_ip
    public = node_ip if host in WILDCARD_HOSTS else host
    wanted = _port_setting()
    record = os.path.join(node_dir, ".data-endpoint")
    before = 0
    if not wanted:
        try:
            with open(record) as f:
                before = int(f.read().strip() or 0)
        except (OSError, ValueError):
            before = 0
    try:
        try:
            ep = DataEndpoint(handler, secret, host, wanted or before, public_host=public)
        except (OSError, OverflowError):
            if wanted or not before:
                raise
            ep = DataEndpoint(handler, secret, host, 0, public_host=public)  # the old port is taken
    except (OSError, OverflowError) as exc:
        how = [f"{DATA_HOST_ENV}={host}" if os.environ.get(DATA_HOST_ENV) else "the node's address from Ray"]
        how += [f"{DATA_PORT_ENV}={wanted}"] if wanted else []
        raise ServiceStartError(
            f"data endpoint cannot listen on {host}:{wanted or 'any port'} ({', '.join(how)}): {exc}"
        ) from exc
    if not wanted and ep.port != before:
        try:
            with open(record, "w") as f:
                f.write(str(ep.port))
        except OSError as exc:
            log.warning("cannot record the data endpoint's port in %s: %s", record, exc)
    return ep


def _port_setting() -> int:
    """``STOKER_DATA_PORT`` as a port number (0: not set); ServiceStartError when it is not one."""
    text = os.environ.get(DATA_PORT_ENV, "").strip()
    try:
        port = int(text or 0)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ServiceStartError(f"{DATA_PORT_ENV} must be a TCP port number (1-65535), got {text!r}")
    return port


def _used_bytes(cache: CacheOptions) -> int:
    """Bytes of blocks in the disk tier of ``cache`` (a node's, with its budget)."""
    assert cache.cache_dir is not None and isinstance(cache.cache_bytes, int)  # a node's: CacheOptions.for_node
    return DiskCache(cache.cache_dir, cache.cache_bytes, mode=cache.cache_mode).used_bytes()


# ray's typed overloads of remote() take the task options only, not an actor's (max_concurrency, max_restarts)
_Remote = ray.remote(
    num_cpus=0,
    max_concurrency=MAX_CONCURRENCY,  # type: ignore[call-overload]
    max_restarts=-1,
)(CacheService)


def alive_nodes() -> list[dict]:
    """Ray's alive nodes (``ray.nodes()`` entries), sorted by node id."""
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def start_services(
    cache_dir: str | None = None,
    cache_bytes=None,
    *,
    cache: CacheOptions | None = None,
    timeout_s: float = 60.0,
    lease_s: float | None = None,
    down: dict[str, str] | None = None,
) -> dict[str, "ray.actor.ActorHandle"]:
    """One cache service on every alive node (reusing those already running); ``{node id: handle}``.

    ``cache``: the node caches (:class:`stoker.CacheOptions`, ``cache_dir`` the cluster cache
    root, default ``<default cache dir>/cluster``; ``cache_bytes`` a budget per node, or ``{node id: size}``: nodes not named get none and
    no service; :meth:`stoker.CacheOptions.for_node`); ``cache_dir``/``cache_bytes``: the
    shortcut for those fields. The services are *detached* named actors (``lifetime="detached"``,
    name :func:`service_name` in the namespace ``stoker``: a named actor that is not detached would
    die with this driver, under every other job's feet); :func:`stop_services` ends them.
    ``lease_s``: see :class:`CacheService` (for services started here).

    Waits until every service answers. A service whose start fails (its constructor raised,
    e.g. the node's cache directory is unusable: Ray does not restart it) raises
    :class:`stoker.errors.ServiceStartError` at once; one still not answering after
    ``timeout_s`` seconds raises ``ray.exceptions.GetTimeoutError``; both name the node. With
    ``down`` (a dict), such a node is recorded there instead (``{node id: reason}``) and left out
    of the result, and the other services are still waited for.
    """
    cache = with_shortcuts(cache, cache_dir, cache_bytes)
    if cache.cache_dir is None:
        cache = dataclasses.replace(cache, cache_dir=os.path.join(default_cache_dir(), "cluster"))
    handles, hosts = {}, {}
    for node in alive_nodes():
        nid = node["NodeID"]
        hosts[nid] = node.get("NodeManagerHostname")
        mine = cache.for_node(nid)
        if mine is None:
            continue
        opts = dict(
            name=service_name(nid),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
        )
        handles[nid] = _Remote.options(**opts).remote(nid, mine, None, lease_s)
    _wait_answer(handles, timeout_s, down, hosts)
    return {nid: h for nid, h in handles.items() if down is None or nid not in down}


def _wait_answer(
    handles: dict, timeout_s: float, down: dict[str, str] | None = None, hosts: dict | None = None
) -> None:
    """Wait until every service of ``handles`` (``{node id: handle}``) answers a ping; one that is
    restarting (``RayActorError``) is asked again until ``timeout_s`` seconds have passed. A
    service that cannot start (see :func:`start_services`) or does not answer in time raises,
    naming its node (its Ray id, and its host from ``hosts``, ``{node id: host name}``: it has no
    cache directory to name yet, :func:`stoker.cluster.identity.node_label`), or with ``down`` is
    recorded there (``{node id: reason}``)."""
    deadline = time.monotonic() + timeout_s
    refs = {nid: h.ping.remote() for nid, h in handles.items()}
    while refs:
        nid, ref = next(iter(refs.items()))
        name = node_label(nid, host=(hosts or {}).get(nid))
        error: Exception
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            del refs[nid]
            continue
        except ray.exceptions.GetTimeoutError as exc:
            why = f"cache service of {name} did not answer in {timeout_s} s (start timeout)"
            error = ray.exceptions.GetTimeoutError(why)
            cause: Exception = exc
        except ray.exceptions.RayActorError as exc:
            cause = exc
            if getattr(exc, "actor_init_failed", False):  # its constructor raised: Ray will not restart it
                why = f"cache service of {name} could not start: {error_line(exc)}"
                error = ServiceStartError(why)
            elif time.monotonic() < deadline:  # restarting: ask again
                time.sleep(0.2)
                refs[nid] = handles[nid].ping.remote()
                continue
            else:
                why = f"cache service of {name} did not answer in {timeout_s} s (start timeout): {error_line(exc)}"
                error = ray.exceptions.GetTimeoutError(why)
        if down is None:
            raise error from cause
        log.warning("%s", why)
        down[nid] = why
        del refs[nid]


def error_line(exc: BaseException) -> str:
    """One line for a failed Ray call: the innermost error's type and its last message line, not
    Ray's traceback."""
    inner = getattr(exc, "cause", None) or exc
    if isinstance(inner, ray.exceptions.RayTaskError) and inner.cause is not None:
        inner = inner.cause
    text = [ln for ln in str(inner).strip().splitlines() if ln.strip()]
    return f"{type(inner).__name__}: {text[-1].strip() if text else ''}"


def find_services(timeout_s: float = 10.0) -> dict[str, dict]:
    """The cache services that answer now: ``{node id: info()}``, sorted by node id. A service
    that is dead or restarting is left out (it rejoins when it answers again)."""
    found = {}
    refs: dict[str, ray.ObjectRef] = {}
    hosts: dict[str, str | None] = {}
    for node in alive_nodes():
        try:
            h = ray.get_actor(service_name(node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue
        refs[node["NodeID"]] = h.info.remote()
        hosts[node["NodeID"]] = node.get("NodeManagerHostname")
    for nid, ref in refs.items():
        try:
            found[nid] = ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            log.warning("cache service of %s did not answer: %s", node_label(nid, host=hosts[nid]), exc)
    return dict(sorted(found.items()))


def get_service(node_id: str):
    """The handle of the cache service of ``node_id``; ValueError if there is none."""
    return ray.get_actor(service_name(node_id), namespace=NAMESPACE)


def endpoint_of(node_id: str, dref: dict, timeout_s: float) -> tuple[str, int]:
    """``(host, port)`` of the data endpoint of ``node_id``'s cache service, asked through Ray
    (:meth:`CacheService.endpoint`, which opens the dataset of ``dref`` for its peers first),
    waited for at most ``timeout_s``. ValueError when the node has no service; Ray's errors
    (``GetTimeoutError``, ``RayActorError``) when it does not answer."""
    host, port = ray.get(get_service(node_id).endpoint.remote(dref), timeout=timeout_s)
    return str(host), int(port)


def stop_services() -> int:
    """Kill every cache service (for good: no restart); returns how many. Their cache files stay."""
    n = 0
    for node in alive_nodes():
        try:
            h = get_service(node["NodeID"])
        except ValueError:
            continue
        ray.kill(h, no_restart=True)
        n += 1
    return n


def prepare(
    url: str,
    storage_options: dict | None,
    cache: CacheOptions,
    block_bytes: int | str | None,
    down: dict[str, str] | None = None,
):
    """The common first steps of ``run``, ``warm``, ``rank_context`` and ``placement_hint``: start
    the services where missing (``cache``: :func:`start_services`; default root
    ``$STOKER_CACHE_DIR/cluster``, 8 GiB per node), list those that answer, open the dataset's
    index. Returns ``(services {node id: info}, dataset (no cache), dataset_ref)``.
    Services already running keep their cache directories and budgets (a warning names them when
    ``cache`` asks for others: :func:`warn_kept_settings`). ValueError for a budget of 0; RuntimeError when no service answers; a
    service that cannot start raises as in :func:`start_services`, or with ``down`` (a dict) is
    recorded there (``{node id: reason}``) and left out; RuntimeError before ``ray.init()``
    (outside a Ray worker), saying so."""
    if not ray.is_initialized():
        raise RuntimeError(
            f"stoker.cluster needs a running Ray for {url}: call ray.init() first (or run inside a Ray worker)"
        )
    if cache.cache_bytes == 0:
        raise ValueError("cache_bytes must give some node a budget above 0 bytes, got 0")
    start_services(cache=cache, down=down)
    services = {k: v for k, v in find_services().items() if down is None or k not in down}
    warn_kept_settings(cache, services)
    if not services:
        why = "; ".join(down.values()) if down else ""
        raise RuntimeError("no cache service answers on any node" + (f" ({why})" if why else ""))
    opts = dict(storage_options or {})
    ds = open_dataset(
        url, storage_options=opts, cache=False, check=False, block_bytes=block_bytes or DEFAULT_BLOCK_BYTES
    )
    return services, ds, dataset_ref(ds, opts)


def warn_kept_settings(cache: CacheOptions, services: dict) -> None:
    """Log one warning per setting of ``cache`` (:class:`stoker.CacheOptions`) that the running
    ``services`` (``{node id: info()}``) do not have, naming each such node by
    :func:`stoker.cluster.identity.node_label` and what it keeps: ``cache_dir`` (the cluster cache
    root asked for, compared with the parent of each service's node directory, both as absolute
    paths; None asks nothing) and ``cache_bytes`` (bytes per node, :meth:`stoker.CacheOptions.for_node`;
    None asks nothing) and ``memory_bytes`` (the memory tier, bytes per node; 0 asks nothing).
    Services are detached and shared by every job of the cluster, so a job
    never restarts them: it reads and fills the caches they keep, and the warning says how to move
    them (:func:`stop_services`, then the next job starts services with its own settings). Nodes
    that ``cache`` gives no budget are not compared. Raises nothing."""
    mine = {nid: m for nid in services if (m := cache.for_node(nid)) is not None}
    if cache.cache_dir is not None:
        want = os.path.abspath(os.path.expanduser(os.fspath(cache.cache_dir)))
        roots = {
            node_label(nid, services): os.path.dirname(os.path.normpath(services[nid]["cache_dir"]))
            for nid in mine
            if services[nid].get("cache_dir")
        }
        other = {n: r for n, r in roots.items() if r != want}
        if other:
            log.warning(
                "cache_dir=%r is not used: %d running cache service(s) keep their caches under %s (%s), "
                "and this job reads and fills those. Running services keep their directories (they are "
                "detached and shared by every job); to move the cache, stop them when no job is running "
                "(stoker.cluster.service.stop_services()): the next job starts them under its cache_dir",
                want,
                len(other),
                " and ".join(sorted(set(other.values()))),
                ", ".join(f"{n}: {r}" for n, r in sorted(other.items())[:5]) + (", ..." if len(other) > 5 else ""),
            )
    if cache.cache_bytes is not None:  # asked for a budget: say where running services keep another one
        budgets = {
            node_label(nid, services): services[nid]["cache_bytes"]
            for nid, m in mine.items()
            if services[nid]["cache_bytes"] != m.cache_bytes
        }
        if budgets:
            log.warning(
                "cache_bytes=%r applies only to the cache services started now; %d running service(s) "
                "keep their budgets (%s): stop them first (stoker.cluster.service.stop_services()) to "
                "change them",
                cache.cache_bytes,
                len(budgets),
                ", ".join(f"{n}: {b:,} bytes" for n, b in sorted(budgets.items())[:5]),
            )
    if cache.memory_bytes:  # asked for a memory tier: say where running services keep another one
        tiers = {
            node_label(nid, services): kept.memory_bytes
            for nid in mine
            if (kept := services[nid].get("cache")) is not None and kept.memory_bytes != cache.memory_bytes
        }
        if tiers:
            log.warning(
                "memory_bytes=%r applies only to the cache services started now; %d running service(s) "
                "keep their memory tiers (%s): stop them first (stoker.cluster.service.stop_services()) to "
                "change them",
                cache.memory_bytes,
                len(tiers),
                ", ".join(f"{n}: {b:,} bytes" for n, b in sorted(tiers.items())[:5]),
            )
