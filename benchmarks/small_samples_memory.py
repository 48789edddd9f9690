"""Memory of small samples at scale: `pack`, `stoker.Writer`, the open index and worker PSS.

The recipe of docs/benchmarks.md, "Small samples (one million 8-byte samples)": one Parquet
column of 8-byte samples (keys ``<file stem>/<row>``) packed with ``stoker.pack(...,
source="parquet")``; ImageNet-length keys (``n01440764/n01440764_<8 digits>``, 25-26 bytes)
written with ``stoker.Writer`` (one 8-byte field); the packed dataset read by a Loader with two
workers started by fork and by spawn. Each step runs in a fresh child process; it prints its peak
RSS (``ru_maxrss``), its RSS after the imports (the interpreter's share) and, for workers, each
worker's PSS (``/proc/<pid>/smaps_rollup``) once an epoch is under way.

Usage::

    python benchmarks/small_samples_memory.py [--samples N] [--work DIR] [--json PATH] [--only pack,writer,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

from index_bench import rss_bytes  # this folder is on sys.path: the script's own (benchmarks/)

STEPS = ("pack", "writer", "open", "fork", "spawn")


def _pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def make_parquet(path: str, n: int) -> None:
    """``n`` rows of 8 bytes in column ``data``, row groups of 64k rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = np.arange(n, dtype=np.int64).view(np.uint8)
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    col = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    pq.write_table(pa.table({"data": col}), path, row_group_size=1 << 16)


def step_pack(work: str, n: int) -> dict:
    import stoker

    base = rss_bytes()
    dst = f"{work}/packed"
    shutil.rmtree(dst, ignore_errors=True)
    res = stoker.pack(f"{work}/src.parquet", dst, source="parquet", options=stoker.PackOptions(column="data"))
    assert res.samples == n, res
    return {"imports_rss": base}


def step_writer(work: str, n: int) -> dict:
    import stoker

    base = rss_bytes()
    dst = f"{work}/written"
    shutil.rmtree(dst, ignore_errors=True)
    with stoker.Writer(dst) as w:
        for i in range(n):
            w.write({"__key__": f"n{i % 1000:08d}/n{i % 1000:08d}_{i:08d}", "bin": i.to_bytes(8, "little")})
    return {"imports_rss": base}


def step_open(work: str, n: int) -> dict:
    import stoker

    tiny = f"{work}/tiny"
    if not os.path.exists(f"{tiny}/index.parquet"):
        with stoker.Writer(tiny) as w:
            w.write({"__key__": "a", "bin": b"12345678"})
    stoker.open_dataset(tiny, cache=False)  # the first open's lazy imports are not counted
    out = {}
    for name in ("packed", "written"):
        if not os.path.exists(f"{work}/{name}/index.parquet"):
            continue
        before = rss_bytes()
        ds = stoker.open_dataset(f"{work}/{name}", cache=False)
        out[f"{name}_index_rss_per_sample"] = (rss_bytes() - before) / len(ds)
        del ds
    return out


def _step_workers(work: str, n: int, method: str) -> dict:
    import stoker
    from stoker.collate import raw_bytes

    ds = stoker.open_dataset(f"{work}/packed", cache=False)
    run = stoker.RunOptions(start_method=method)
    pss: list[int] = []
    with stoker.Loader(ds, batch_size=1000, collate=raw_bytes, num_workers=2, run=run) as loader:
        seen = 0
        for k, batch in enumerate(loader):
            seen += len(batch.ids)
            if k == 50:
                pss = [_pss_bytes(p.pid) for p in loader.processes.workers]
        assert seen == len(ds), (seen, len(ds))
    return {"worker_pss": pss, "parent_pss_end": _pss_bytes(os.getpid())}


def child(step: str, work: str, n: int) -> None:
    fn = {
        "pack": step_pack,
        "writer": step_writer,
        "open": step_open,
        "fork": lambda w, k: _step_workers(w, k, "fork"),
        "spawn": lambda w, k: _step_workers(w, k, "spawn"),
    }[step]
    out = fn(work, n)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--work", default=None, help="folder for the source and datasets (default: a temporary one)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"steps, comma-separated ({', '.join(STEPS)})")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.work, a.samples)
        return
    work = a.work or tempfile.mkdtemp(prefix="stoker-small-mem-")
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(f"{work}/src.parquet"):
        make_parquet(f"{work}/src.parquet", a.samples)
    results: dict = {"samples": a.samples, "load": os.getloadavg()}
    for step in a.only.split(","):
        cmd = [sys.executable, __file__, "--child", step, "--work", work, "--samples", str(a.samples)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[step] = json.loads(out)
        print(step, results[step], "load", os.getloadavg(), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
