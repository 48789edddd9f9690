"""``stoker simulate tdcs``: the TDCS paper's experiment (ResNet-50, ImageNet-1k, 16 nodes x 8
V100) on the model, and the scaling curves past it.

Four setups (:data:`stoker_lab.sim.decide.SETUPS`): ``direct`` (every rank reads the remote store,
no cache), ``random`` (a distributed cache, ranks placed without regard to data: Alluxio
without TDCS), ``presence`` (ranks only on nodes with a cache worker of the dataset: Fluid's
affinity) and ``colocated`` (stoker's TDCS placement and co-located read plans). Every
parameter and its source is in :func:`assumptions`; the paper's 2-3x is not an input.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from .byte_cpu import DEFAULT_NODE_CORES, DEFAULTS, FIELDS, PATHS, byte_cores, cpu_utilization
from .decide import SETUPS
from .model import Job, Params, simulate
from .tdcs_config import IMAGENET_MEAN_BYTES, IMAGENET_SAMPLES, V100_RESNET50_RATE, TdcsConfig  # noqa: F401
from .workload import Workload, synthetic


def assumptions(cfg: TdcsConfig, sources: dict[str, str] | None = None) -> dict:
    """Every parameter with its value and source (``sources`` overrides, e.g. calibrated values)."""
    src = {
        "nodes": "the TDCS paper's cluster: 16 nodes",
        "gpus_per_node": "the paper: 8 V100 per node",
        "gpu_rate": "samples/s per GPU: NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README, DGX-1 16GB "
        "(8x V100 16GB), mixed precision, 8 GPUs: 8322 img/s / 8",
        "samples": "ImageNet-1k train (ILSVRC-2012; Russakovsky et al., IJCV 2015)",
        "mean_sample_bytes": "ImageNet train mean JPEG size, about 110 KB (the literature's figure)",
        "sample_sigma": "assumption: log-normal spread of sample sizes (changes no total)",
        "shard_bytes": "assumption: stoker pack shards of 256 MiB",
        "block_bytes": "stoker's default cache block",
        "store_gbit": "assumption (issue default): a shared 10 Gbit/s remote store",
        "store_latency_ms": "assumption (issue default): 20 ms per request",
        "store_concurrency": "stoker Loader default fetch_concurrency (requests in flight per rank)",
        "nic_gbit": "assumption (issue default): 25 Gbit/s per node, full duplex",
        "cache_read_GBps": "assumption: one NVMe SSD (PCIe 3 x4 reads about 3 GB/s)",
        "cache_fraction": "cache per node as a fraction of dataset / nodes (1.0: the cluster holds it once)",
        "decode_cores": "assumption: a DGX-1's 40 CPU cores (2x Xeon E5-2698 v4)",
        "decode_rate": "per-core decode + RandomResizedCrop, samples/s: built-in default, per_core.stoker of an "
        "earlier stoker bench decode on stoker's development machine",
        "peer_latency_ms": "assumption: one request to a peer's cache service on a data-centre network",
        "peer_concurrency": "as store_concurrency",
        "chunk_samples": "model granularity: most samples per chunk (fewer where a rank has under 8 chunks)",
        "prefetch_bytes": "stoker Loader default prefetch_bytes",
        "epochs": "epochs simulated",
        "jobs": "jobs sharing the dataset (GPUs split evenly between them)",
        "seed": "permutation seed",
        "read_ahead": "stoker's Loader reads ahead of the GPU (prefetch_bytes, store_concurrency requests in "
        "flight); False: each rank reads one sample at a time, decodes it and waits for its GPU step before the "
        "next read (time per sample = read + decode + 1 / gpu_rate)",
        "cores_per_node": DEFAULT_NODE_CORES[1],
        **{FIELDS[p]: DEFAULTS[p].source for p in PATHS},
    }
    src |= sources or {}
    return {k: {"value": v, "source": src.get(k, "")} for k, v in asdict(cfg).items()}


def workload(cfg: TdcsConfig) -> Workload:
    """The dataset of ``cfg`` (:func:`stoker_lab.sim.workload.synthetic`)."""
    return synthetic(
        cfg.samples,
        int(cfg.samples * cfg.mean_sample_bytes),
        cfg.shard_bytes,
        cfg.block_bytes,
        cfg.sample_sigma,
        cfg.seed,
        name="imagenet",
    )


#: Without read-ahead a rank's plan is read in at most this many chunks per epoch (a chunk's
#: samples read one request at a time, then decoded, then stepped): the same serial time as one
#: sample a chunk, the links shared at a coarser grain (as :mod:`stoker_lab.sim.calibrate` models
#: the namespace cluster's ranks, which read that way).
SERIAL_CHUNKS_PER_RANK = 300

#: Setups of :func:`run_setup` beyond :data:`stoker_lab.sim.decide.SETUPS`: ``direct-cached``
#: places ranks as ``direct`` does, each node caching the blocks its own ranks read and sharing
#: none (``stoker bench cluster``'s ``direct`` placement: a node cache per host, no cluster).
EXTRA_SETUPS = ("direct-cached",)


def model_setup(setup: str) -> str:
    """The model's setup (:data:`stoker_lab.sim.decide.SETUPS`) of a :func:`run_setup` setup."""
    return "direct" if setup == "direct-cached" else setup


def params(cfg: TdcsConfig, setup: str, wl: Workload) -> Params:
    """:class:`Params` of ``cfg`` for ``setup`` (``direct`` has no cache; ``direct-cached`` a node
    cache each, shared with no other node). Chunks hold at most ``cfg.chunk_samples`` samples and
    are cut smaller so that each rank has at least 8 per epoch (a rank's first chunk is a ramp the
    rest of the epoch hides); a rank of one of ``cfg.jobs`` jobs reads the dataset split over its
    job's ranks, not over all GPUs. Without ``cfg.read_ahead`` a rank has one chunk in flight, its
    requests one at a time, in chunks of at most ``samples per rank /``
    :data:`SERIAL_CHUNKS_PER_RANK` samples (rounded up)."""
    per_rank = cfg.samples // max(1, cfg.nodes * cfg.gpus_per_node // cfg.jobs)
    chunk = min(cfg.chunk_samples, max(16, per_rank // 8))  # at least 8 chunks per rank and epoch
    if not cfg.read_ahead:
        chunk = max(1, math.ceil(per_rank / SERIAL_CHUNKS_PER_RANK))
    chunk_bytes = chunk * cfg.mean_sample_bytes
    cache = 0.0 if setup == "direct" else cfg.cache_fraction * float(wl.block_bytes.sum()) / cfg.nodes
    return Params(
        nodes=cfg.nodes,
        cache_bytes=cache,
        origin_Bps=cfg.store_gbit * 1e9 / 8,
        nic_Bps=cfg.nic_gbit * 1e9 / 8,
        cache_read_Bps=cfg.cache_read_GBps * 1e9,
        slots_per_node=cfg.gpus_per_node,
        gpu_rate=cfg.gpu_rate,
        decode_cores=cfg.decode_cores,
        decode_rate=cfg.decode_rate,
        origin_latency_s=cfg.store_latency_ms / 1e3,
        origin_concurrency=cfg.store_concurrency if cfg.read_ahead else 1,
        peer_latency_s=cfg.peer_latency_ms / 1e3,
        peer_concurrency=cfg.peer_concurrency if cfg.read_ahead else 1,
        prefetch_chunks=max(2, int(cfg.prefetch_bytes // chunk_bytes)) if cfg.read_ahead else 1,
        fetch_inflight=1,
        chunk_samples=chunk,
        seed=cfg.seed,
    )


def bottleneck(
    p: Params, link_bytes: dict, seconds: float, decode_s: float, gpu_util: float | None, cpu: float = 0.0
) -> dict:
    """The busiest resource of an epoch: utilisation (busy / available) of the origin link,
    the busiest NIC direction and cache, the decode cores, the GPUs and the node's ``CPU`` (``cpu``:
    byte-moving and decode cores over the node's, :func:`stoker_lab.sim.byte_cpu.cpu_utilization`).
    ``name``: ``CPU`` when it is over 1 (the model gives moving bytes no CPU, so only there does it
    say the node's cores cannot keep the epoch's pace), else the highest of the others."""

    def most(prefix: str, cap: float) -> float:
        vals = [v for k, v in link_bytes.items() if k.startswith(prefix)]
        return max(vals, default=0.0) / (cap * seconds) if seconds > 0 else 0.0

    util = {
        "origin link": link_bytes.get("origin", 0.0) / (p.origin_Bps * seconds) if seconds > 0 else 0.0,
        "NIC receive": most("rx", p.nic_Bps),
        "NIC send": most("tx", p.nic_Bps),
        "cache reads": most("disk", p.cache_read_Bps),
        "decode cores": decode_s / (p.decode_cores * p.nodes * seconds) if p.decode_cores and seconds > 0 else 0.0,
        "GPUs": gpu_util or 0.0,
    }
    name = "CPU" if cpu > 1 else max(util, key=lambda k: util[k])
    return {"name": name, "utilization": util | {"CPU": cpu}}


def run_setup(cfg: TdcsConfig, setup: str, wl: Workload | None = None) -> list[dict]:
    """Rows of one setup (:data:`stoker_lab.sim.decide.SETUPS` or :data:`EXTRA_SETUPS`): per job
    and epoch, ``setup``, ``nodes``, ``gpus``, ``jobs``, ``job``, ``epoch``, ``epoch_s``,
    ``gpu_utilization``, ``bytes`` (per kind of link), ``byte_cores_per_node`` (cores per node
    moving bytes, per path and ``total``: :func:`stoker_lab.sim.byte_cpu.byte_cores` at
    ``cfg``'s costs; jobs run together: the group's bytes over this job's seconds),
    ``decode_cores_per_node`` (decode core-seconds per node and second) and ``bottleneck``
    (:func:`bottleneck`, the node's CPU against ``cfg.cores_per_node``)."""
    wl = wl or workload(cfg)
    p = params(cfg, setup, wl)
    gpus = cfg.nodes * cfg.gpus_per_node
    if gpus % cfg.jobs:
        raise ValueError(f"{gpus} GPUs do not split evenly over {cfg.jobs} jobs")
    jobs = [Job(f"job{j + 1}", gpus // cfg.jobs, cfg.seed + 1 + j) for j in range(cfg.jobs)]
    rows = []
    for r in simulate(p, wl, model_setup(setup), jobs, cfg.epochs):
        moving = byte_cores(cfg.cpu_costs(), r.bytes, cfg.nodes, r.seconds)
        decoding = r.decode_s / cfg.nodes / r.seconds if r.seconds > 0 else 0.0
        cpu = cpu_utilization(moving["total"], decoding, cfg.cores_per_node)
        rows.append(
            {
                "setup": setup,
                "nodes": cfg.nodes,
                "gpus": gpus,
                "jobs": cfg.jobs,
                "job": r.job,
                "epoch": r.epoch,
                "epoch_s": r.seconds,
                "gpu_utilization": r.gpu_utilization,
                "bytes": r.bytes,
                "cache_fraction": cfg.cache_fraction,
                "byte_cores_per_node": moving,
                "decode_cores_per_node": decoding,
                "bottleneck": bottleneck(p, r.link_bytes, r.seconds, r.decode_s, r.gpu_utilization, cpu),
            }
        )
    return rows


def experiment(cfg: TdcsConfig, setups: tuple[str, ...] = SETUPS, sources: dict[str, str] | None = None) -> dict:
    """The four setups on ``cfg``: ``{assumptions, rows, summary}``; ``summary`` gives each
    setup's total seconds over the epochs and its speed-up over ``direct``."""
    wl = workload(cfg)
    rows = [row for s in setups for row in run_setup(cfg, s, wl)]
    return {"assumptions": assumptions(cfg, sources), "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    """Per setup: total seconds (sum of epochs of the slowest job), warm-epoch seconds (mean of
    epochs >= 1) and both as speed-ups over ``direct`` (when it ran)."""
    out: dict = {}
    for s in dict.fromkeys(r["setup"] for r in rows):
        per_epoch: dict = {}
        for r in rows:
            if r["setup"] == s:
                per_epoch[r["epoch"]] = max(per_epoch.get(r["epoch"], 0.0), r["epoch_s"])
        warm = [v for e, v in per_epoch.items() if e >= 1]
        out[s] = {"total_s": sum(per_epoch.values()), "warm_epoch_s": sum(warm) / len(warm) if warm else None}
    if "direct" in out:
        for v in out.values():
            v["speedup_total"] = out["direct"]["total_s"] / v["total_s"]
            if v["warm_epoch_s"] and out["direct"]["warm_epoch_s"]:
                v["speedup_warm"] = out["direct"]["warm_epoch_s"] / v["warm_epoch_s"]
    return out
