"""A job's registration on the node caches ends with the job: ranks end theirs when they finish
(their pooled Ray workers live on), a cache service holds a lease that runs out."""

from __future__ import annotations

import time
from functools import partial

import pytest

from stoker.cluster import ClusterOptions

BLOCK = 64 << 10


def test_a_leased_registration_counts_until_it_expires(tmp_path, monkeypatch):
    import stoker.cache.policy as policy

    jobs = policy.JobRegistry(str(tmp_path))
    jobs.register("v1", 1000, lease_s=30)
    jobs.register("v2", 500)  # no lease: while this process lives
    assert set(jobs.live()) == {"v1", "v2"}
    now = time.time()
    monkeypatch.setattr(policy.time, "time", lambda: now + 31)
    assert set(jobs.live()) == {"v2"}
    assert jobs.remove_dead() == 1 and set(jobs.live()) == {"v2"}


def test_a_finished_cluster_job_holds_no_registration(cluster, s3_dataset, tmp_path):
    """After a job, no node cache counts its dataset as read: the ranks (pooled Ray workers,
    still alive) ended their registrations, and the services ended theirs when the job's run()
    returned, long before their lease (the default, 30 s) would have run out."""
    pytest.importorskip("ray")
    from stoker.cache.policy import JobRegistry
    from stoker.cluster import read_epochs, run
    from stoker.cluster.service.cache_service import find_services, start_services, stop_services
    from stoker.store.dataset import open_dataset

    url, opts = s3_dataset
    version = open_dataset(url, storage_options=opts, cache=False, check=False).version
    stop_services()
    root = str(tmp_path / "cache")
    start_services(root, 64 << 20)  # the default lease: the end must not wait for it
    res = run(
        partial(read_epochs, epochs=2, keep_ids=True),
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=root,
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        cluster=ClusterOptions(placement="random", seed=2, job="X", timeout_s=180),
    )
    assert sum(r["result"][0]["peer_bytes"] + r["result"][0]["peer_origin_bytes"] for r in res) > 0
    lengths = open_dataset(url, storage_options=opts, cache=False, check=False).index.length
    for r in res:  # random placement, 3 nodes: every byte a rank read counted once, cold and warm
        for e in r["result"]:
            read = int(lengths[e["ids"]].sum())
            assert e["local_bytes"] + e["peer_bytes"] + e["origin_bytes"] == read, (r["rank"], e["epoch"], read)
    assert sum(e["peer_bytes"] for r in res for e in r["result"][1:]) > 0  # warm: peers serve
    dirs = [info["cache_dir"] for info in find_services().values()]
    assert [version in JobRegistry(d).live() for d in dirs] == [False] * len(dirs)
