"""Model parameters from measurements, each with where it came from.

A :class:`Calibrated` value carries its ``source`` (a file and field, or a measurement made
now), so every table the model prints can say where its numbers came from. Nothing here is
tuned to the result being predicted: the namespace cluster's per-request peer time is fitted on
the *calibration run* (one ``stoker bench cluster --netns`` report), and the validation reports
which rows are that run (in sample) and which are not.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

from .model import Job, Params, simulate
from .workload import Workload, synthetic

#: 1 Mbit/s in bytes/s.
MBIT_BPS = 1e6 / 8


@dataclass
class Calibrated:
    """A parameter value (unit in its name) and the measurement it comes from."""

    value: float
    source: str


def measure_cache_read_Bps(directory: str | None = None, size_bytes: int = 64 << 20,
                           block_bytes: int = 1 << 20) -> Calibrated:
    """Read rate of a warm node cache, bytes/s: a ``size_bytes`` file written under ``directory``
    (default: the temporary directory) and read back in ``block_bytes`` reads (the page cache
    serves it, as it serves a cache that fits in memory). The file is removed."""
    fd, path = tempfile.mkstemp(prefix="stoker-sim-read-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(block_bytes) * (size_bytes // block_bytes))
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(block_bytes):
                pass
        secs = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return Calibrated(size_bytes / secs, f"measured now: {size_bytes >> 20} MiB read back in "
                                         f"{block_bytes >> 20} MiB reads from {directory or tempfile.gettempdir()}")


def netns_workload(report: dict) -> Workload:
    """The dataset of a ``stoker bench cluster --netns`` report (its samples and bytes, its shard
    and block sizes) laid out by :func:`stoker.sim.workload.synthetic`."""
    ds, cfg = report["dataset"], report["config"]
    return synthetic(ds["samples"], ds["bytes"], cfg["shard_bytes"], cfg["block_bytes"], name="netns")


def local_latency(report: dict, path: str) -> Calibrated:
    """Seconds per sample read from a warm node cache: the ``direct`` rows with no origin bytes
    (warm), seconds of the slowest rank / samples per rank, averaged."""
    rows = [r for r in report["runs"] if r["placement"] == "direct" and r["stoker"]["origin_bytes"] == 0]
    if not rows:
        raise ValueError(f"{path}: no warm direct epoch to calibrate the local read time from")
    vals = [r["seconds"] / (r["samples"] / r["ranks"]) for r in rows]
    return Calibrated(sum(vals) / len(vals),
                      f"{path}: warm direct epochs, seconds / samples per rank (mean of {len(vals)})")


def netns_params(report: dict, local_s: float, peer_cpu_s: float = 0.0, link_factor: float = 1.0) -> Params:
    """:class:`Params` of a namespace-cluster report: its hosts, tbf link rates (Mbit/s per
    direction) times ``link_factor`` (the fraction of its rate a link delivers,
    :func:`fit_link_factor`), origin latency and cache bytes; one rank per host reading
    synchronously (the driver's ``read_plan``: one request at a time, no decode, no accelerator);
    ``peer_cpu_s`` CPU seconds per peer request on the report's ``machine.cores`` cores, which all
    the emulated hosts share (:func:`fit_peer_cpu`)."""
    links, cfg = report["links"], report["config"]
    hosts = [v for k, v in links.items() if k != "origin"]
    return Params(nodes=report["hosts"], cache_bytes=cfg["cache_bytes_per_node"],
                  origin_Bps=links["origin"]["mbit"] * MBIT_BPS * link_factor,
                  nic_Bps=min(h["mbit"] for h in hosts) * MBIT_BPS * link_factor,
                  origin_latency_s=report["origin"]["latency_ms"] / 1e3, local_latency_s=local_s,
                  machine_cores=float(report["machine"]["cores"]) if peer_cpu_s > 0 else 0.0,
                  peer_cpu_s=peer_cpu_s, prefetch_chunks=1, fetch_inflight=1, chunk_samples=16)


def netns_jobs(report: dict) -> list[Job]:
    """The driver's two jobs (random placement seeded ``seed + 1 + j``)."""
    return [Job(f"job{j + 1}", report["config"]["ranks_per_job"], 1 + j) for j in range(report["config"]["jobs"])]


def _bisect(f, target: float, lo: float, hi: float, increasing: bool, steps: int = 16) -> float:
    """x in [lo, hi] where the monotone ``f(x)`` meets ``target`` (``steps`` halvings)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        below = f(mid) < target
        lo, hi = (mid, hi) if below == increasing else (lo, mid)
    return (lo + hi) / 2


def cold_direct_row(report: dict, path: str) -> dict:
    """The first job's cold ``direct`` epoch: every host reads the whole dataset from the origin
    through the one origin link, so its time is the origin link's delivered rate (plus the
    per-request latency the model adds). Raises ValueError without one."""
    rows = [r for r in report["runs"] if r["placement"] == "direct" and r["epoch"] == 0
            and r["stoker"]["origin_bytes"] > 0]
    if not rows:
        raise ValueError(f"{path}: no cold direct epoch to measure the links' delivered rate on")
    return rows[0]


def fit_link_factor(report: dict, path: str, local_s: float) -> Calibrated:
    """The fraction of their configured rate the report's tbf links deliver, fitted by bisection
    so the model's cold ``direct`` epoch (:func:`cold_direct_row`, a bandwidth-bound epoch)
    takes its measured seconds. Applied to the host links too: they are shaped by the same
    rule (tbf with a bucket of 10 ms of the rate, ``stoker.bench.netcluster``). The kernel's
    count of the epoch's origin-link bytes over its seconds is given beside it."""
    row = cold_direct_row(report, path)
    wl, jobs = netns_workload(report), netns_jobs(report)

    def cold_s(factor: float) -> float:
        res = simulate(netns_params(report, local_s, link_factor=factor), wl, "direct", jobs[:1], 1)
        return res[0].seconds

    factor = _bisect(cold_s, row["seconds"], 0.02, 2.0, increasing=False)
    raw = row["kernel"]["origin_link_bytes"] * 8 / row["seconds"] / 1e6
    return Calibrated(factor, f"{path}: fitted to its cold direct epoch ({row['seconds']:.2f} s; the kernel "
                              f"counted {raw:.1f} Mbit/s on the {report['links']['origin']['mbit']:g} Mbit/s origin "
                              "link); that row is in sample")


def fit_peer_cpu(report: dict, path: str, local_s: float, link_factor: float = 1.0,
                 hi_s: float = 0.2) -> Calibrated:
    """CPU seconds per peer request (the rank's Ray call and the owning node's service, on the
    machine's ``machine.cores`` cores that every emulated host shares), fitted by bisection so
    the model's mean warm ``random`` epoch equals the report's (the placement whose warm time is
    mostly peer requests). Raises ValueError without such rows."""
    meas = [r["seconds"] for r in report["runs"] if r["placement"] == "random" and r["epoch"] >= 1]
    if not meas:
        raise ValueError(f"{path}: no warm random epochs to fit the peer request time on")
    target = sum(meas) / len(meas)
    wl, jobs = netns_workload(report), netns_jobs(report)
    epochs = report["config"]["epochs"]

    def mean_warm(cpu_s: float) -> float:
        res = simulate(netns_params(report, local_s, max(cpu_s, 1e-9), link_factor), wl, "random", jobs, epochs,
                       together=False)
        warm = [r.seconds for r in res if r.epoch >= 1]
        return sum(warm) / len(warm)

    cpu_s = _bisect(mean_warm, target, 0.0, hi_s, increasing=True)
    return Calibrated(cpu_s, f"{path}: fitted to its warm random epochs (mean {target:.2f} s) with "
                             f"{report['machine']['cores']} cores shared by all hosts; this run is the calibration run")


def demo_params(demo: dict, decode_bench: dict | None, decode_path: str, demo_path: str,
                consumer_rate: float) -> tuple[Params, dict[str, Calibrated]]:
    """:class:`Params` of a ``stoker demo`` report: one node, one rank with ``workers`` decode
    cores at the demo's own single-process decode rate times the pipeline efficiency of
    ``stoker bench decode`` (its loader rate / (workers x its per-core rate)); the origin's
    bandwidth and latency; Loader defaults for fetching (8 ranged GETs in flight, 512 MiB ahead).
    Returns the parameters and the calibrated values they came from."""
    cfg, origin = demo["config"], demo["origin"]
    workers = int(cfg["workers"])
    per_core = Calibrated(demo["limits"]["decode_per_core"],
                          f"{demo_path}: limits.decode_per_core (single process, from memory, same files)")
    eff = Calibrated(1.0, "none (no stoker bench decode report)")
    if decode_bench:
        row = min(decode_bench["loader"], key=lambda r: abs(r["workers"] - workers))
        eff = Calibrated(row["samples_per_s"] / (row["workers"] * decode_bench["per_core"]["stoker"]),
                         f"{decode_path}: loader samples/s with {row['workers']} workers / "
                         f"({row['workers']} x per_core.stoker)")
    mean = demo["dataset"]["bytes"] / demo["dataset"]["samples"]
    chunk = int(cfg["batch_size"])
    p = Params(nodes=1, cache_bytes=float(1 << 40),  # the demo's cache holds the dataset
               origin_Bps=origin["bandwidth_MBps"] * 1e6,
               origin_latency_s=origin["latency_ms"] / 1e3, decode_cores=workers,
               decode_rate=per_core.value * eff.value, gpu_rate=consumer_rate, origin_concurrency=8,
               prefetch_chunks=max(1, int((512 << 20) / (chunk * mean))), chunk_samples=chunk)
    return p, {"decode_per_core": per_core, "pipeline_efficiency": eff}


def demo_workload(demo: dict) -> Workload:
    """The demo's dataset (samples, bytes; its shard and block sizes) by :func:`synthetic`."""
    ds, cfg = demo["dataset"], demo["config"]
    return synthetic(ds["samples"], ds["bytes"], cfg["shard_bytes"], cfg["block_bytes"], name="demo")
