"""``stoker bench cluster``: 2 jobs x 3 nodes on one dataset behind the throttled origin,
co-located against random placement (the cluster benchmark of benchmarks/README.md).

Everything runs on this machine: the emulated S3 origin (moto behind the throttling proxy of
:mod:`stoker_lab.bench.origin`), a 3-node ``ray.cluster_utils.Cluster`` (each node its own raylet and
object store), one cache service per node. For each placement, on empty caches: epoch 0 with
both jobs at once (cold), then epochs 1.. (both jobs at once, after warm-up). Each job has one
rank per node (co-located) or ranks on random nodes (random, seeded). A rank reads and verifies
every sample of its plan (no decode: decoding costs the same under both placements and on a
2-core machine would hide the I/O). Per job and epoch: samples/s (samples / the slowest rank's
seconds) and the bytes read locally, from peers and from the origin.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial


def _job_rows(placement: str, job: str, results: list, dataset_bytes: int) -> list[dict]:
    rows = []
    for e in range(len(results[0]["epochs"])):
        recs = [r["epochs"][e] for r in results]
        samples = sum(x["samples"] for x in recs)
        seconds = max(x["seconds"] for x in recs)
        row = {
            "placement": placement,
            "job": job,
            "epoch": recs[0]["epoch"],
            "ranks": len(recs),
            "samples": samples,
            "seconds": seconds,
            "samples_per_s": samples / seconds if seconds else 0.0,
            "local_bytes": sum(x["local_bytes"] for x in recs),
            "peer_bytes": sum(x["peer_bytes"] for x in recs),
            "origin_bytes": sum(x["origin_bytes"] for x in recs),
            "fallbacks": sum(x["fallbacks"] for x in recs),
            "dataset_bytes": dataset_bytes,
            "rank_nodes": [r["node_id"][:8] for r in results],
        }
        tot = row["local_bytes"] + row["peer_bytes"] + row["origin_bytes"]
        for k in ("local", "peer", "origin"):
            row[f"{k}_fraction"] = row[f"{k}_bytes"] / tot if tot else 0.0
        rows.append(row)
    return rows


def run(
    images: int = 900,
    epochs: int = 3,
    latency_ms: float = 20.0,
    bandwidth_MBps: float = 100.0,
    block_bytes: int = 1 << 20,
    shard_bytes: int = 16 << 20,
    cache_bytes: int = 256 << 20,
    workdir: str | None = None,
    seed: int = 0,
) -> dict:
    """Run the benchmark; returns ``{machine, dataset, origin, runs: [...], origin_served}``
    (``runs``: one row per placement, job and epoch; bytes in bytes)."""
    import ray
    from ray.cluster_utils import Cluster

    from stoker.cluster.jobs.job import read_epochs
    from stoker.cluster.jobs.job import run as cluster_run
    from stoker.cluster.service.cache_service import stop_services
    from stoker.cluster.settings import ClusterOptions
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    from ..sample_data import make_sample_data
    from .origin import LocalS3Origin, upload_tree

    work = workdir or os.path.join(tempfile.gettempdir(), "stoker-bench-cluster")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    make_sample_data(data, images=images, classes=10, seed=seed)
    report = {
        "machine": {"cores": os.cpu_count()},
        "origin": {"latency_ms": latency_ms, "bandwidth_MBps": bandwidth_MBps},
        "config": {
            "jobs": 2,
            "nodes": 3,
            "epochs": epochs,
            "block_bytes": block_bytes,
            "cache_bytes_per_node": cache_bytes,
        },
        "runs": [],
        "origin_served": [],
    }
    with LocalS3Origin(latency_ms=latency_ms, bandwidth_MBps=bandwidth_MBps) as origin:
        opts = origin.storage_options()
        upload_tree(os.path.join(data, "train"), origin.url("raw"), origin.storage_options(throttled=False))
        url = origin.url("packed")
        pack(origin.url("raw"), url, storage_options=opts, shard_bytes=shard_bytes, progress=False)
        ds = open_dataset(url, storage_options=opts, cache=False, block_bytes=block_bytes)
        dataset_bytes = int(ds.index.length.sum())
        report["dataset"] = {"samples": len(ds), "bytes": dataset_bytes, "blocks": len(ds.blocks)}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 150 << 20})
        for _ in range(2):
            cluster.add_node(num_cpus=2, object_store_memory=150 << 20)
        ray.init(address=cluster.address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            cluster.wait_for_nodes()
            for placement in ("colocated", "random"):
                root = os.path.join(work, f"cache-{placement}")
                shutil.rmtree(root, ignore_errors=True)
                stop_services()
                common = dict(
                    storage_options=opts,
                    cache_dir=root,
                    cache_bytes=cache_bytes,
                    block_bytes=block_bytes,
                )
                for epoch in range(epochs):
                    served0 = origin.stats()["bytes_served"]
                    fn = partial(read_epochs, epochs=1, first_epoch=epoch)
                    refs = [
                        cluster_run(
                            fn,
                            url,
                            3,
                            {"CPU": 0.5},
                            cluster=ClusterOptions(job=job, seed=seed + 1 + j, placement=placement, wait=False),
                            **common,
                        )
                        for j, job in enumerate(("job1", "job2"))
                    ]
                    for job, r in zip(("job1", "job2"), refs, strict=True):
                        report["runs"].extend(_job_rows(placement, job, ray.get(r, timeout=600), dataset_bytes))
                    report["origin_served"].append(
                        {"placement": placement, "epoch": epoch, "bytes": origin.stats()["bytes_served"] - served0}
                    )
            stop_services()
        finally:
            ray.shutdown()
            cluster.shutdown()
    return report


def table(report: dict) -> str:
    """The report as a Markdown table."""
    lines = [
        "| placement | job | epoch | samples/s | local | peer | origin | origin MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['placement']} | {r['job']} | {r['epoch']} | {r['samples_per_s']:,.0f} | "
            f"{r['local_fraction']:.2f} | {r['peer_fraction']:.2f} | {r['origin_fraction']:.2f} | "
            f"{r['origin_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)
