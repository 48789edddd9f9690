"""No Ray object carries block bytes anywhere in ``src/stoker/cluster``: Ray is the control plane,
block bytes travel over the cache services' data endpoints.

Measured on the session's 3-node test cluster: a peer-heavy job (one rank, its dataset spread
over the three node caches, so about two thirds of what it reads lives on other nodes) receives
megabytes from its peers, and every Ray object its process received meanwhile comes to a small
fraction of that.

The measure is taken where block bytes sent as Ray objects would arrive: every object the rank's
process deserializes (``ray.get``, actor call results) goes through its Ray worker's
``deserialize_objects``, which the train function wraps for the epochs and counts the bytes of
(data buffers, whether they came inline, under Ray's 100 KiB limit, or from the node's object
store). A control in the same process shows the count sees a block returned by a Ray call. The
object stores' own cumulative counter (``cumulative_created_bytes`` of ``ray memory --stats-only``)
is read over the raylets' gRPC, which needs the ``grpcio`` package that the ``cluster`` extra's
Ray does not install; the free ``object_store_memory`` of ``ray.available_resources()`` is the
store's use *now*, refreshed every few hundred milliseconds, which an object freed right after
its ``ray.get`` never shows, and objects under 100 KiB never reach a store at all.

A static guard beside it: no code in ``src/stoker/cluster`` calls, through Ray, a method of the
cache service that returns or sends block bytes."""

from __future__ import annotations

import ast
import inspect
import pathlib
from functools import partial

import pytest

from stoker.cluster import ClusterOptions

ray = pytest.importorskip("ray")

BLOCK = 64 << 10
CLUSTER_SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "stoker" / "cluster"
#: The cache service's methods that return or send block bytes (for its data endpoint and tests).
BYTE_METHODS = {"read", "read_cached", "serve", "serve_hit", "open"}


@ray.remote(num_cpus=0)
def _a_block_as_a_ray_object(url: str, opts: dict, b: int) -> bytes:
    """What the data plane replaced: a block's bytes returned by a Ray call."""
    from stoker.store.dataset import open_dataset

    ds = open_dataset(url, storage_options=opts, cache=False, check=False, block_bytes=BLOCK)
    start, end = int(ds.blocks.start[b]), int(ds.blocks.end[b])
    return bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, end))


def _epochs_counting_ray_bytes(ctx, url: str, opts: dict, epochs: int) -> dict:
    """A rank's train function: ``epochs`` epochs of :func:`stoker.cluster.read_epochs` while the
    bytes of every Ray object this process deserializes are counted (``ray_bytes``), then the
    control: one block returned by a Ray call from another node (``control_bytes`` counted of
    ``control_size``)."""
    import numpy as np
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stoker.cluster import read_epochs

    worker = ray._private.worker.global_worker
    real = worker.deserialize_objects
    seen = [0]

    def counted(serialized, refs, *args, **kwargs):
        seen[0] += sum(len(o[0]) for o in serialized if o[0] is not None)
        return real(serialized, refs, *args, **kwargs)

    worker.deserialize_objects = counted  # this process only; taken off below (Ray reuses it)
    try:
        records = read_epochs(ctx, epochs)
        during = seen[0]
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != ctx.node_id)
        b = int(np.argmax(ctx.dataset.blocks.end - ctx.dataset.blocks.start))
        on = NodeAffinitySchedulingStrategy(other, soft=False)
        block = ray.get(_a_block_as_a_ray_object.options(scheduling_strategy=on).remote(url, opts, b), timeout=60)
        control = seen[0] - during
    finally:
        del worker.deserialize_objects
    return {"epochs": records, "ray_bytes": during, "control_bytes": control, "control_size": len(block)}


def test_a_peer_heavy_epoch_moves_no_block_bytes_as_ray_objects(cluster, s3_dataset, tmp_path, fresh_services):
    from stoker.cluster import run
    from stoker.cluster.service.warmup import warm

    url, opts = s3_dataset
    where = dict(storage_options=opts, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, block_bytes=BLOCK)
    assert warm(url, progress=False, **where)["complete"]  # every block cached on its owner
    out = run(
        partial(_epochs_counting_ray_bytes, url=url, opts=opts, epochs=2),
        url,
        1,
        {"CPU": 0.5},
        cluster=ClusterOptions(job="peer-heavy", timeout_s=180),
        **where,
    )
    got = out[0]["result"]
    epochs = got["epochs"]
    received = sum(e["received_peer_bytes"] for e in epochs)
    assert sum(e["peer_bytes"] for e in epochs) >= 0.4 * sum(e["read_bytes"] for e in epochs)  # peer-heavy
    assert received >= 4 << 20 and sum(e["fallbacks"] for e in epochs) == 0
    assert got["control_bytes"] >= got["control_size"] > 0  # the count sees a block sent through Ray
    assert got["ray_bytes"] < 0.02 * received, (got["ray_bytes"], received)  # control messages only


def _remote_calls(root: pathlib.Path) -> dict[str, list[str]]:
    """``{method name: [file:line, ...]}`` of every ``<handle>.<method>.remote(...)`` under ``root``."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "remote"
                and isinstance(node.func.value, ast.Attribute)
            ):
                found.setdefault(node.func.value.attr, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_cache_service_method_that_returns_block_bytes_is_called_through_ray():
    """The byte-returning methods stay the data endpoint's (:class:`Handler`) and the tests'; what
    the cluster's code asks services through Ray is control only (membership, placement, fills,
    leases, where the endpoint listens). A method added to that list that returns block bytes
    must not be called through Ray: serve it on the data endpoint."""
    from stoker.cluster.service.cache_service import CacheService

    methods = {name for name, _ in inspect.getmembers(CacheService, inspect.isfunction) if not name.startswith("_")}
    assert BYTE_METHODS <= methods  # the guard names real methods
    called = {m: where for m, where in _remote_calls(CLUSTER_SRC).items() if m in methods}
    assert "endpoint" in called and "fill" in called  # the scan finds the control calls
    assert {m: called[m] for m in BYTE_METHODS & set(called)} == {}
