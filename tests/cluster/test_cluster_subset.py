"""A co-located cluster loader over a subset (``ctx.loader(batch, dataset=ctx.dataset.subset(...))``)
serves each of the subset's samples exactly once over the job's ranks, each rank the subset's
samples its node owns first, and refuses a dataset that is not the job's. Built without a Ray
cluster (the plan is a pure function of the job's layout), as in test_cluster_resume.py."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import batch_ids, pack_id_dataset, sample_id

pytest.importorskip("ray")


def _ctx(ds, rank: int, owner, counters):
    from stoker.cluster.jobs.job import WorkerContext

    spec = {
        "rank": rank,
        "world_size": 2,
        "node_id": f"node-{rank}",
        "job": "subset",
        "placement": "colocated",
        "rank_nodes": [0, 1],
        "owner": np.asarray(owner, dtype=np.int64),
        "rank_node_ids": ["node-0", "node-1"],
        "token": "subset",
    }
    counters.size_tags(len(ds.blocks))
    return WorkerContext(spec, ds, counters)


def test_a_cluster_loader_over_a_subset_serves_it_once_colocated(tmp_path):
    from stoker.cluster.counters import ByteCounters
    from stoker.store.dataset import open_dataset

    ds = open_dataset(pack_id_dataset(tmp_path, 48, size=600, shard_bytes=8 << 10), cache=False, block_bytes=1500)
    owner = np.arange(len(ds.blocks)) % 2  # blocks dealt to the two nodes in turn
    sub = ds.split([0.5, 0.5], seed=3)[0]
    served: list[list[int]] = []
    for rank in range(2):
        counters = ByteCounters()
        try:
            ctx = _ctx(ds, rank, owner, counters)
            with ctx.loader(4, dataset=sub, num_workers=0, decode=sample_id, seed=1) as loader:
                served.append([i for b in loader for i in batch_ids(b)])
            node_of = owner[ds.blocks.sample_block[np.asarray(served[-1])]]
            assert (node_of == rank).mean() >= 0.5  # co-located: its node's samples first
            with pytest.raises(ValueError, match="takes ctx.dataset or a subset of it"):
                ctx.loader(4, dataset=open_dataset(ds.url, cache=False), num_workers=0)
        finally:
            counters.close()
    assert len(served[0]) == len(served[1])
    assert sorted(served[0] + served[1]) == sub.selection.tolist()
