"""Cold epochs (decode off) of the sample tree that `stoker bench io` made, for profiling the prefetcher.

Usage: python io_profile_cold.py OUT|- EPOCHS LATENCY_MS BANDWIDTH_MBPS (OUT: py-spy raw stacks of each epoch's
prefetcher go to OUT.<epoch>.txt; -: none). Data: $STOKER_IO_DATA or $TMPDIR/stoker-bench-io/data/train."""

import gc, os, shutil, subprocess, sys, time
from stoker_lab.bench.io_bench import raw_bytes, keep_list
from stoker_lab.bench.origin import LocalS3Origin, upload_tree
from stoker.store.pack import pack
from stoker.store.dataset import open_dataset
from stoker.loader import Loader
from stoker.loader.epoch_stats import process_cpu_s

if __name__ == "__main__":
    out = sys.argv[1]
    epochs = int(sys.argv[2])
    lat = float(sys.argv[3])
    bw = float(sys.argv[4])
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    with LocalS3Origin(latency_ms=lat, bandwidth_MBps=bw) as origin:
        url = origin.url("packed/train")
        upload_tree(
            os.environ.get(
                "STOKER_IO_DATA", os.path.join(__import__("tempfile").gettempdir(), "stoker-bench-io", "data", "train")
            ),
            origin.url("raw/train"),
            origin.storage_options(False),
        )
        pack(
            origin.url("raw/train"),
            url,
            shard_bytes=16 << 20,
            overwrite=True,
            storage_options=origin.storage_options(False),
            progress=False,
        )
        tot = {"prefetch": 0.0, "workers": 0.0, "main": 0.0, "bytes": 0, "secs": 0.0, "origin": 0.0}
        for e in range(epochs):
            cdir = f"/tmp/prof/cache{e}"
            shutil.rmtree(cdir, ignore_errors=True)
            ds = open_dataset(url, cdir, 200 << 20, storage_options=origin.storage_options(True))
            with Loader(ds, 64, num_workers=2, seed=e, decode=raw_bytes, collate=keep_list) as loader:
                it = iter(loader)
                first = next(it)
                pid = loader.processes.prefetcher.pid
                print("PREFETCHER", pid, flush=True)
                o0 = process_cpu_s(origin.pid)
                p = (
                    subprocess.Popen(
                        [spy, "record", "-r", "200", "-f", "raw", "-o", f"{out}.{e}.txt", "--pid", str(pid)] + os.environ.get("SPY_ARGS", "").split(),
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    if out != "-"
                    else None
                )
                t0 = time.perf_counter()
                for b in it:
                    pass
                print("PFTIDS", ",".join(os.listdir(f"/proc/{pid}/task")), flush=True)
                s = loader.stats
                if p:
                    p.send_signal(2)
                    p.wait()
                tot["origin"] += process_cpu_s(origin.pid) - o0
                for k in ("prefetch", "workers", "main"):
                    tot[k] += s.cpu_s.get(k, 0)
                tot["bytes"] += s.origin_bytes
                tot["secs"] += s.seconds
                print(
                    f"epoch {e}: {s.seconds:.2f}s first {s.first_batch_s:.2f} origin {s.origin_bytes / 1e6:.1f}MB cpu {s.cpu_s} reqs {s.origin_requests}",
                    flush=True,
                )
            shutil.rmtree(cdir, ignore_errors=True)
        gb = tot["bytes"] / 1e9
        print({k: (v / gb if k not in ("bytes", "secs") else v) for k, v in tot.items()})
