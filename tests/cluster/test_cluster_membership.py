"""A dataset's placement members follow the cluster and the jobs: a first job on one node does
not fix them for good."""
from __future__ import annotations

from functools import partial

import pytest

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
    from stoker.cluster.service import get_service, stop_services
    from stoker.store.dataset import open_dataset
    url, opts = s3_dataset
    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    budget = int(ds.index.total_bytes) * 6 // 10  # one node holds 60 %, the three of them 180 %
    stop_services()
    common = dict(storage_options=opts, cache_root=str(tmp_path / "cache"), cache_bytes=budget, block_bytes=BLOCK,
                  timeout_s=180)
    try:
        run(partial(read_epochs, epochs=1), url, 1, {"CPU": 0.5}, job="probe", **common)
        e0 = run(partial(read_epochs, epochs=1), url, 3, {"CPU": 0.5}, job="train", **common)
        e1 = run(partial(read_epochs, epochs=1, first_epoch=1), url, 3, {"CPU": 0.5}, job="train", **common)
        from stoker.cluster.service import alive_nodes
        members = ray.get(get_service(alive_nodes()[0]["NodeID"]).claim.remote(ds.version, []))
        assert len(members) >= 2 and budget * len(members) >= ds.index.total_bytes  # grown until it fits
        assert {r["node_id"] for r in e0 + e1} <= set(members) and len({r["node_id"] for r in e1}) >= 2
        assert sum(r["result"][0]["origin_bytes"] for r in e1) == 0  # the cluster holds it all
    finally:
        stop_services()  # the next tests start services of their own budget
