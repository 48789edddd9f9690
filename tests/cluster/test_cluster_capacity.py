"""Co-location is a preference, capacity a limit: ranks never wait pinned behind each other on a
node that cannot run them all; a job that does not fit is refused at once, saying why."""

from __future__ import annotations

import os
import time
from functools import partial

import pytest

from stoker.cluster import ClusterOptions
from stoker.cluster.capacity import rank_request, rank_slots, refusal
from stoker.errors import CapacityError

BLOCK = 64 << 10


def test_rank_slots_count_what_the_free_resources_hold():
    assert rank_slots({"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}) == 2
    assert rank_slots({"CPU": 2.0, "GPU": 1.0}, {"CPU": 0.5, "GPU": 0.5}) == 2
    assert rank_slots({"CPU": 1.9}, {"CPU": 2.0}) == 0
    assert rank_slots({"CPU": 8.0}, {"GPU": 1.0}) == 0  # a resource the node lacks
    assert rank_slots({"CPU": 0.3}, {"CPU": 0.1}) == 3  # no float rounding loss
    assert rank_slots({}, rank_request({"CPU": 0})) > 1000  # asks for nothing: no limit
    assert rank_request(None) == {"CPU": 1.0}
    with pytest.raises(ValueError, match="'GPU'"):
        rank_request({"GPU": -1})
    msg = refusal(3, {"CPU": 2.0}, {"a": {"CPU": 2.0}, "b": {}}, {"a": 1, "b": 0})
    assert "3 ranks" in msg and "node a: free {'CPU': 2.0} -> 1 rank(s)" in msg and "node b" in msg


def _barrier(ctx, bdir: str, wait_s: float = 30.0):
    """Each rank waits (at most ``wait_s``) for every rank to start, as DDP's init does."""
    open(os.path.join(bdir, f"rank{ctx.rank}"), "w").close()
    deadline = time.monotonic() + wait_s
    while len(os.listdir(bdir)) < ctx.world_size:
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.05)
    return "ok"


def test_ranks_that_do_not_fit_on_the_data_node_start_together_elsewhere(cluster, s3_dataset, tmp_path):
    """The data is cached on one 2-CPU node; 3 ranks of {"CPU": 2} go one per node and meet at a
    start barrier (pinned to the data node they ran one after another and the barrier timed out);
    4 such ranks are refused at once, naming the request and every node's free CPUs."""
    from stoker.cluster import read_epochs, run
    from stoker.cluster.service.cache_service import stop_services

    url, opts = s3_dataset
    stop_services()  # fresh services on a fresh cache root: the data goes to the first job's node only
    common = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    try:
        first = run(
            partial(read_epochs, epochs=1),
            url,
            1,
            {"CPU": 1},
            cluster=ClusterOptions(job="first", timeout_s=180),
            **common,
        )
        assert first[0]["result"][0]["origin_bytes"] > 0
        bdir = tmp_path / "barrier"
        bdir.mkdir()
        res = run(
            partial(_barrier, bdir=str(bdir)),
            url,
            3,
            {"CPU": 2},
            cluster=ClusterOptions(job="ddp", timeout_s=180),
            **common,
        )
        assert [r["result"] for r in res] == ["ok"] * 3
        assert len({r["node_id"] for r in res}) == 3
        (tmp_path / "none").mkdir()
        # each node named as `stoker cache status` lists its cache: node-<host>-<slot>
        with pytest.raises(
            CapacityError, match=r"4 ranks asking for \{'CPU': 2\.0\}.*node-\S+-0: total .*-> 1 rank"
        ) as ei:
            run(
                partial(_barrier, bdir=str(tmp_path / "none")),
                url,
                4,
                {"CPU": 2},
                cluster=ClusterOptions(job="big", timeout_s=180),
                **common,
            )
        assert "total" in str(ei.value)  # refused from the totals: no wait for room that never comes
        assert os.listdir(tmp_path / "none") == []  # nothing started
    finally:
        stop_services()
