"""``stoker warm URL``: fill the cluster cache with a dataset, all nodes in parallel (Fluid's DataLoad).

Each node's cache service fills the blocks placed on its node, straight from the origin (a block
is read from the origin once); the driver only sends block lists and shows progress. A fault
(an origin error after its retries, a checksum mismatch, a service that dies) costs only the
blocks it hits: the rest is filled, and the report says what is cached and which shards failed
and why. A node's cache directory and placement are stable across Ray restarts on the same host
(:mod:`stoker.cluster.identity`), so running the warm-up again fetches only what is missing.
"""
from __future__ import annotations

import time

import numpy as np
import ray

from .placement import bytes_per_node, place_dataset
from .records import RETRY_PAUSE_S, SERVICE_TRIES, settle_members
from .records import call as _call
from .service import dataset_ref, find_services, get_service, placement_keys, prepare

#: Tries of one chunk of blocks whose fill met a dead or restarting cache service, and the pause
#: before each retry (seconds, times the try number): the same as for any call to a service.
FILL_TRIES = SERVICE_TRIES


def warm(url: str, storage_options: dict | None = None, *, cache_root: str | None = None,
         cache_bytes: int | None = None, block_bytes: int | None = None, chunk_blocks: int = 16, concurrency: int = 8,
         progress: bool = False, detached: bool = True) -> dict:
    """Fill every node cache with the blocks of ``url`` placed on it; returns a report.

    Services are started where missing (``cache_root``/``cache_bytes`` as in
    :func:`stoker.cluster.run`). The dataset's placement members are the recorded ones (see
    ``run``), else every node with a service. ``chunk_blocks`` blocks per request,
    ``concurrency`` ranged GETs per node. Report: ``{url, version, dataset_bytes, seconds,
    origin_bytes, cached_fraction, complete, failed_shards, nodes: {node id: {node_name, cache_dir,
    cache_bytes, owned_bytes, cached_bytes, cached_fraction, filled, refused, failed,
    failed_shards}}}`` (bytes; ``cached_fraction`` = cached / owned, 1.0 when the node owns
    nothing; ``filled``/``refused``/``failed``: blocks; ``failed_shards``: ``{shard name: reason}``;
    ``complete``: every block cached; a node's ``error``: why its service did not answer at the end, else None). A block a node's budget refuses stays uncached; a block
    that fails is reported and the others go on, so the report may be partial: nothing is raised
    for it. A chunk whose fill meets a dead or restarting service is sent again (``FILL_TRIES``
    in all, ``RETRY_PAUSE_S`` apart, growing) before its blocks count as failed. Needs ``ray.init()`` first; raises what :func:`stoker.cluster.service.prepare` raises
    (no service, no index at ``url``). ``progress``: a tqdm bar on stderr (bytes placed, rate,
    ETA); off by default, so a library call prints nothing (``stoker warm`` shows it on a terminal).
    """
    opts = dict(storage_options or {})
    t0 = time.perf_counter()
    services, ds, dref = prepare(url, opts, cache_root, cache_bytes, block_bytes, detached)
    nodes = list(services)
    recorded = settle_members(services, ds.version, int(ds.index.total_bytes), nodes, [])
    members = [m for m in recorded if m in services] or nodes
    owner = place_dataset(ds, placement_keys(services, members), [services[m]["cache_bytes"] for m in members])
    owned = bytes_per_node(ds, owner, len(members))
    sizes = ds.block_bytes_of(np.arange(ds.num_blocks))
    queues = {i: [np.flatnonzero(owner == i)[k:k + chunk_blocks].tolist()
                  for k in range(0, int((owner == i).sum()), chunk_blocks)] for i in range(len(members))}
    totals = {i: {"filled": 0, "refused": 0, "failed": 0, "origin_bytes": 0} for i in range(len(members))}
    errors: dict[int, dict[str, str]] = {i: {} for i in range(len(members))}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=int(sizes.sum()), unit="B", unit_scale=True, desc=f"warm {url}")
    pending: dict = {}

    tries: dict[tuple, int] = {}

    def submit(i):
        if queues[i]:
            chunk = queues[i].pop(0)
            ref = get_service(members[i]).fill.remote(dref, chunk, concurrency)
            pending[ref] = (i, chunk)

    for i in queues:  # two requests in flight per node: one filling, one queued behind it
        submit(i)
        submit(i)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        i, chunk = pending.pop(done[0])
        try:
            r = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:  # the service died or is restarting: try again
            k = tries[tuple(chunk)] = tries.get(tuple(chunk), 1) + 1
            if k <= FILL_TRIES:
                time.sleep(RETRY_PAUSE_S * (k - 1))
                queues[i].insert(0, chunk)
                submit(i)
                continue
            r = {"failed": len(chunk), "errors": {ds.index.shard_name(ds.block_shard[b]): _reason(exc)
                                                   for b in chunk}}
        except ray.exceptions.RayError as exc:  # the call failed: these blocks only
            r = {"failed": len(chunk), "errors": {ds.index.shard_name(ds.block_shard[b]): _reason(exc)
                                                   for b in chunk}}
        for k in totals[i]:
            totals[i][k] += r.get(k, 0)
        for shard, reason in r.get("errors", {}).items():
            errors[i].setdefault(shard, reason)
        if bar is not None:
            bar.update(int(sizes[chunk].sum()))
        submit(i)
    if bar is not None:
        bar.close()
    cached, node_errors = [], {}
    for i, m in enumerate(members):
        try:
            cached.append(int(_call(get_service(m).cached_bytes, dref)))
        except (ray.exceptions.RayError, ValueError) as exc:  # gone: nothing of it counts as cached
            cached.append(0)
            node_errors[i] = f"cache service did not answer: {_reason(exc)}"
    report = {"url": url, "version": ds.version, "dataset_bytes": int(sizes.sum()),
              "seconds": time.perf_counter() - t0,
              "origin_bytes": int(sum(t["origin_bytes"] for t in totals.values())),
              "cached_fraction": float(sum(cached) / sizes.sum()) if sizes.sum() else 1.0,
              "complete": bool(sum(cached) >= sizes.sum()),
              "failed_shards": {sh: why for e in errors.values() for sh, why in e.items()}, "nodes": {}}
    for i, m in enumerate(members):
        report["nodes"][m] = {"node_name": services[m]["node_name"], "cache_dir": services[m].get("cache_dir"),
                              "cache_bytes": services[m]["cache_bytes"],
                              "owned_bytes": int(owned[i]), "cached_bytes": int(cached[i]),
                              "cached_fraction": float(cached[i] / owned[i]) if owned[i] else 1.0,
                              "filled": totals[i]["filled"], "refused": totals[i]["refused"],
                              "failed": totals[i]["failed"], "failed_shards": dict(sorted(errors[i].items())),
                              "error": node_errors.get(i)}
    return report


def _reason(exc: BaseException) -> str:
    """One line for a failed Ray call: the innermost error's type and message, not Ray's traceback."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"


def cluster_state(urls: list[str], storage_options: dict | None = None, block_bytes: int | None = None,
                  timeout_s: float = 10.0) -> dict:
    """What every node caches of each dataset in ``urls``, in the form :mod:`stoker.cluster.extender`
    reads: ``{"time": Unix seconds, "nodes": {node name: {"cache_bytes": int, "used_bytes": int,
    "datasets": {url: bytes}}}}`` (``time``: when it was gathered, so that a reader can tell how
    old it is). Needs ``ray.init()``; only services that answer within ``timeout_s`` seconds are
    listed."""
    from ..store.dataset import DEFAULT_BLOCK_BYTES, open_dataset
    opts = dict(storage_options or {})
    t = time.time()
    services = find_services(timeout_s)
    out = {"time": t, "nodes": {}}
    refs = {u: dataset_ref(open_dataset(u, storage_options=opts, cache=False, check=False,
                                        block_bytes=block_bytes or DEFAULT_BLOCK_BYTES), opts) for u in urls}
    for nid, info in services.items():
        h = get_service(nid)
        try:
            got = ray.get([h.cached_bytes.remote(refs[u]) for u in urls], timeout=timeout_s)
        except (ray.exceptions.RayError, ValueError) as exc:  # gone since it answered: not listed
            import logging
            logging.getLogger(__name__).warning("cache service on node %s did not answer: %s", nid, exc)
            continue
        out["nodes"][info["node_name"]] = {"node_id": nid, "cache_bytes": info["cache_bytes"],
                                           "used_bytes": info["used_bytes"],
                                           "datasets": {u: int(b) for u, b in zip(urls, got)}}
    return out


def ray_state(urls: list[str], storage_options: dict | None = None, block_bytes: int | None = None,
              ttl_s: float = 10.0, timeout_s: float = 10.0):
    """A state source for :func:`stoker.cluster.extender.serve` that asks the cache services
    (:func:`cluster_state`, each call given ``timeout_s`` seconds) every ``ttl_s`` seconds in a
    background thread (:func:`stoker.cluster.freshness.refreshing`): a request never waits for
    Ray. When the services cannot be reached (the error is logged) it answers with the last state
    it had, whose ``"time"`` then ages until the extender stops trusting it (``max_age_s``)."""
    from .freshness import refreshing
    return refreshing(lambda: cluster_state(urls, storage_options, block_bytes, timeout_s=timeout_s), ttl_s)
