"""Cold epochs (decode off) of the sample tree that `stoker bench io` made: the prefetcher's CPU-s/GB per
epoch and its split over its threads (the loop's main thread against the fill and obstore threads), from
/proc/<pid>/task/*/schedstat (nanoseconds on CPU; the clock-tick figures of /proc/.../stat round each
thread to 10 ms). A fresh Loader and cache per epoch, as the cold epoch of `stoker bench io`.

Usage: python io_prefetch_threads.py EPOCHS LATENCY_MS BANDWIDTH_MBPS [DATA_DIR]. Data: DATA_DIR/train
(default /tmp/stoker-bench-io/data, the tree `stoker bench io` makes)."""
import os
import shutil
import sys

from stoker.loader import Loader
from stoker.store.dataset import open_dataset
from stoker.store.pack import pack
from stoker_lab.bench.io_bench import keep_list, raw_bytes
from stoker_lab.bench.origin import LocalS3Origin, upload_tree


def threads(pid: int) -> dict:
    """{tid: (name, CPU seconds)} of process ``pid``'s threads now."""
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[t] = (name, int(f.read().split()[0]) / 1e9)
        except OSError:
            pass
    return out


def main(epochs: int, lat: float, bw: float, data: str = "/tmp/stoker-bench-io/data") -> None:
    with LocalS3Origin(latency_ms=lat, bandwidth_MBps=bw) as origin:
        url = origin.url("packed/train")
        upload_tree(f"{data}/train", origin.url("raw/train"), origin.storage_options(False))
        pack(origin.url("raw/train"), url, shard_bytes=16 << 20, overwrite=True,
             storage_options=origin.storage_options(False), progress=False)
        tot = {"prefetch": 0.0, "bytes": 0, "main_thr": 0.0, "other_thr": 0.0, "reqs": 0}
        for e in range(epochs):
            cdir = f"/tmp/stoker-prefetch-threads/cache{os.getpid()}_{e}"
            shutil.rmtree(cdir, ignore_errors=True)
            ds = open_dataset(url, cdir, 200 << 20, storage_options=origin.storage_options(True), block_bytes=1 << 20)
            with Loader(ds, 64, num_workers=2, seed=e, decode=raw_bytes, collate=keep_list) as loader:
                it = iter(loader)  # starts the processes (and waits for them); the epoch starts at next()
                pid = loader.processes.prefetcher.pid
                before = threads(pid)
                for _ in it:
                    pass
                s = loader.stats
                after = threads(pid)
            thr = {k: (n, v - before.get(k, (n, 0.0))[1]) for k, (n, v) in after.items()}
            main_s = thr.get(str(pid), ("", 0.0))[1]
            other_s = sum(v for k, (_, v) in thr.items() if k != str(pid))
            tot["prefetch"] += s.cpu_s.get("prefetch", 0)
            tot["bytes"] += s.origin_bytes
            tot["reqs"] += s.origin_requests
            tot["main_thr"] += main_s
            tot["other_thr"] += other_s
            by_name: dict = {}
            for k, (n, v) in thr.items():
                if k != str(pid):
                    by_name[n] = by_name.get(n, 0.0) + v
            print("  threads by name:", {n: round(v, 3) for n, v in sorted(by_name.items())}, flush=True)
            print(f"epoch {e}: {s.seconds:.2f}s first {s.first_batch_s:.2f} origin {s.origin_bytes / 1e6:.1f}MB "
                  f"reqs {s.origin_requests} cpu {s.cpu_s} threads main {main_s:.3f} other {other_s:.3f} "
                  f"n={len(thr)}", flush=True)
            shutil.rmtree(cdir, ignore_errors=True)
        gb = tot["bytes"] / 1e9
        print(f"RESULT prefetch_cpu_s_per_GB {tot['prefetch'] / gb:.2f} (threads over the epochs: main "
              f"{tot['main_thr'] / gb:.2f} other {tot['other_thr'] / gb:.2f} CPU-s/GB) reqs {tot['reqs']}")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:5])
