"""Cluster mode on a 3-node ray.cluster_utils.Cluster (each node its own raylet and object store)."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from stoker.cluster import placement  # noqa: E402

BLOCK = 64 << 10  # small cache blocks: the 120-photo test set gives ~100 blocks to place


@pytest.fixture(scope="module")
def cluster():
    """Three simulated nodes (custom resources node0..node2, 150 MB object store each)."""
    from ray.cluster_utils import Cluster
    import ray.cloudpickle
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # train functions of this module
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node0": 1},
                                                     "object_store_memory": 150 << 20})
    for i in (1, 2):
        c.add_node(num_cpus=2, resources={f"node{i}": 1}, object_store_memory=150 << 20)
    ray.init(address=c.address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def s3_dataset(s3_origin, sample_tree):
    """The 120-photo sample tree packed into the emulated S3 origin: (url, storage options)."""
    from stoker.bench.origin import upload_tree
    from stoker.store.pack import pack
    opts = s3_origin.storage_options()
    upload_tree(str(sample_tree / "train"), s3_origin.url("cluster/raw"), opts)
    url = s3_origin.url("cluster/packed")
    pack(s3_origin.url("cluster/raw"), url, src_options=opts, dst_options=opts, shard_bytes=1 << 20, progress=False)
    return url, opts


def _node_ids():
    from stoker.cluster.service import alive_nodes
    return [n["NodeID"] for n in alive_nodes()]


def test_warm_places_blocks_by_budget_and_reads_origin_once(cluster, s3_dataset, tmp_path_factory):
    from stoker.cluster import warm
    url, opts = s3_dataset
    root = str(tmp_path_factory.mktemp("cache"))
    r = warm(url, opts, cache_root=root, cache_bytes=64 << 20, block_bytes=BLOCK, progress=False)
    assert set(r["nodes"]) == set(_node_ids())
    assert r["cached_fraction"] == 1.0
    assert r["origin_bytes"] == r["dataset_bytes"]
    assert all(n["cached_fraction"] == 1.0 and n["owned_bytes"] > 0 for n in r["nodes"].values())
    again = warm(url, opts, block_bytes=BLOCK, progress=False)  # the services keep their caches
    assert again["origin_bytes"] == 0 and again["cached_fraction"] == 1.0
