"""``stoker warm URL``: fill the cluster cache with a dataset, all nodes in parallel (Fluid's DataLoad).

Each node's cache service fills the blocks placed on its node, straight from the origin (a block
is read from the origin once); the driver only sends block lists and shows progress.
"""
from __future__ import annotations

import time

import numpy as np
import ray

from .placement import bytes_per_node, place_dataset
from .service import dataset_ref, find_services, get_service, prepare


def warm(url: str, storage_options: dict | None = None, *, cache_root: str | None = None,
         cache_bytes: int | None = None, block_bytes: int | None = None, chunk_blocks: int = 16, concurrency: int = 8,
         progress: bool = True, detached: bool = False) -> dict:
    """Fill every node cache with the blocks of ``url`` placed on it; returns a report.

    Services are started where missing (``cache_root``/``cache_bytes`` as in
    :func:`stoker.cluster.run`). The dataset's placement members are the recorded ones (see
    ``run``), else every node with a service. ``chunk_blocks`` blocks per request,
    ``concurrency`` ranged GETs per node. Report: ``{url, version, dataset_bytes, seconds,
    origin_bytes, cached_fraction, nodes: {node id: {node_name, cache_bytes, owned_bytes,
    cached_bytes, cached_fraction, filled, refused}}}`` (bytes; ``cached_fraction`` = cached /
    owned, 1.0 when the node owns nothing). A block a node's budget refuses stays uncached.
    Needs ``ray.init()`` first.
    """
    opts = dict(storage_options or {})
    t0 = time.perf_counter()
    services, ds, dref = prepare(url, opts, cache_root, cache_bytes, block_bytes, detached)
    nodes = list(services)
    recorded = ray.get(get_service(nodes[0]).claim.remote(ds.version, nodes))
    members = [m for m in recorded if m in services] or nodes
    owner = place_dataset(ds, members, [services[m]["cache_bytes"] for m in members])
    owned = bytes_per_node(ds, owner, len(members))
    sizes = ds.block_bytes_of(np.arange(ds.num_blocks))
    queues = {i: [np.flatnonzero(owner == i)[k:k + chunk_blocks].tolist()
                  for k in range(0, int((owner == i).sum()), chunk_blocks)] for i in range(len(members))}
    totals = {i: {"filled": 0, "refused": 0, "origin_bytes": 0} for i in range(len(members))}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=int(sizes.sum()), unit="B", unit_scale=True, desc=f"warm {url}")
    pending: dict = {}

    def submit(i):
        if queues[i]:
            chunk = queues[i].pop(0)
            ref = get_service(members[i]).fill.remote(dref, chunk, concurrency)
            pending[ref] = (i, int(sizes[chunk].sum()))

    for i in queues:  # two requests in flight per node: one filling, one queued behind it
        submit(i)
        submit(i)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        i, nbytes = pending.pop(done[0])
        r = ray.get(done[0])
        for k in totals[i]:
            totals[i][k] += r.get(k, 0)
        if bar is not None:
            bar.update(nbytes)
        submit(i)
    if bar is not None:
        bar.close()
    cached = ray.get([get_service(m).cached_bytes.remote(dref) for m in members])
    report = {"url": url, "version": ds.version, "dataset_bytes": int(sizes.sum()),
              "seconds": time.perf_counter() - t0,
              "origin_bytes": int(sum(t["origin_bytes"] for t in totals.values())),
              "cached_fraction": float(sum(cached) / sizes.sum()) if sizes.sum() else 1.0, "nodes": {}}
    for i, m in enumerate(members):
        report["nodes"][m] = {"node_name": services[m]["node_name"], "cache_bytes": services[m]["cache_bytes"],
                              "owned_bytes": int(owned[i]), "cached_bytes": int(cached[i]),
                              "cached_fraction": float(cached[i] / owned[i]) if owned[i] else 1.0,
                              "filled": totals[i]["filled"], "refused": totals[i]["refused"]}
    return report


def cluster_state(urls: list[str], storage_options: dict | None = None, block_bytes: int | None = None) -> dict:
    """What every node caches of each dataset in ``urls``, in the form :mod:`stoker.cluster.extender`
    reads: ``{"nodes": {node name: {"cache_bytes": int, "used_bytes": int, "datasets": {url: bytes}}}}``.
    Needs ``ray.init()``; only services that answer are listed."""
    from ..store.dataset import DEFAULT_BLOCK_BYTES, open_dataset
    opts = dict(storage_options or {})
    services = find_services()
    out = {"nodes": {}}
    refs = {u: dataset_ref(open_dataset(u, storage_options=opts, cache=False, check=False,
                                        block_bytes=block_bytes or DEFAULT_BLOCK_BYTES), opts) for u in urls}
    for nid, info in services.items():
        h = get_service(nid)
        got = ray.get([h.cached_bytes.remote(refs[u]) for u in urls])
        out["nodes"][info["node_name"]] = {"node_id": nid, "cache_bytes": info["cache_bytes"],
                                           "used_bytes": info["used_bytes"],
                                           "datasets": {u: int(b) for u, b in zip(urls, got)}}
    return out


def ray_state(urls: list[str], storage_options: dict | None = None, block_bytes: int | None = None,
              ttl_s: float = 10.0):
    """A state source for :func:`stoker.cluster.extender.serve` that asks the cache services
    (:func:`cluster_state`) at most every ``ttl_s`` seconds; between refreshes, and when the
    services cannot be reached (the error is logged), it answers with the last state it had."""
    import logging
    import threading
    box = {"t": -float("inf"), "state": {"nodes": {}}}
    lock = threading.Lock()

    def get() -> dict:
        with lock:
            if time.monotonic() - box["t"] >= ttl_s:
                try:
                    box["state"] = cluster_state(urls, storage_options, block_bytes)
                except Exception as exc:  # noqa: BLE001 - keep serving the last state
                    logging.getLogger(__name__).warning("cache state from Ray failed: %s", exc)
                box["t"] = time.monotonic()
            return box["state"]
    return get
