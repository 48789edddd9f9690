"""The Ray driver of ``stoker bench cluster --netns``; it runs inside the first host namespace.

``python -m stoker.bench.netcluster_driver SPEC OUT`` reads the spec (JSON, written by
:func:`stoker.bench.netcluster_bench.run`), joins the Ray cluster of the namespaces, packs the
dataset into the origin, runs every placement and writes the report rows (JSON) to OUT.

Placements, each on empty caches, epochs ``0 .. epochs-1``, the two jobs one after the other so
that the kernel counters of each job are its own (3 ranks per job):

- ``direct``: rank ``r`` on host ``r`` reads the origin through its own node cache (a plain
  :func:`stoker.open_dataset` per host, no cluster service): the "remote storage" baseline of TDCS;
- ``random``: cluster mode, ranks on random hosts (seeded), the plain rank split (Alluxio-like);
- ``colocated``: cluster mode with TDCS co-located scheduling.

A rank reads and verifies every sample of its plan (checksums; no decode unless ``decode``).
Each row: samples/s (samples / the slowest rank's seconds), exactly-once (every sample id of the
epoch read once over the job's ranks), kernel bytes (:func:`stoker.bench.netcluster.kernel_delta`
of the counters read just before and after the job) and stoker's own byte counts.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from functools import partial

import numpy as np

from .netcluster import kernel_delta, read_counters

PLACEMENTS = ("direct", "random", "colocated")
JOBS = ("job1", "job2")


def _decode(data: bytes, key: str) -> None:
    from ..decode.image import decode_image
    decode_image(data, key)


def read_plan(ctx, epoch: int, decode: bool = False) -> list[dict]:
    """Cluster ``train_fn``: read (and verify, and with ``decode`` decode) every sample of the
    rank's plan for ``epoch``; returns ``ctx.epochs`` with the sample ids under ``ids``."""
    ids = ctx.plan(epoch, 0)
    with ctx.measure(epoch, samples=len(ids)) as rec:
        for i in ids:
            data = ctx.dataset.read(int(i))
            if decode:
                _decode(data, ctx.dataset.key(int(i)))
        rec["ids"] = ids.tolist()
    return ctx.epochs


def direct_rank(spec: dict) -> dict:
    """One rank of the ``direct`` placement: the dataset through this host's own node cache
    (``spec["cache_dir"]``), no peers. Returns ``{epoch, samples, seconds, ids, local_bytes,
    peer_bytes (0), origin_bytes}`` (origin bytes: what this process's origin client received)."""
    from ..order import permutation, rank_plan
    from ..store.dataset import open_dataset
    ds = open_dataset(spec["url"], spec["cache_dir"], spec["cache_bytes"], storage_options=spec["storage_options"],
                      block_bytes=spec["block_bytes"], check=False)
    perm = permutation(len(ds), 0, spec["epoch"], "blockwise", groups=ds.sample_block, window=16)
    ids = rank_plan(perm, spec["rank"], spec["world_size"])
    origin0, local = ds.origin.counters.bytes, 0
    t0 = time.perf_counter()
    for i in ids:
        hits = ds.read_stats.cache_hits
        data = ds.read(int(i))
        if ds.read_stats.cache_hits > hits:
            local += len(data)
        if spec["decode"]:
            _decode(data, ds.key(int(i)))
    return {"epoch": spec["epoch"], "samples": len(ids), "seconds": time.perf_counter() - t0, "ids": ids.tolist(),
            "local_bytes": local, "peer_bytes": 0, "origin_bytes": ds.origin.counters.bytes - origin0}


def _service_origin(service) -> int:
    """Run inside a cache service actor (``__ray_call__``): bytes its origin clients received."""
    return int(sum(ds.origin.counters.bytes for ds in service._datasets.values()))


def services_origin_bytes() -> int:
    """Bytes the cache services of all live nodes received from the origin so far (block fills
    for their peers and for ``stoker warm``); 0 for a node without a service."""
    import ray

    from ..cluster.service import alive_nodes, get_service
    refs = []
    for node in alive_nodes():
        try:
            refs.append(get_service(node["NodeID"]).__ray_call__.remote(_service_origin))
        except ValueError:
            continue
    return int(sum(ray.get(refs, timeout=60)))


def cluster_counts(recs: list[dict], service_origin_bytes: int) -> list[dict]:
    """Per rank record of cluster mode, the bytes by the link they crossed: ``origin_bytes``:
    what the rank read from the origin itself (``origin - peer_origin`` of its counters) plus, on
    the first record, ``service_origin_bytes`` (what the services fetched: whole blocks, where the
    rank counts only the range it asked for); ``peer_bytes``: everything a peer sent
    (``peer + peer_origin``); ``local_bytes`` as counted."""
    out = []
    for k, r in enumerate(recs):
        own = r["origin_bytes"] - r["peer_origin_bytes"]
        out.append(dict(r, origin_bytes=own + (service_origin_bytes if k == 0 else 0),
                        peer_bytes=r["peer_bytes"] + r["peer_origin_bytes"]))
    return out


def _row(placement, job, epoch, recs, n, kernel, served) -> dict:
    ids = np.concatenate([np.asarray(r["ids"], dtype=np.int64) for r in recs])
    seconds = max(r["seconds"] for r in recs)
    samples = sum(r["samples"] for r in recs)
    stoker = {k: int(sum(r[k] for r in recs)) for k in ("local_bytes", "peer_bytes", "origin_bytes")}
    return {"placement": placement, "job": job, "epoch": epoch, "ranks": len(recs), "samples": samples,
            "seconds": seconds, "samples_per_s": samples / seconds if seconds else 0.0,
            "exactly_once": bool(len(ids) == n and np.array_equal(np.sort(ids), np.arange(n))),
            "kernel": kernel, "stoker": stoker, "origin_served_bytes": served}


def main(spec_path: str, out_path: str) -> int:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..cluster.job import run as cluster_run
    from ..cluster.service import stop_services
    from ..store.dataset import open_dataset
    from ..store.pack import pack
    from .origin import upload_tree

    with open(spec_path) as f:
        spec = json.load(f)
    opts = {"endpoint_url": spec["endpoint_url"], "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}
    ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False)
    t0 = time.perf_counter()
    upload_tree(spec["data_dir"], "s3://stoker/raw", opts)
    url = "s3://stoker/packed"
    pack("s3://stoker/raw", url, src_options=opts, dst_options=opts, shard_bytes=spec["shard_bytes"], progress=False)
    ds = open_dataset(url, storage_options=opts, cache=False, block_bytes=spec["block_bytes"])
    n = len(ds)
    out = {"dataset": {"samples": n, "bytes": int(ds.index.length.sum()), "blocks": ds.num_blocks},
           "setup_s": time.perf_counter() - t0, "runs": []}
    by_ip = {node["NodeManagerAddress"]: node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    host_nodes = [by_ip[ip] for ip in spec["host_ips"]]
    links = spec["links"]

    def served() -> int:  # the origin server's own count of body bytes sent
        import urllib.request
        with urllib.request.urlopen(f"{spec['direct_url']}/__stoker__/stats", timeout=10) as r:
            return int(json.loads(r.read())["bytes_served"])

    for placement in spec["placements"]:
        root = os.path.join(spec["workdir"], f"cache-{placement}")
        shutil.rmtree(root, ignore_errors=True)
        stop_services()
        for epoch in range(spec["epochs"]):
            for j, job in enumerate(JOBS):
                before, s0 = read_counters(links), served()
                if placement == "direct":
                    world = len(host_nodes)
                    refs = [ray.remote(direct_rank).options(
                        num_cpus=0.5, max_retries=0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                        {"url": url, "storage_options": opts, "cache_dir": os.path.join(root, f"h{r}"),
                         "cache_bytes": spec["cache_bytes"], "block_bytes": spec["block_bytes"], "epoch": epoch,
                         "rank": r, "world_size": world, "decode": spec["decode"]})
                        for r, node in enumerate(host_nodes)]
                    recs = ray.get(refs, timeout=spec["job_timeout_s"])
                else:
                    svc0 = services_origin_bytes()
                    fn = partial(read_plan, epoch=epoch, decode=spec["decode"])
                    res = cluster_run(fn, url, len(host_nodes), {"CPU": 0.5}, storage_options=opts, placement=placement,
                                      cache_root=root, cache_bytes=spec["cache_bytes"], block_bytes=spec["block_bytes"],
                                      seed=spec["seed"] + 1 + j, job=job, timeout_s=spec["job_timeout_s"])
                    recs = cluster_counts([r["epochs"][-1] for r in res], services_origin_bytes() - svc0)
                kernel = kernel_delta(before, read_counters(links))
                row = _row(placement, job, epoch, recs, n, kernel, served() - s0)
                out["runs"].append(row)
                print(json.dumps({k: row[k] for k in ("placement", "job", "epoch", "samples_per_s", "exactly_once")}
                                 | {"origin_link": kernel["origin_link_bytes"], "host_link": kernel["host_link_bytes"]}
                                 | row["stoker"]), flush=True)
        stop_services()
        shutil.rmtree(root, ignore_errors=True)
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(out_path + ".tmp", out_path)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
