"""Bytes-only Loader over a warm node cache: the steady-state CPU of every process, per sample.

The setup of ``stoker bench io --only-bytes`` (:mod:`stoker_lab.bench.bytes_only`): ``FILES`` random
``.npy`` files of 114,660 B (MLPerf Storage's ResNet-50 record), packed on local disk, read through
a fresh node cache by a Loader with 2 workers, batch 64, ``drop_last``, shuffle on. Two outputs:

* ``generic``: the user's ``decode=np.frombuffer`` and ``collate=np.stack`` (what the bench runs);
* ``raw``: ``collate=stoker.collate.raw_bytes`` without decode: the batch read straight into its
  slot (:mod:`stoker.loader.workers.rawbatch`).

The first 2 epochs (the cold fill and the first warm one) are not counted. Then one run of ``SHORT``
warm epochs and one of ``LONG``, on the same Loader, each timed per process from ``/proc/<pid>/stat``
(utime + stime, clock ticks): the training process, each worker, the prefetcher. The steady-state
figure is the difference of the two runs, divided by the difference in samples, so a fixed cost
per run (the first batches, the iterator) cancels out; it has ``(LONG - SHORT) * samples`` of CPU
behind it (about 10 CPU-s with the defaults).

Usage: ``python benchmarks/bytes_only_steady.py [generic|raw] [SHORT] [LONG] [--profile SECONDS]``.
With ``--profile``, py-spy records each worker and the training process for that many seconds
in the middle of a long run (``py-spy record --native -f raw``), into ``/tmp/bytes-only-profile``.
Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

FILES, SAMPLE_BYTES, WORKERS, BATCH = 1024, 114_660, 2, 64
ROOT = os.environ.get("BYTES_ONLY_ROOT", "/tmp/bytes-only-steady")
_TICK = os.sysconf("SC_CLK_TCK")


def raw_array(fields, rng):
    """The user's decode of the bench: the sample's bytes as a uint8 array (no copy)."""
    return np.frombuffer(next(iter(fields.values())), np.uint8)


def stack(samples):
    """The user's collate of the bench: one (batch, sample_bytes) uint8 array."""
    return np.stack(samples)


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def snapshot(loader) -> dict:
    """CPU seconds now of the training process, each worker and the prefetcher."""
    procs = loader.processes
    out = {"training": cpu_s(os.getpid())}
    for k, p in enumerate(procs.workers):
        out[f"worker{k}"] = cpu_s(p.pid)
    if procs.prefetcher is not None:
        out["prefetcher"] = cpu_s(procs.prefetcher.pid)
    return out


def epochs(loader, n: int, mode: str) -> tuple[int, float, dict]:
    """Run ``n`` epochs, touching every batch: (samples, wall seconds, CPU seconds per process)."""
    c0, t0, samples = snapshot(loader), time.perf_counter(), 0
    for _ in range(n):
        for batch in loader:
            samples += len(batch) if mode == "generic" else len(batch.ids)
    t, c1 = time.perf_counter() - t0, snapshot(loader)
    return samples, t, {k: c1[k] - c0[k] for k in c0}


def profile(loader, seconds: float) -> None:
    """py-spy records of each worker and the training process while epochs run (raw folded stacks)."""
    import threading

    out = "/tmp/bytes-only-profile"
    os.makedirs(out, exist_ok=True)
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    pids = {"training": os.getpid()} | {f"worker{k}": p.pid for k, p in enumerate(loader.processes.workers)}
    stop = threading.Event()
    procs = [
        subprocess.Popen(
            [
                spy,
                "record",
                "--native",
                "-r",
                "500",
                "-d",
                str(int(seconds)),
                "-f",
                "raw",
                "-o",
                f"{out}/{name}.txt",
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]

    def wait():
        for p in procs:
            p.wait()
        stop.set()

    threading.Thread(target=wait, daemon=True).start()
    while not stop.is_set():
        for _ in loader:
            pass


def main() -> None:
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack
    from stoker_lab.bench.bytes_only import make_files

    args = sys.argv[1:]
    prof = None
    if "--profile" in args:
        i = args.index("--profile")
        prof = float(args[i + 1])
        del args[i : i + 2]
    mode = args[0] if args else "generic"
    short, long_ = (int(args[1]), int(args[2])) if len(args) > 2 else (10, 40)
    import torch  # noqa: F401 - a training process has it imported already

    files = make_files(f"{ROOT}/files", FILES, SAMPLE_BYTES)
    packed = f"{ROOT}/packed"
    if not os.path.exists(f"{packed}/index.parquet"):
        pack(f"{files}/train", packed, source="files", overwrite=True, progress=False)
    cache = f"{ROOT}/cache-{os.getpid()}"
    shutil.rmtree(cache, ignore_errors=True)
    ds = open_dataset(packed, cache, 1 << 30)
    from stoker.collate import raw_bytes

    kw = {"decode": raw_array, "collate": stack} if mode == "generic" else {"collate": raw_bytes}
    report: dict = {
        "mode": mode,
        "files": FILES,
        "sample_bytes": SAMPLE_BYTES,
        "workers": WORKERS,
        "batch_size": BATCH,
        "cores": os.cpu_count(),
    }
    try:
        with Loader(ds, BATCH, num_workers=WORKERS, seed=0, drop_last=True, **kw) as loader:
            epochs(loader, 2, mode)  # the cold fill and the first warm epoch
            if prof is not None:
                profile(loader, prof)
                report["profile"] = "/tmp/bytes-only-profile"
            runs = {}
            for n in (short, long_):
                samples, t, cpu = epochs(loader, n, mode)
                runs[n] = {"samples": samples, "seconds": t, "cpu_s": cpu, "samples_per_s": samples / t}
            ds_n = runs[long_]["samples"] - runs[short]["samples"]
            diff = {k: runs[long_]["cpu_s"][k] - runs[short]["cpu_s"][k] for k in runs[short]["cpu_s"]}
            total = sum(diff.values())
            report["runs"] = runs
            report["steady"] = {
                "samples": ds_n,
                "cpu_s": diff,
                "us_per_sample": {k: 1e6 * v / ds_n for k, v in diff.items()},
                "samples_per_cpu_s": ds_n / total if total > 0 else None,
            }
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
