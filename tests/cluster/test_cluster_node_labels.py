"""Warnings and errors of cluster mode name a node as ``stoker cache status`` lists it: by its
cache directory, ``node-<host>-<slot>`` (stoker.cluster.identity.node_label), not by the random
id Ray gives it at each start. No running Ray."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("ray")

from stoker.cluster.capacity import refusal  # noqa: E402
from stoker.cluster.counters import ByteCounters  # noqa: E402
from stoker.cluster.jobs.gang import _node_text  # noqa: E402
from stoker.cluster.service import cache_service  # noqa: E402
from stoker.cluster.service.reader import BlockRouter  # noqa: E402
from stoker.errors import PeerUnavailable  # noqa: E402
from stoker.store.dataset import open_dataset  # noqa: E402

RAY_IDS = ["5f3a9c0d" * 7, "77b0e1aa" * 7]  # what Ray names two nodes: 56 hex digits each


def _info(key: str, budget: int) -> dict:
    return {"cache_key": key, "node_name": None, "cache_bytes": budget}


def test_the_budget_warning_names_the_nodes_cache_directories(packed_local, monkeypatch, caplog):
    # Two running services keep budgets other than the one asked for: the warning lists them by
    # the names `stoker cache status` shows under the cluster cache root. It named Ray's node ids.
    services = {RAY_IDS[0]: _info("node-h1-0", 64 << 20), RAY_IDS[1]: _info("node-h1-1", 64 << 20)}
    for info, nid in zip(services.values(), RAY_IDS, strict=True):
        info["node_name"] = nid  # no $NODE_NAME: the service's node_name is the Ray id
    monkeypatch.setattr(cache_service.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cache_service, "start_services", lambda **kw: None)
    monkeypatch.setattr(cache_service, "find_services", lambda: services)
    monkeypatch.setattr(cache_service, "open_dataset", lambda *a, **kw: open_dataset(packed_local, cache=False))
    cache = cache_service.CacheOptions(cache_dir="/unused", cache_bytes=32 << 20)
    with caplog.at_level(logging.WARNING, logger=cache_service.__name__):
        got, _, _ = cache_service.prepare(packed_local, None, cache, None)
    assert got == services
    assert "keep their budgets" in caplog.text
    assert f"node-h1-0: {64 << 20:,} bytes" in caplog.text and f"node-h1-1: {64 << 20:,} bytes" in caplog.text
    assert not any(nid in caplog.text for nid in RAY_IDS)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_fails_is_named_by_its_cache_directory(packed_local, caplog):
    ds = open_dataset(packed_local, cache=False)
    counters = ByteCounters()
    secret = b"s" * 32
    try:
        router = BlockRouter(
            cache_service.dataset_ref(ds),
            RAY_IDS,
            np.ones(len(ds.blocks), np.int64),
            0,
            counters,
            names=["node-h1-0", "node-h1-1"],
            secret=secret,
        )
        router.endpoints[1] = ("127.0.0.1", _closed_port())  # nobody listens there
        with pytest.raises(PeerUnavailable, match="data endpoint of node-h1-1 at 127.0.0.1:"):
            router.peer_read(1, 0, 0, 4)
        with caplog.at_level(logging.WARNING):
            router._failed("peer", 1, ds, 0, PeerUnavailable("gone"))
        assert "peer node-h1-1 unavailable for block" in caplog.text and RAY_IDS[1] not in caplog.text
        unnamed = BlockRouter(
            cache_service.dataset_ref(ds), RAY_IDS, np.ones(len(ds.blocks), np.int64), 0, counters, secret=secret
        )
        unnamed.endpoints[1] = router.endpoints[1]
        with pytest.raises(PeerUnavailable, match=f"data endpoint of Ray node {RAY_IDS[1]} at"):
            unnamed.peer_read(1, 0, 0, 4)
    finally:
        counters.close()


def test_capacity_refusals_and_failed_ranks_name_nodes_alike():
    names = dict(zip(RAY_IDS, ["node-h1-0", "node-h1-1"], strict=True))
    free = {RAY_IDS[0]: {"CPU": 2.0}, RAY_IDS[1]: {}}
    msg = refusal(3, {"CPU": 2.0}, free, {RAY_IDS[0]: 1, RAY_IDS[1]: 0}, names=names)
    assert "node-h1-0: free {'CPU': 2.0} -> 1 rank(s)" in msg and "node-h1-1: free" in msg
    assert not any(nid in msg for nid in RAY_IDS)
    assert _node_text("node-h1-0") == "node-h1-0"  # "rank 0 on node-h1-0 failed first"
    assert _node_text("Ray node 5f3a") == "Ray node 5f3a"
    assert _node_text("5f3a") == "node 5f3a"  # an id or name a caller of gather() gives


def test_a_cache_dir_the_running_services_do_not_use_is_named_with_theirs(packed_local, monkeypatch, caplog):
    # Running services keep their cluster cache root: a job that asks for another one gets a
    # warning naming both roots, each node by its cache directory, and the way to move them.
    # It was silent: the job read and filled the old root.
    services = {
        RAY_IDS[0]: {**_info("node-h1-0", 64 << 20), "cache_dir": "/disk-a/cluster/node-h1-0"},
        RAY_IDS[1]: {**_info("node-h1-1", 64 << 20), "cache_dir": "/disk-a/cluster/node-h1-1"},
    }
    monkeypatch.setattr(cache_service.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cache_service, "start_services", lambda **kw: None)
    monkeypatch.setattr(cache_service, "find_services", lambda: services)
    monkeypatch.setattr(cache_service, "open_dataset", lambda *a, **kw: open_dataset(packed_local, cache=False))
    with caplog.at_level(logging.WARNING, logger=cache_service.__name__):
        cache_service.prepare(packed_local, None, cache_service.CacheOptions(cache_dir="/disk-a/cluster/"), None)
    mine = [r for r in caplog.records if r.name == cache_service.__name__]
    assert mine == []  # the same root, spelled with a trailing slash: nothing to say
    with caplog.at_level(logging.WARNING, logger=cache_service.__name__):
        cache_service.prepare(packed_local, None, cache_service.CacheOptions(cache_dir="/disk-b/cluster"), None)
    assert "cache_dir='/disk-b/cluster' is not used" in caplog.text
    assert "node-h1-0: /disk-a/cluster" in caplog.text and "node-h1-1: /disk-a/cluster" in caplog.text
    assert "stoker.cluster.service.stop_services()" in caplog.text
    assert "keep their budgets" not in caplog.text  # no budget asked
    assert not any(nid in caplog.text for nid in RAY_IDS)


def test_a_memory_tier_the_running_services_do_not_have_is_named(packed_local, monkeypatch, caplog):
    # A job asking for a memory tier the running services do not keep reads through theirs: the
    # warning names each node and the tier it keeps. It was silent.
    kept = cache_service.CacheOptions(cache_dir="/c/node-h1-0", cache_bytes=64 << 20)
    services = {RAY_IDS[0]: {**_info("node-h1-0", 64 << 20), "cache_dir": "/c/node-h1-0", "cache": kept}}
    monkeypatch.setattr(cache_service.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cache_service, "start_services", lambda **kw: None)
    monkeypatch.setattr(cache_service, "find_services", lambda: services)
    monkeypatch.setattr(cache_service, "open_dataset", lambda *a, **kw: open_dataset(packed_local, cache=False))
    with caplog.at_level(logging.WARNING, logger=cache_service.__name__):
        cache_service.prepare(packed_local, None, cache_service.CacheOptions(cache_dir="/c", memory_bytes="1MiB"), None)
    assert f"memory_bytes={1 << 20!r} applies only to the cache services started now" in caplog.text
    assert "keep their memory tiers (node-h1-0: 0 bytes)" in caplog.text
    assert "is not used" not in caplog.text and "keep their budgets" not in caplog.text
