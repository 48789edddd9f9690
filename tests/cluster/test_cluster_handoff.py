"""When a node joins, the blocks it now owns come from their previous owner's cache, not the origin.

The record keeps the members before the last growth (``previous``); a block whose owner changed
with that growth is filled from the node that owned it before (a cache-only read of its
data endpoint), and from the origin only when that node is gone, does not hold it, fails or does not
answer. The first tests run the pure parts and the cache service's class in this process (no
Ray calls); the last two run jobs on the test cluster, one with a node that joins and one whose
previous owner is removed."""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import pytest

from _helpers import loader_epoch
from stoker import CacheOptions
from stoker.cluster import ClusterOptions

pytest.importorskip("ray")

from _dataplane import no_ray  # noqa: E402

from stoker.cluster.handoff import previous_layout, prior_owner  # noqa: E402
from stoker.cluster.membership import after_growth, merge  # noqa: E402
from stoker.cluster.placement import place_dataset  # noqa: E402
from stoker.cluster.service import cache_service as service_mod
from stoker.store.dataset import open_dataset  # noqa: E402

BLOCK = 64 << 10


# -- the record ---------------------------------------------------------------------------------
def test_records_merge_by_union_and_keep_the_members_before_the_last_growth():
    old = {"members": ["a", "b"], "known": ["a", "b"]}  # written before `previous` existed
    grown = {"members": ["a", "b", "c"], "known": ["a", "b", "c"], "previous": ["a", "b"]}
    assert merge([old, grown]) == grown
    assert merge([old]) == {"members": ["a", "b"], "known": ["a", "b"], "previous": []}
    later = {"members": ["a", "b", "c", "d"], "known": ["a", "b", "c", "d"], "previous": ["a", "b", "c"]}
    assert merge([grown, later])["previous"] == ["a", "b", "c"]  # a service that missed the last write
    assert after_growth(["b", "a"], ["a", "b", "c"], []) == ["a", "b"]  # grew: the members before
    assert after_growth(["a", "b", "c"], ["c", "b", "a"], ["a", "b"]) == ["a", "b"]  # no growth: kept


class _FakeService:
    """A cache service's record methods, called as Ray calls them (``.method.remote``)."""

    def __init__(self):
        self.svc = service_mod.CacheService.__new__(service_mod.CacheService)
        self.svc._claims, self.svc._lock = {}, threading.Lock()

    def __getattr__(self, name):
        return type("M", (), {"remote": staticmethod(getattr(self.svc, name))})


def test_settling_records_the_members_before_a_join_on_every_service(monkeypatch):
    from stoker.cluster.service import records

    fakes = {n: _FakeService() for n in ["a", "b"]}
    monkeypatch.setattr(records, "get_service", lambda n: fakes[n])
    monkeypatch.setattr(records.ray, "get", lambda ref, **kw: ref)
    info = {n: {"cache_bytes": 100} for n in ["a", "b"]}
    # a first claim that grows at once placed nothing yet: no previous owners to ask
    assert records.settle_record(info, "v1", 150, ["a"], ["a"]) == {"members": ["a", "b"], "previous": []}
    fakes["c"] = _FakeService()  # joins
    info["c"] = {"cache_bytes": 100}
    assert records.settle_record(info, "v1", 150, [], ["a"]) == {"members": ["a", "b", "c"], "previous": ["a", "b"]}
    assert all(f.svc.record("v1")["previous"] == ["a", "b"] for f in fakes.values())
    fakes["b"] = _FakeService()  # restarted: its record is gone, and comes back from the others
    assert records.settle_record(info, "v1", 150, [], ["a"]) == {"members": ["a", "b", "c"], "previous": ["a", "b"]}
    assert fakes["b"].svc.record("v1")["previous"] == ["a", "b"]


def test_prior_owner_names_the_old_owner_of_exactly_the_blocks_that_moved(packed_local):
    ds = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    services = {n: {"cache_key": f"host-{n}", "cache_bytes": 1 << 30} for n in ["a", "b", "c"]}
    members = ["a", "b", "c"]
    owner = place_dataset(ds, [f"host-{n}" for n in members], [1 << 30] * 3)
    before = place_dataset(ds, ["host-a", "host-b"], [1 << 30] * 2)  # indices into [a, b]: the same in members
    prior = prior_owner(ds, members, owner, previous_layout(services, members, ["a", "b"]))
    moved = before != owner
    assert moved.any() and (owner[moved] == 2).mean() > 0.9  # mostly the blocks c won
    assert np.array_equal(prior[moved], before[moved]) and (prior[~moved] == -1).all()
    assert (prior_owner(ds, members, owner, previous_layout(services, members, [])) == -1).all()
    # a previous member that is gone is left out: its blocks are looked for on the one left
    gone = {n: v for n, v in services.items() if n != "b"}
    left = prior_owner(ds, ["a", "c"], owner.clip(0, 1), previous_layout(gone, ["a", "c"], ["a", "b"]))
    assert set(np.unique(left)) <= {-1, 0}


# -- the cache service's fills ------------------------------------------------------------------
class _Node:
    def __init__(self):
        self.id = "node-a"

    def get_node_id(self) -> str:
        return self.id


class _Handle:
    """A service's handle as Ray calls it: where its data endpoint listens."""

    def __init__(self, svc):
        self.svc = svc
        self.endpoint = type("M", (), {"remote": staticmethod(svc.endpoint)})


@pytest.fixture
def two(tmp_path, monkeypatch):
    """Two cache services (node-a, node-b) in this process, and their handles as the other sees them."""
    here = _Node()
    no_ray(monkeypatch)  # the cluster secret and the node's address, without Ray
    monkeypatch.setattr(service_mod.ray, "get_runtime_context", lambda: here)
    a = service_mod.CacheService("node-a", CacheOptions(cache_dir=str(tmp_path / "a"), cache_bytes=64 << 20))
    here.id = "node-b"
    b = service_mod.CacheService("node-b", CacheOptions(cache_dir=str(tmp_path / "b"), cache_bytes=64 << 20))
    handles = {"node-a": _Handle(a), "node-b": _Handle(b)}
    monkeypatch.setattr(service_mod, "get_service", lambda n: handles[n])
    monkeypatch.setattr(service_mod.ray, "get", lambda ref, **kw: ref)
    yield a, b, handles
    a.close()
    b.close()


def _origin_reads(monkeypatch, ds) -> list:
    calls: list = []
    cls = type(ds.origin)
    real = cls.read_range

    def counted(self, *a, **kw):
        calls.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(cls, "read_range", counted)
    return calls


def test_the_new_owner_fills_a_block_from_its_previous_owner_not_the_origin(two, packed_local, monkeypatch):
    a, b, _ = two
    ds = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    dref = service_mod.dataset_ref(ds)
    assert b.fill(dref, [1, 2])["origin_bytes"] > 0  # b owned blocks 1 and 2 before the join
    start, stop = int(ds.blocks.start[1]), int(ds.blocks.start[1]) + 500
    want = bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[1]), start, stop))
    origin = _origin_reads(monkeypatch, ds)
    assert a.read(dref, 1, start, stop, prior="node-b") == ("handoff", want)
    got = a.fill(dref, [2], prior={2: "node-b"})
    assert (got["filled"], got["origin_bytes"], got["handoff_bytes"]) == (1, 0, int(ds.blocks.nbytes(2)))
    assert origin == []  # neither the new owner nor the previous one went to the origin
    assert a.read(dref, 1, start, stop, prior="node-b") == ("cache", want)  # kept on the new owner
    assert b.read_cached(dref, 3, int(ds.blocks.start[3]), int(ds.blocks.start[3]) + 10) is None  # cache only
    assert origin == []


def test_the_origin_when_the_previous_owner_lacks_the_block_sends_bad_bytes_or_fails(two, packed_local, monkeypatch):
    a, b, handles = two
    ds = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    dref = service_mod.dataset_ref(ds)
    s = int(ds.blocks.start[1])
    want = bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[1]), s, s + 500))
    assert a.read(dref, 1, s, s + 500, prior="node-b") == ("origin", want)  # b does not hold it
    b.fill(dref, [2, 3])
    real = a._prior.fetch
    monkeypatch.setattr(a._prior, "fetch", lambda *args: bytes(len(real(*args))))  # zeros: a bad copy
    got = a.fill(dref, [2], prior={2: "node-b"})
    assert (got["filled"], got["handoff_bytes"], got["failed"]) == (1, 0, 0)
    assert got["origin_bytes"] == int(ds.blocks.nbytes(2))
    monkeypatch.setattr(a._prior, "fetch", real)
    b._endpoint.close()  # the previous owner stops answering: asked once, then left alone
    calls: list = []
    monkeypatch.setattr(a._prior, "fetch", lambda *args: calls.append(args) or real(*args))
    s3 = int(ds.blocks.start[3])
    assert a.read(dref, 3, s3, s3 + 100, prior="node-b")[0] == "origin"
    assert len(calls) == 1
    s4 = int(ds.blocks.start[4])
    assert a.read(dref, 4, s4, s4 + 100, prior="node-b")[0] == "origin"
    assert len(calls) == 1


# -- jobs on the test cluster -------------------------------------------------------------------
def _job(url, n, nodes, budget, name, common, train_fn=None):
    """A job of ``n`` ranks with cache services on ``nodes`` (``budget`` bytes each): ``(sample ids
    read, sorted; byte totals over the ranks)``. ``train_fn``: default :func:`read_epochs` (in
    the rank's process, ids recorded); a Loader's epochs (:func:`loader_epoch`) check their
    plan themselves (``exactly_once``), and the ids are then ``range(samples read)``."""
    from stoker.cluster import read_epochs, run

    out = run(
        train_fn or partial(read_epochs, epochs=1, keep_ids=True),
        url,
        n,
        {"CPU": 0.5},
        cache_bytes={m: budget for m in nodes},
        cluster=ClusterOptions(job=name, timeout_s=180),
        **common,
    )
    recs = [r["result"][0] for r in out]
    if all("ids" in rec for rec in recs):
        ids = sorted(i for rec in recs for i in rec["ids"])
    else:  # a Loader's epochs: its own exactly-once check of the rank's plan, and the plans' sizes
        assert all(rec["exactly_once"] for rec in recs)
        ids = list(range(sum(rec["samples"] for rec in recs)))
    total = {k: sum(r["result"][0].get(k, 0) for r in out) for k in ("origin_bytes", "handoff_bytes", "read_bytes")}
    return ids, total


def test_a_joined_node_takes_its_blocks_from_their_previous_owners(cluster, s3_dataset, tmp_path, fresh_services):
    """The dataset is cached on 2 nodes; a third joins (its service starts); a 3-rank job reads
    every sample once and the origin serves none of it: the third of the blocks the new node now
    owns come from the caches of the nodes that held them (on main: about a third from the origin)."""
    from stoker.cluster.service.cache_service import alive_nodes

    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    n = len(ds)
    budget = int(ds.index.total_bytes) * 3 // 4  # one node cannot hold it: both first nodes are members
    nodes = [x["NodeID"] for x in alive_nodes()][:3]
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), block_bytes=BLOCK)
    ids, first = _job(url, 2, nodes[:2], budget, "before-join", common)
    assert ids == list(range(n)) and first["origin_bytes"] > 0
    ids, after = _job(url, 3, nodes, budget, "after-join", common)
    assert ids == list(range(n))  # every sample exactly once
    assert after["handoff_bytes"] >= 0.15 * after["read_bytes"]  # about the third the new node won
    assert after["origin_bytes"] <= 0.02 * after["read_bytes"]


def test_warm_after_a_join_fills_the_new_node_from_the_previous_owners(cluster, s3_dataset, tmp_path, fresh_services):
    """``stoker warm`` after a third node's service joins: the new node's cache service fills the
    blocks it won from the services that held them (service to service, through Ray), none from
    the origin, and the report says so."""
    from stoker.cluster.service.cache_service import alive_nodes
    from stoker.cluster.service.warmup import warm

    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    budget = int(ds.index.total_bytes) * 3 // 4
    nodes = [x["NodeID"] for x in alive_nodes()][:3]
    where = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), block_bytes=BLOCK)
    first = warm(url, cache_bytes={m: budget for m in nodes[:2]}, **where)
    assert first["complete"] and first["handoff_bytes"] == 0
    again = warm(url, cache_bytes={m: budget for m in nodes}, **where)
    assert again["complete"] and nodes[2] in again["nodes"]
    assert again["nodes"][nodes[2]]["filled"] > 0
    # all the new node won, handed off (and any block the bounded loads moved between the others)
    assert again["handoff_bytes"] >= again["nodes"][nodes[2]]["owned_bytes"] > 0
    assert again["origin_bytes"] == 0


def _evict_all(url, opts, info):
    """Drop every block of the dataset from the node cache of ``info`` (a service's info), as
    eviction or a lost disk would; runs on that node (the cache is shared by its processes)."""
    ds = open_dataset(url, info["cache_dir"], info["cache_bytes"], storage_options=opts, check=False, block_bytes=BLOCK)
    held = [b for b in range(len(ds.blocks)) if ds.cache.contains(ds.version, ds.blocks.name(b))]
    for b in held:
        ds.cache.remove(ds.version, ds.blocks.name(b))
    return len(held)


def test_blocks_whose_previous_owner_no_longer_holds_them_come_from_the_origin(
    cluster, s3_dataset, tmp_path, fresh_services
):
    """Cached on 2 nodes; one of them loses its blocks (evicted); a third node joins: the blocks
    it won from the node that kept them are handed off, the ones it won from the node that lost
    them come from the origin (asked, the node answers it does not hold them; it never goes to
    the origin for them itself), and every sample is read once."""
    ray = pytest.importorskip("ray")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stoker.cluster.service.cache_service import alive_nodes, find_services

    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    n = len(ds)
    budget = int(ds.index.total_bytes) * 3 // 4
    nodes = [x["NodeID"] for x in alive_nodes()][:3]
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), block_bytes=BLOCK)
    ids, _ = _job(url, 2, nodes[:2], budget, "before-evict", common)
    assert ids == list(range(n))
    on = NodeAffinitySchedulingStrategy(nodes[1], soft=False)
    evict = ray.remote(num_cpus=0)(_evict_all).options(scheduling_strategy=on)
    assert ray.get(evict.remote(url, opts, find_services()[nodes[1]]), timeout=60) > 0
    ids, after = _job(url, 3, nodes, budget, "after-evict", common, loader_epoch)
    assert ids == list(range(n))  # every sample exactly once
    assert after["handoff_bytes"] > 0  # from the node that kept its blocks
    assert after["origin_bytes"] >= 0.3 * after["read_bytes"]  # the evicted node's share, from the origin


# -- a rank's own fills -------------------------------------------------------------------------
@pytest.fixture
def router(packed_local):
    """A rank's router on node a, which owns every block now; node b owned them before."""
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.service.reader import BlockRouter

    ds = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    counters = ByteCounters()
    counters.size_tags(len(ds.blocks))
    owner, prior = np.zeros(len(ds.blocks), np.int64), np.ones(len(ds.blocks), np.int64)
    r = BlockRouter(
        service_mod.dataset_ref(ds), ["a", "b"], owner, 0, counters, timeout_s=2.0, retry_s=30.0, prior=prior
    )
    try:
        yield ds, r, counters
    finally:
        counters.close()


def _whole(ds, b):
    start, stop = int(ds.blocks.start[b]), int(ds.blocks.end[b])
    return start, stop, bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop))


def test_a_rank_fills_its_nodes_block_from_the_previous_owner_and_else_the_origin(router, monkeypatch):
    from stoker.errors import PeerUnavailable

    ds, r, counters = router
    asked = []
    answers = {}

    def cached(o, b, start, stop):
        asked.append((o, b))
        got = answers[b]
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(r, "peer_cached", cached)
    s1, e1, want1 = _whole(ds, 1)
    answers[1] = want1
    assert r.read(ds, 1, s1, e1, block=True) == want1 and asked == [(1, 1)]
    assert counters.read()["fetch_handoff"] == len(want1) and counters.read()["fetch_origin"] == 0
    s2, e2, want2 = _whole(ds, 2)
    answers[2] = None  # the previous owner does not hold it
    assert r.read(ds, 2, s2, e2, block=True) == want2
    s3, e3, want3 = _whole(ds, 3)
    answers[3] = bytes(e3 - s3)  # a bad copy: checked, dropped, the origin read
    assert r.read(ds, 3, s3, e3, block=True) == want3
    s4, e4, want4 = _whole(ds, 4)
    answers[4] = PeerUnavailable("gone")
    assert r.read(ds, 4, s4, e4, block=True) == want4
    asked.clear()
    s5, e5, want5 = _whole(ds, 5)
    assert r.read(ds, 5, s5, e5, block=True) == want5 and asked == []  # failed once: left alone for retry_s
    got = counters.read()
    assert got["fetch_handoff"] == len(want1) and got["fallbacks"] == 2  # the bad copy and the failed call
    assert got["fetch_origin"] == sum(len(w) for w in (want2, want3, want4, want5))


class _Hangs:
    """A service whose data endpoint accepts connections and never says a word."""

    def endpoint(self, dref=None):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        return self.sock.getsockname()

    def ping(self):
        return "hangs"


def test_a_previous_owner_that_hangs_costs_one_peer_timeout_then_the_origin(cluster, router):
    """A real Ray actor in the previous owner's service name whose data endpoint never answers:
    the rank's fill waits the peer timeout (2 s here), no longer, and reads the origin."""
    import time

    ray = pytest.importorskip("ray")
    ds, r, counters = router
    hang = (
        ray.remote(num_cpus=0, max_concurrency=4)(_Hangs)
        .options(name=service_mod.service_name("b"), namespace=service_mod.NAMESPACE)
        .remote()
    )
    try:
        assert ray.get(hang.ping.remote(), timeout=60) == "hangs"
        s, e, want = _whole(ds, 1)
        t0 = time.monotonic()
        assert r.read(ds, 1, s, e, block=True) == want
        assert time.monotonic() - t0 < 20  # a guard against hanging, not a speed limit
        assert r.suspects() == ["b"] and counters.read()["fallbacks"] == 1
    finally:
        ray.kill(hang)
