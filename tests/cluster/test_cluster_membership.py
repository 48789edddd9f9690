"""A dataset's placement members follow the cluster and the jobs: a first job on one node does
not fix them for good."""

from __future__ import annotations

from functools import partial

import pytest

from stoker.cluster import ClusterOptions
from stoker.cluster.membership import widen

BLOCK = 64 << 10


def test_widen_adds_joined_nodes_and_room_only_when_needed():
    budgets = {"a": 4, "b": 4, "c": 4, "d": 1}
    assert widen(["a"], ["a", "b", "c", "d"], budgets, 4, ["a"]) == ["a"]  # it fits: unchanged
    assert widen(["a"], ["a", "b", "c", "d"], budgets, 10, ["a", "c"]) == ["a", "b", "c"]  # job nodes first
    assert widen(["a"], ["a", "b", "c"], budgets, 4, ["a"]) == ["a", "d"]  # d joined since
    assert widen(["a", "b"], ["a", "b"], {"a": 4}, 100, ["a"]) == ["a", "b"]  # never drops a member


def test_a_one_rank_first_job_does_not_pin_the_dataset_to_one_node(cluster, s3_dataset, tmp_path):
    """A 1-rank job reads the dataset first on a node whose budget cannot hold it: the members
    grow until their budgets hold it, a 3-rank job's ranks go to them, and its next epoch reads
    nothing from the origin (with the members fixed by the first job it read 40 % every epoch)."""
    ray = pytest.importorskip("ray")
    from stoker.cluster import read_epochs, run
    from stoker.cluster.service.cache_service import get_service, stop_services
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    budget = int(ds.index.total_bytes) * 6 // 10  # one node holds 60 %, the three of them 180 %
    stop_services()
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=budget, block_bytes=BLOCK)
    try:
        run(
            partial(read_epochs, epochs=1),
            url,
            1,
            {"CPU": 0.5},
            cluster=ClusterOptions(job="probe", timeout_s=180),
            **common,
        )
        e0 = run(
            partial(read_epochs, epochs=1),
            url,
            3,
            {"CPU": 0.5},
            cluster=ClusterOptions(job="train", timeout_s=180),
            **common,
        )
        e1 = run(
            partial(read_epochs, epochs=1, first_epoch=1),
            url,
            3,
            {"CPU": 0.5},
            cluster=ClusterOptions(job="train", timeout_s=180),
            **common,
        )
        from stoker.cluster.service.cache_service import alive_nodes

        members = ray.get(get_service(alive_nodes()[0]["NodeID"]).claim.remote(ds.version, []))
        assert len(members) >= 2 and budget * len(members) >= ds.index.total_bytes  # grown until it fits
        assert {r["node_id"] for r in e0 + e1} <= set(members) and len({r["node_id"] for r in e1}) >= 2
        assert sum(r["result"][0]["origin_bytes"] for r in e1) == 0  # the cluster holds it all
    finally:
        stop_services()  # the next tests start services of their own budget


def test_a_node_that_joins_after_placement_becomes_a_member(cluster, s3_dataset, tmp_path):
    """A dataset placed on the 3 nodes; a 4th node joins: the next job makes it a member, it
    caches its share, and the blocks that move are about the ones it wins (rendezvous hashing;
    the bounded loads move a few between the old nodes)."""
    ray = pytest.importorskip("ray")
    import numpy as np

    from stoker.cluster import read_epochs, run
    from stoker.cluster.placement import place_dataset
    from stoker.cluster.service.cache_service import (
        alive_nodes,
        dataset_ref,
        find_services,
        get_service,
        placement_keys,
        stop_services,
    )
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    stop_services()
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    new = None
    try:
        run(
            partial(read_epochs, epochs=1),
            url,
            3,
            {"CPU": 0.5},
            cluster=ClusterOptions(job="before", timeout_s=180),
            **common,
        )
        keeper = get_service(alive_nodes()[0]["NodeID"])
        old = ray.get(keeper.claim.remote(ds.version, []))
        services = find_services()
        before = place_dataset(ds, placement_keys(services, old), [services[m]["cache_bytes"] for m in old])
        new = cluster.add_node(
            num_cpus=1, resources={"joined": 1}, object_store_memory=100 << 20, node_ip_address="127.0.0.1"
        )
        cluster.wait_for_nodes()
        run(
            partial(read_epochs, epochs=1, first_epoch=1),
            url,
            3,
            {"CPU": 0.5},
            cluster=ClusterOptions(job="after", timeout_s=180),
            **common,
        )
        members = ray.get(keeper.claim.remote(ds.version, []))
        assert new.node_id in members and set(old) < set(members)
        services = find_services()
        after = place_dataset(ds, placement_keys(services, members), [services[m]["cache_bytes"] for m in members])
        moved = np.asarray(members)[after] != np.asarray(old)[before]
        to_new = np.asarray(members)[after][moved] == new.node_id
        assert to_new.any() and to_new.sum() >= 0.75 * moved.sum() and moved.mean() <= 0.45
        assert ray.get(get_service(new.node_id).cached_bytes.remote(dataset_ref(ds, opts))) > 0
    finally:
        stop_services()
        if new is not None:
            cluster.remove_node(new)


class _FakeService:
    """A cache service's record methods, called as Ray calls them (``.method.remote``)."""

    def __init__(self):
        from stoker.cluster.service.cache_service import CacheService

        self.svc = CacheService.__new__(CacheService)
        import threading

        self.svc._claims, self.svc._lock = {}, threading.Lock()

    def __getattr__(self, name):
        fn = getattr(self.svc, name)
        return type("M", (), {"remote": staticmethod(fn)})


def test_members_recorded_on_every_service_survive_a_new_lowest_node_and_a_restart(monkeypatch):
    """The record is kept by every service: a node that joins with the lowest id (the one whose
    service a job asks first) and a service that restarted empty both still see the members, and
    the joined node becomes one."""
    pytest.importorskip("ray")
    from stoker.cluster.service import records

    fakes = {n: _FakeService() for n in ["b", "c", "d"]}
    monkeypatch.setattr(records, "get_service", lambda n: fakes[n])
    monkeypatch.setattr(records.ray, "get", lambda ref, **kw: ref)
    info = {n: {"cache_bytes": 100} for n in ["b", "c", "d"]}
    assert records.settle_record(info, "v1", 150, ["b", "c"], ["b", "c"])["members"] == ["b", "c"]
    want = {"members": ["b", "c"], "known": ["b", "c", "d"], "previous": []}
    assert all(f.svc.record("v1") == want for f in fakes.values())
    fakes["c"] = _FakeService()  # restarted: its record is gone
    fakes["a"] = _FakeService()  # joined, with the lowest node id
    info["a"] = {"cache_bytes": 100}
    got = records.settle_record(dict(sorted(info.items())), "v1", 150, ["a"], ["a"])["members"]
    assert got == ["a", "b", "c"]  # the old members kept, the joined node added; d stays out
    assert fakes["c"].svc.record("v1")["members"] == ["a", "b", "c"]


def test_settling_asks_every_service_at_once_and_again_a_restarting_one(monkeypatch):
    """The records are asked for all at once (every request out before any answer is awaited);
    a service that is restarting when asked is asked again and its record still counts."""
    pytest.importorskip("ray")
    from stoker.cluster.service import records

    fakes = {n: _FakeService() for n in ["a", "b", "c"]}
    for f in fakes.values():
        f.svc.claim("v1", ["a", "c"], ["a", "b", "c"])
    fakes["b"].svc.widen("v1", ["a", "b", "c"], ["a", "b", "c"])  # only b knows b is a member
    events = []

    class Ref:
        def __init__(self, node, fails):
            self.node, self.fails = node, fails

    class Asking:
        def __init__(self, node):
            self.node = node
            self.record = type("M", (), {"remote": staticmethod(self._record)})
            self.widen = fakes[node].widen

        def _record(self, version):
            events.append(("ask", self.node))
            return Ref(self.node, fails=self.node == "b" and ("ask", "b") not in events[:-1])

    def get(ref, **kw):
        if not isinstance(ref, Ref):
            return ref
        events.append(("get", ref.node))
        if ref.fails:
            raise records.ray.exceptions.ActorUnavailableError("restarting", None)
        return fakes[ref.node].svc.record("v1")

    monkeypatch.setattr(records, "get_service", Asking)
    monkeypatch.setattr(records.ray, "get", get)
    monkeypatch.setattr(records, "RETRY_PAUSE_S", 0.0)
    info = {n: {"cache_bytes": 100} for n in ["a", "b", "c"]}
    got = records.settle_record(info, "v1", 150, ["a"], ["a"])["members"]
    assert events[:3] == [("ask", "a"), ("ask", "b"), ("ask", "c")]  # every request out first
    assert got == ["a", "b", "c"]  # b's record counted although b was restarting when first asked
