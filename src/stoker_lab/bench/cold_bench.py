"""``stoker bench cold``: the cold epoch from a near and a far origin, side by side.

For each named origin (:data:`stoker_lab.bench.demo.ORIGINS`: ``near`` 20 ms / 100 MB/s, ``far``
100 ms / 1,000 MB/s) it runs the demo's stoker part (same data, same emulated S3 origin, a fresh
cache; no baseline, a consumer that takes no time) and reports, per origin: the cold epoch's time
to first batch, its overlap efficiency (max(bytes / bandwidth, samples / decode bound) / seconds),
cold throughput / min(decode bound, storage bound), the requests in flight, and the warm epochs'
origin bytes and throughput / decode bound.
"""

from __future__ import annotations

import os


def run(
    images: int | None = None,
    epochs: int = 3,
    workers: int = 2,
    workdir: str | None = None,
    origins: tuple[str, ...] = ("near", "far"),
) -> dict:
    """Run the cold benchmark; returns ``{"rows": [one dict per origin], "reports": {name: demo report}}``.
    ``images``: sample images (default: the quick demo's 1,500); ``epochs`` >= 2 (one cold, the rest warm).
    Raises ValueError for an unknown origin name or ``epochs < 2``."""
    from .demo import ORIGINS, DemoConfig, run_demo

    if epochs < 2:
        raise ValueError(f"epochs must be >= 2 (one cold, at least one warm), got {epochs}")
    rows, reports = [], {}
    for name in origins:
        if name not in ORIGINS:
            raise ValueError(f"unknown origin preset {name!r}; known: {sorted(ORIGINS)}")
        latency_ms, bandwidth_MBps = ORIGINS[name]
        cfg = DemoConfig(
            quick=True,
            images=images,
            latency_ms=latency_ms,
            bandwidth_MBps=bandwidth_MBps,
            origin=name,
            workers=workers,
            epochs=epochs,
            consumer_rate=0.0,
            baseline=False,
            workdir=os.path.join(workdir, name) if workdir else None,
        )
        report = run_demo(cfg)
        reports[name] = report
        rows.append(summarize(name, report))
    return {"rows": rows, "reports": reports}


def summarize(name: str, report: dict) -> dict:
    """One row of the cold benchmark from a demo report (its stoker runs with no consumer)."""
    lim = report["limits"]
    runs = [r for r in report["runs"] if r["loader"] == "stoker" and r["consumer_rate"] == 0]
    cold = next(r for r in runs if r["epoch"] == 0)
    warm = [r for r in runs if r["epoch"] > 0]
    return {
        "origin": name,
        "latency_ms": report["origin"]["latency_ms"],
        "bandwidth_MBps": report["origin"]["bandwidth_MBps"],
        "samples": report["dataset"]["samples"],
        "bytes": report["dataset"]["bytes"],
        "decode_bound": lim["decode_bound"],
        "storage_bound": lim["storage_bound"],
        "cold_samples_per_s": cold["samples_per_s"],
        "cold_vs_bound": cold["vs_bound"],
        "first_batch_s": cold["first_batch_s"],
        "overlap_efficiency": cold["overlap_efficiency"],
        "origin_busy_fraction": cold["origin_busy_fraction"],
        "inflight_requests": cold["inflight_requests"],
        "inflight_target": cold["inflight_target"],
        "warm_origin_bytes": max((r["origin_bytes"] for r in warm), default=0),
        "warm_vs_decode_bound": (
            min(r["samples_per_s"] for r in warm) / lim["decode_bound"] if warm and lim["decode_bound"] else 0.0
        ),
        "warm_first_batch_s": max((r["first_batch_s"] for r in warm), default=0.0),
        **cpu_ceiling(cold, lim, report["machine"].get("cores") or os.cpu_count() or 1),
    }


def cpu_ceiling(cold: dict, limits: dict, cores: int) -> dict:
    """What the machine's cores allow the cold epoch, from the CPU it spent.

    Every process of the cold epoch runs on the same ``cores``: the decode workers, the
    prefetcher, the training process and, in a benchmark, the emulated origin. However well
    they overlap, the epoch takes at least ``cpu_s / cores`` seconds (``cpu_s``: their CPU
    seconds summed, ``cold["cpu_s"]``). Returns ``cpu_s`` (s), ``cpu_floor_s`` (s) and
    ``cpu_ceiling_vs_bound``: samples / cpu_floor_s over min(decode bound, storage bound), the
    best ``cold_vs_bound`` these CPU costs allow here (above 1: the cores are not what limits).
    """
    cpu_s = float(sum(cold.get("cpu_s", {}).values()))
    floor_s = cpu_s / max(1, cores)
    bound = min(limits["decode_bound"], limits["storage_bound"])
    ceiling = cold["samples"] / floor_s / bound if floor_s > 0 and bound > 0 else 0.0
    return {"cpu_s": cpu_s, "cpu_floor_s": floor_s, "cpu_ceiling_vs_bound": ceiling}


def print_rows(rows: list[dict], cores: int | None = None) -> None:
    """The far/near table."""
    print(f"machine: {cores or os.cpu_count()} cores")
    print(
        f"{'origin':7} {'latency':>8} {'MB/s':>6} {'cold/s':>7} {'cold/bound':>10} {'first batch s':>13} "
        f"{'overlap':>7} {'busy':>5} {'in flight':>9} {'warm origin MB':>14} {'warm/decode':>11} "
        f"{'CPU ceiling':>11}"
    )
    for r in rows:
        print(
            f"{r['origin']:7} {r['latency_ms']:>6.0f}ms {r['bandwidth_MBps']:>6.0f} {r['cold_samples_per_s']:>7.0f} "
            f"{r['cold_vs_bound']:>10.2f} {r['first_batch_s']:>13.2f} {r['overlap_efficiency']:>7.2f} "
            f"{r['origin_busy_fraction']:>5.2f} {r['inflight_requests']:>9.1f} {r['warm_origin_bytes'] / 1e6:>14.2f} "
            f"{r['warm_vs_decode_bound']:>11.2f} {r.get('cpu_ceiling_vs_bound', 0.0):>11.2f}"
        )
    print(
        "CPU ceiling: samples / (CPU-s of every process of the cold epoch / cores), over the min "
        "bound: the best cold/bound these cores allow"
    )
