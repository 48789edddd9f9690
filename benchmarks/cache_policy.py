"""Cache policy benchmark: origin bytes per epoch and data stall for each budget and policy.

Theory (issue 4): when every sample is read once per epoch, no policy can read fewer than
D - C bytes per epoch from the origin (D dataset bytes, C the budget, C < D). stoker's
default (``noevict``: admit until full, then stage the rest just in time) should sit on that
floor; LRU thrashes under epoch-random access. Run:

    .venv/bin/python benchmarks/cache_policy.py --json benchmarks/cache_policy.json

Uses the demo's sample data and the emulated S3 origin (20 ms, 100 MB/s) on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.1")
    ap.add_argument("--policies", default="noevict,lru")
    ap.add_argument("--consumer-rate", type=float, default=800.0)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--staging-bytes", type=int, default=16 << 20,
                    help="loader staging budget (kept small here so it cannot hold D - C)")
    ap.add_argument("--cache-aware-window", type=int, default=0,
                    help="also run the default policy with the cache-aware order, this window (samples)")
    ap.add_argument("--json")
    a = ap.parse_args()

    from stoker import Loader, open_dataset, pack
    from stoker.bench.harness import measure
    from stoker.bench.origin import LocalS3Origin, upload_tree
    from stoker.sample_data import make_sample_data

    work = os.path.join(tempfile.gettempdir(), "stoker-cache-bench")
    data = os.path.join(work, "data")
    make_sample_data(data, images=a.images, classes=10, seed=0)
    rows = []
    with LocalS3Origin(latency_ms=20, bandwidth_MBps=100) as origin:
        direct = origin.storage_options(throttled=False)
        upload_tree(os.path.join(data, "train"), origin.url("raw"), direct)
        pack(origin.url("raw"), origin.url("packed"), src_options=direct, dst_options=direct, progress=False)
        opts = origin.storage_options()
        probe = open_dataset(origin.url("packed"), cache=False, storage_options=opts, block_bytes=a.block_size)
        D = probe.index.total_bytes
        for frac in [float(f) for f in a.fractions.split(",")]:
            C = int(frac * D)
            runs = [(p, 0) for p in a.policies.split(",")]
            if a.cache_aware_window:
                runs.append(("noevict", a.cache_aware_window))
            for policy, caw in runs:
                cache_dir = os.path.join(work, "cache")
                shutil.rmtree(cache_dir, ignore_errors=True)
                ds = open_dataset(origin.url("packed"), cache_dir=cache_dir, cache_bytes=C, cache_policy=policy,
                                  storage_options=opts, block_bytes=a.block_size)
                with Loader(ds, 64, num_workers=2, seed=0, staging_bytes=a.staging_bytes,
                            cache_aware_window=caw) as loader:
                    for epoch in range(a.epochs):
                        m = measure(loader, a.consumer_rate)
                        st = loader.stats
                        row = {"policy": policy, "cache_aware_window": caw,
                               "order_displacement": st.order_displacement, "budget_fraction": frac, "cache_bytes": C, "dataset_bytes": D,
                               "floor_bytes": max(0, D - C), "epoch": epoch, "origin_bytes": st.origin_bytes,
                               "origin_requests": st.origin_requests, "hit_ratio": st.cache_hit_ratio,
                               "stall_fraction": m.stall_fraction, "samples_per_s": m.samples_per_s,
                               "exactly_once": st.exactly_once, "evictions": st.evictions,
                               "staged_hits": st.staged_hits, "direct_reads": st.direct_reads}
                        rows.append(row)
                        print(f"{policy + ('+ca' if caw else ''):10} C={frac:4.2f}D epoch {epoch}: origin {st.origin_bytes / 1e6:7.1f} MB "
                              f"(floor {max(0, D - C) / 1e6:6.1f}) hit {st.cache_hit_ratio:.2f} "
                              f"stall {m.stall_fraction:.3f} {m.samples_per_s:6.0f}/s"
                              + (f" displacement {st.order_displacement:.1f}" if caw else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"consumer_rate": a.consumer_rate, "staging_bytes": a.staging_bytes,
                       "origin": {"latency_ms": 20, "bandwidth_MBps": 100},
                       "cores": os.cpu_count(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
