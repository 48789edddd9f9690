"""Ray fixtures of the cluster tests: one 3-node ``ray.cluster_utils.Cluster`` for the whole
session (a Ray start costs seconds), and the sample tree packed into the emulated S3 origin.

Every node of a test cluster is pinned to the loopback address (``node_ip_address``, given to
each node as it starts: :data:`LOOPBACK`; and Ray's own local address is 127.0.0.1 in every
test process: ``LOOPBACK_RAY_ENV`` in tests/conftest.py, which a driver joining
``127.0.0.1:<port>`` needs). Left to itself, Ray takes the address of the route out of the
machine, and on a machine with a second address a test can hang on it."""

from __future__ import annotations

import pytest

#: The node argument that pins a Ray node of a test cluster to the loopback address.
LOOPBACK = {"node_ip_address": "127.0.0.1"}


@pytest.fixture(scope="session")
def ray_cluster():
    """Three simulated nodes (custom resources node0..node2, 2 CPUs, 150 MB object store each,
    all on 127.0.0.1), joined by this process."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node0": 1}, "object_store_memory": 150 << 20, **LOOPBACK},
    )
    for i in (1, 2):
        c.add_node(num_cpus=2, resources={f"node{i}": 1}, object_store_memory=150 << 20, **LOOPBACK)
    ray.init(address=c.address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        _shutdown(ray, c)


def _shutdown(ray, c, wait_s: float = 60.0) -> None:
    """``ray.shutdown()``, then the cluster's processes. Ray 2.60's driver can block for good in
    ``ray.shutdown()`` (its error subscriber's close waits on a GCS call without a deadline: seen
    at the end of a full run, after Ray Train's tests); past ``wait_s`` seconds the cluster is
    shut down under it, which ends that call, so the test session still ends."""
    import threading

    t = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        print(f"ray.shutdown() still blocked after {wait_s:g} s: shutting the test cluster down under it")
    c.shutdown()
    t.join(wait_s)


@pytest.fixture(scope="module")
def cluster(ray_cluster, request):
    """The session's cluster, with the requesting test module's functions (and tests/_helpers.py's)
    sent by value (train functions defined in the tests are not importable on the workers)."""
    import ray.cloudpickle

    import _helpers

    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.cloudpickle.register_pickle_by_value(_helpers)
    yield ray_cluster


@pytest.fixture(scope="session")
def s3_dataset(s3_origin, sample_tree):
    """The 120-photo sample tree packed into the emulated S3 origin: (url, storage options)."""
    from stoker.store.pack import pack
    from stoker_lab.bench.origin import upload_tree

    opts = s3_origin.storage_options()
    upload_tree(str(sample_tree / "train"), s3_origin.url("cluster/raw"), opts)
    url = s3_origin.url("cluster/packed")
    pack(s3_origin.url("cluster/raw"), url, storage_options=opts, shard_bytes=1 << 20, progress=False)
    return url, opts


@pytest.fixture
def fresh_services(cluster):
    """Fresh cache services for the test and none left behind (the next module's first job
    expects empty caches): every running service stopped before and after."""
    from stoker.cluster.service.cache_service import stop_services

    stop_services()
    yield
    stop_services()
