"""A rank reaches its peers before its first read (``BlockRouter.connect``): every owning peer's
service is asked where its data endpoint listens and the endpoint answers a ping, and a peer that
cannot be reached is suspect from the start, so its blocks come from the origin without a stall
on the read path."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.cluster import ClusterOptions

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("fresh_services")


def _handles_at_start(ctx):
    router = ctx.dataset.reader.router
    return {
        "endpoints": sorted(router.endpoints),
        "owners": sorted({int(o) for o in np.unique(router.owner)}),
        "me": router.me,
        "suspects": router.suspects(),
    }


def test_every_owning_peer_is_reached_before_the_first_read(cluster, s3_dataset, tmp_path_factory):
    from stoker.cluster import run

    url, opts = s3_dataset
    res = run(
        _handles_at_start,
        url,
        3,
        {"CPU": 0.5},
        storage_options=opts,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        cache_bytes=64 << 20,
        block_bytes=64 << 10,
        cluster=ClusterOptions(placement="random", seed=5, job="connect", timeout_s=120),
    )
    for r in res:
        got = r["result"]
        assert got["suspects"] == []
        assert got["endpoints"] == [o for o in got["owners"] if o != got["me"]]
        assert len(got["owners"]) > 1


def test_a_peer_without_a_service_is_suspect_from_the_start(cluster):
    from stoker.cluster.counters import ByteCounters
    from stoker.cluster.service.cache_service import alive_nodes
    from stoker.cluster.service.reader import BlockRouter

    real = alive_nodes()[0]["NodeID"]
    missing = "f" * len(real)  # no such node: no service to find
    counters = ByteCounters()
    try:
        router = BlockRouter(
            {"url": "file:///nowhere"}, [real, missing], np.array([0, 1, 1]), 0, counters, timeout_s=5.0, retry_s=0.2
        )
        assert router.connect() == [missing]
        assert router.suspects() == [missing]
        with pytest.raises(Exception, match="last read failed"):
            router.peer_read(1, 1, 0, 10)  # read path: no call, no stall
    finally:
        counters.close()
