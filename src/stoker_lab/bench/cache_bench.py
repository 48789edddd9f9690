"""`stoker bench cache`: origin bytes, hit ratio and data stall per cache budget and policy.

Theory (:mod:`stoker.cache.policy`): with every sample read once per epoch, no
policy reads fewer than D - C bytes per epoch from the origin (D dataset bytes, C the
budget, C < D). For budgets of 10/25/50/100 % of the demo dataset behind the throttled S3
origin, each policy runs ``epochs`` epochs with a fresh cache; the emulated accelerator
consumes at the rate at which the origin could supply the misses of the smallest budget
with 2x headroom: ``bandwidth / (2 (1 - min fraction) mean sample bytes)`` samples/s.
Then two jobs (two processes, each its own Loader) read the same dataset at once through
one node cache: the origin's own byte counter gives their total.

JSON: {"runs": [{policy, cache_fraction, epoch, origin_bytes, dataset_bytes, hit_ratio,
stall_fraction, ...}], "two_jobs": [...], "consumer_rate", "origin", "dataset", "load"}.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile

POLICY_NAMES = ("future", "lru", "noevict")


def _job(url, opts, cache_dir, cache_bytes, staging_bytes, epochs, rate, seed, out):
    """One training job (its own process): a Loader over the shared node cache."""
    from stoker.loader import Loader, ReadOptions
    from stoker.store.dataset import open_dataset

    from .harness import measure

    ds = open_dataset(url, cache_dir=cache_dir, cache_bytes=cache_bytes, storage_options=opts)
    rows = []
    with Loader(ds, 64, num_workers=1, seed=seed, read=ReadOptions(staging_bytes=staging_bytes)) as loader:
        for _ in range(epochs):
            m = measure(loader, rate)
            st = loader.stats
            rows.append(
                {
                    "epoch": st.epoch,
                    "origin_bytes": st.origin_bytes,
                    "hit_ratio": st.cache_hit_ratio,
                    "stall_fraction": m.stall_fraction,
                    "samples_per_s": m.samples_per_s,
                    "exactly_once": st.exactly_once,
                }
            )
    out.put(rows)


def _row(policy, frac, C, D, st, m) -> dict:
    return {
        "policy": policy,
        "cache_fraction": frac,
        "epoch": st.epoch,
        "origin_bytes": st.origin_bytes,
        "dataset_bytes": D,
        "hit_ratio": st.cache_hit_ratio,
        "stall_fraction": m.stall_fraction,
        "cache_bytes": C,
        "floor_bytes": max(0, D - C),
        "origin_requests": st.origin_requests,
        "samples_per_s": m.samples_per_s,
        "exactly_once": st.exactly_once,
        "evictions": st.evictions,
        "staged_hits": st.staged_hits,
        "direct_reads": st.direct_reads,
        "prefetch_depth_bytes": st.prefetch_depth_bytes,
        "cpu_s": st.cpu_s,
    }


def run(
    images: int = 5000,
    epochs: int = 3,
    fractions=(0.1, 0.25, 0.5, 1.0),
    policies=POLICY_NAMES,
    workers: int = 2,
    batch_size: int = 64,
    latency_ms: float = 20.0,
    bandwidth_MBps: float = 100.0,
    consumer_rate: float | None = None,
    two_jobs_fractions=(1.0, 0.5),
    workdir: str | None = None,
    staging_bytes: int = 64 << 20,
    log=None,
) -> dict:
    """Run the benchmark; returns the report (see the module docstring). ``consumer_rate``:
    samples/s of the emulated accelerator (default: the 2x-headroom rule above).
    ``staging_bytes``: the Loader's staging budget (blocks fetched just in time that the
    cache does not admit; they are deleted after their last use in the epoch). It must hold
    the blocks of the shuffle windows in flight (every batch of the blockwise order touches
    every block of its window), so it is not carved out of C; a staged block still there when
    the next epoch first needs it is a hit across the boundary, which can put an epoch a little
    below D - C (reported as ``staging_bytes``)."""
    from stoker.cache.spec import CacheOptions
    from stoker.loader import Loader, ReadOptions
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    from ..sample_data import make_sample_data
    from .harness import measure
    from .origin import LocalS3Origin, upload_tree

    log = log or (lambda msg: print(msg, flush=True))

    work = workdir or os.path.join(tempfile.gettempdir(), "stoker-cache-bench")
    data = os.path.join(work, "data")
    make_sample_data(data, images=images, classes=10, seed=0)
    report: dict = {
        "runs": [],
        "two_jobs": [],
        "origin": {"latency_ms": latency_ms, "bandwidth_MBps": bandwidth_MBps},
        "config": {
            "images": images,
            "epochs": epochs,
            "workers": workers,
            "batch_size": batch_size,
            "staging_bytes": staging_bytes,
        },
        "cores": os.cpu_count(),
    }
    with LocalS3Origin(latency_ms=latency_ms, bandwidth_MBps=bandwidth_MBps) as origin:
        direct = origin.storage_options(throttled=False)
        upload_tree(os.path.join(data, "train"), origin.url("raw"), direct)
        pack(origin.url("raw"), origin.url("packed"), storage_options=direct, progress=False, overwrite=True)
        url, opts = origin.url("packed"), origin.storage_options()
        probe = open_dataset(url, cache=False, storage_options=opts)
        # D: the bytes the cache must hold for the whole dataset (its blocks: payloads plus the
        # tar headers between them), the unit of the D - C floor
        D, n = int((probe.blocks.end - probe.blocks.start).sum()), len(probe)
        miss = max(0.05, 1 - min(fractions))  # (at C >= D there are no misses: cap the rate)
        rate = consumer_rate or bandwidth_MBps * 1e6 / (2 * miss * D / n)
        report["consumer_rate"] = rate
        report["dataset"] = {
            "samples": n,
            "bytes": D,
            "payload_bytes": int(probe.index.total_bytes),
            "mean_sample_bytes": D / n,
        }
        log(f"dataset {n} samples, {D / 1e6:.1f} MB; emulated accelerator {rate:.0f} samples/s")
        cache_dir = os.path.join(work, "cache")
        for frac in fractions:
            C = int(frac * D)
            S = staging_bytes
            for policy in policies:
                shutil.rmtree(cache_dir, ignore_errors=True)
                spec = CacheOptions(cache_dir=cache_dir, cache_bytes=C, cache_policy=policy)
                ds = open_dataset(url, cache=spec, storage_options=opts)
                with Loader(ds, batch_size, num_workers=workers, seed=0, read=ReadOptions(staging_bytes=S)) as loader:
                    for _ in range(epochs):
                        m = measure(loader, rate)
                        row = _row(policy, frac, C, D, loader.stats, m)
                        row["staging_bytes"] = S
                        report["runs"].append(row)
                        log(
                            f"{policy:8} C={frac:4.2f}D epoch {row['epoch']}: origin {row['origin_bytes'] / 1e6:7.1f} MB"
                            f" (floor {row['floor_bytes'] / 1e6:6.1f}) hit {row['hit_ratio']:.2f}"
                            f" stall {row['stall_fraction']:.3f} {row['samples_per_s']:5.0f}/s"
                        )
                ds.cache.jobs.unregister(ds.version)
        ctx = mp.get_context("fork")
        for frac in two_jobs_fractions:
            shutil.rmtree(cache_dir, ignore_errors=True)
            C = int(frac * D)
            S = staging_bytes
            before = origin.stats()["bytes_served"]
            q = ctx.Queue()
            procs = [
                ctx.Process(target=_job, args=(url, opts, cache_dir, C, S, epochs, rate, seed, q)) for seed in (1, 2)
            ]
            for p in procs:
                p.start()
            per_job = [q.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join(60)
            total = origin.stats()["bytes_served"] - before
            report["two_jobs"].append(
                {
                    "cache_fraction": frac,
                    "cache_bytes": C,
                    "staging_bytes_per_job": S,
                    "dataset_bytes": D,
                    "epochs": epochs,
                    "origin_bytes_total": total,
                    "jobs": per_job,
                }
            )
            log(
                f"two jobs, C={frac:4.2f}D, {epochs} epochs each: origin {total / 1e6:.1f} MB in all "
                f"(dataset {D / 1e6:.1f} MB)"
            )
    report["load"] = os.getloadavg()
    return report


def summary(report: dict) -> list[dict]:
    """Steady state (epochs >= 1) per policy and budget: mean origin bytes and stall."""
    out = []
    keys = sorted({(r["cache_fraction"], r["policy"]) for r in report["runs"]})
    for frac, policy in keys:
        rows = [r for r in report["runs"] if r["cache_fraction"] == frac and r["policy"] == policy and r["epoch"] >= 1]
        if not rows:
            continue
        D = rows[0]["dataset_bytes"]
        ob = sum(r["origin_bytes"] for r in rows) / len(rows)
        out.append(
            {
                "cache_fraction": frac,
                "policy": policy,
                "origin_bytes": ob,
                "floor_bytes": rows[0]["floor_bytes"],
                "excess_over_floor": (ob - rows[0]["floor_bytes"]) / D,
                "stall_fraction": sum(r["stall_fraction"] for r in rows) / len(rows),
            }
        )
    return out
