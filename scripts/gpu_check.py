#!/usr/bin/env python
"""Check stoker's accelerator path on a machine with a CUDA GPU; prints one JSON summary.

    python scripts/gpu_check.py [--cases ../shared/cases/pillow-jpeg] [--json out.json] [--peers-images N]

Needs a CUDA build of torch, and torchvision (GPU decode_jpeg) or nvImageCodec for the decode
checks (reported as skipped otherwise). Checks:

1. ``transfer``: DeviceTransfer moves batches exactly (bytes equal after the copy), and the copy
   overlaps compute: CUDA-event times of a matmul loop alone, of the copies alone, and of both
   issued together (copies on the side stream); ``overlap`` = (compute + copy - together) /
   min(compute, copy), 1.0 = fully hidden, 0 = serialised.
2. ``decode``: every file of the shared pillow-jpeg cases through GpuJpegDecoder and through the
   CPU path (``decode_image``); per file: which path decoded it (gpu / cpu after screening / cpu
   after a GPU failure), the max abs difference from the CPU path and from the Pillow reference,
   and whether the outcome is what the cases' README expects (truncated_jpeg.jpg: an error
   naming the key; every other file: decoded, within ``--tolerance`` of the reference).
3. ``train``: RandomResizedCrop + flip on the GPU vs the CPU path on the same crops (mean diff).
4. ``loader``: Loader(run=RunOptions(device="cuda")) on a small packed dataset: batches on the GPU, equal to
   the CPU loader's batches; and Loader(image=ImageOptions(decode_device="cuda")) (JPEG decode + transform on the
   GPU in the training process): same labels, pixels within a mean abs difference of 3.
5. ``peers``: ``stoker bench peers --device cuda`` at a small size (``--peers-images``, default
   1,000 photos, 2 epochs, the emulated S3 origin): stoker with ``decode_device="cuda"`` against
   DALI's GPU pipeline (``decoders.image(device="mixed")``) on the same files; samples/s cold and
   warm, first-batch time, CPU-s per 1,000 samples. DALI runs if its virtual environment
   (~/.cache/stoker-bench/venvs/dali, made where there is a network) is there; otherwise it is
   listed as skipped with the reason. Passes when stoker delivered every epoch. ``--peers-images 0``
   leaves it out.
Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def check_transfer(device: str) -> dict:
    from stoker.loader.device.transfer import DeviceTransfer

    tr = DeviceTransfer(device)
    x = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8)
    y = torch.arange(256)
    gx, gy = tr(x, y)
    torch.cuda.synchronize()
    exact = bool(torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y))
    a = torch.randn(4096, 4096, device=device)

    def compute(n=20):
        for _ in range(n):
            a @ a

    def timed(fn):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3, time.perf_counter() - t

    compute(3)
    copies = 8
    t_compute, _ = timed(compute)
    t_copy_wall = timed(lambda: [tr(x, y) for _ in range(copies)])[1]  # side stream: wall time
    t_both = timed(lambda: (compute(), [tr(x, y) for _ in range(copies)]))[1]
    overlap = (t_compute + t_copy_wall - t_both) / max(1e-9, min(t_compute, t_copy_wall))
    return {
        "exact": exact,
        "pinned": tr.pin,
        "batch_bytes": x.nbytes,
        "compute_s": t_compute,
        "copy_s": t_copy_wall,
        "together_s": t_both,
        "overlap": overlap,
        "copy_GBps": copies * x.nbytes / t_copy_wall / 1e9,
        "ok": exact and overlap > 0.5,
    }


def check_decode(device: str, cases: str, tolerance: int) -> dict:
    from PIL import Image

    from stoker.decode import DecodeError, decode_image
    from stoker.decode.gpu import GpuJpegDecoder

    dec = GpuJpegDecoder(device)
    rows, ok = {}, True
    for name in sorted(os.listdir(cases)):
        if not name.lower().endswith((".jpg", ".jpeg")):
            continue
        data = open(os.path.join(cases, name), "rb").read()
        before = dict(dec.stats.__dict__)
        row = {}
        try:
            got = dec.decode([data], [name])[0].permute(1, 2, 0).cpu().numpy()
            path = [k for k in ("gpu", "screened", "gpu_failed") if dec.stats.__dict__[k] != before[k]]
            row["path"] = path[0] if path else "cpu"
            with Image.open(io.BytesIO(data)) as im:
                ref = np.asarray(im.convert("RGB"))
            row["max_diff_reference"] = int(np.abs(got.astype(int) - ref).max())
            row["max_diff_cpu_path"] = int(np.abs(got.astype(int) - decode_image(data, name)).max())
            row["ok"] = name != "truncated_jpeg.jpg" and row["max_diff_reference"] <= tolerance
        except DecodeError as exc:
            row["error"] = str(exc)
            row["ok"] = name == "truncated_jpeg.jpg" and name in str(exc)
        ok &= row["ok"]
        rows[name] = row
    return {"backend": dec.backend, "tolerance": tolerance, "files": rows, "stats": dec.stats.__dict__, "ok": ok}


def check_train(device: str, payloads: list) -> dict:
    from stoker.decode.transforms import decode_transform
    from stoker.decode.gpu import GpuJpegDecoder

    dec = GpuJpegDecoder(device)
    n = len(payloads)
    got = dec.train_batch(payloads, [f"s{i}" for i in range(n)], [np.random.default_rng(i) for i in range(n)])
    torch.cuda.synchronize()
    diffs = [
        np.abs(
            got[i].cpu().numpy().astype(int) - decode_transform(payloads[i], "k", "train", np.random.default_rng(i))
        ).mean()
        for i in range(n)
    ]
    t = time.perf_counter()
    reps = 5
    for _ in range(reps):
        dec.train_batch(payloads, ["k"] * n, [np.random.default_rng(i) for i in range(n)])
    torch.cuda.synchronize()
    rate = reps * n / (time.perf_counter() - t)
    return {
        "samples": n,
        "mean_abs_diff_vs_cpu": float(np.mean(diffs)),
        "max_sample_mean_diff": float(np.max(diffs)),
        "samples_per_s": rate,
        "ok": float(np.mean(diffs)) < 3.0,
    }


def check_loader(device: str, work: str) -> dict:
    from stoker.loader import ImageOptions, Loader, RunOptions
    from stoker_lab.sample_data import make_sample_data
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    make_sample_data(os.path.join(work, "data"), images=96, classes=4, seed=0)
    pack(os.path.join(work, "data", "train"), os.path.join(work, "packed"), progress=False)
    ds = open_dataset(os.path.join(work, "packed"), cache_dir=os.path.join(work, "cache"), cache_bytes=1 << 30)
    kw = dict(batch_size=32, num_workers=2, seed=0)
    with Loader(ds, **kw) as lo:
        cpu = [(x.clone(), y.clone()) for x, y in lo]
    with Loader(ds, run=RunOptions(device=device), **kw) as lo:
        gpu = [(x, y) for x, y in lo]
        stats = lo.pipeline.transfer.stats.__dict__
    on_device = all(x.is_cuda and y.is_cuda for x, y in gpu)
    equal = len(cpu) == len(gpu) and all(
        torch.equal(a.cpu(), c) and torch.equal(b.cpu(), d) for (c, d), (a, b) in zip(cpu, gpu)
    )
    out = {
        "batches": len(gpu),
        "on_device": on_device,
        "equal_to_cpu_loader": equal,
        "transfer": stats,
        "ok": on_device and equal,
    }
    try:  # decode on the GPU in the training process: same crops, pixels within a small mean difference
        with Loader(ds, image=ImageOptions(decode_device=device), **kw) as lo:
            dev = [(x, y) for x, y in lo]
            dstats = lo.device_decode_stats.__dict__
        diffs = [float((a.cpu().float() - c.float()).abs().mean()) for (c, _), (a, _) in zip(cpu, dev)]
        labels_equal = all(torch.equal(b.cpu(), d) for (_, d), (_, b) in zip(cpu, dev))
        ok = (
            len(dev) == len(cpu)
            and all(x.is_cuda for x, _ in dev)
            and labels_equal
            and max(diffs) < 3.0
            and dstats["gpu"] > 0
        )
        out["decode_device"] = {
            "batches": len(dev),
            "labels_equal": labels_equal,
            "mean_abs_diff_vs_cpu": diffs,
            "stats": dstats,
            "ok": ok,
        }
    except RuntimeError as exc:  # no GPU JPEG decoder importable
        out["decode_device"] = {"skipped": str(exc), "ok": True}
    out["ok"] = out["ok"] and out["decode_device"]["ok"]
    return out


def check_peers(work: str, images: int) -> dict:
    from stoker_lab.bench.peers.bench import PeersConfig, run_peers
    from stoker_lab.bench.peers.report import epoch_rates

    r = run_peers(
        PeersConfig(
            images=images,
            classes=10,
            epochs=2,
            device="cuda",
            loaders=("stoker", "dali"),
            workdir=os.path.join(work, "peers"),
            run_timeout_s=600,
        )
    )
    stoker_epochs = sorted(row["epoch"] for row in r["runs"] if row["loader"] == "stoker")
    return {
        "rates": epoch_rates(r),
        "cpu_s_per_1000": epoch_rates(r, "cpu_s_per_1000"),
        "runs": r["runs"],
        "skipped": r["skipped"],
        "peers": r["peers"],
        "dataset": r["dataset"],
        "ok": stoker_epochs == [0, 1],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--cases", default=os.path.join(HERE, "..", "..", "shared", "cases", "pillow-jpeg"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tolerance", type=int, default=2, help="max abs diff from the Pillow reference (cases README)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--peers-images", type=int, default=1000, help="photos for the peers check (0: leave it out)")
    a = ap.parse_args()
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        out["ok"] = False
        out["error"] = "CUDA is not available to torch"
        print(json.dumps(out, indent=2))
        return 1
    out["gpu"] = torch.cuda.get_device_name()
    checks = {"transfer": lambda: check_transfer(a.device)}
    from stoker.decode.gpu import find_backend

    try:
        find_backend(a.device)
        checks["decode"] = lambda: check_decode(a.device, a.cases, a.tolerance)
        photos = []
        with tempfile.TemporaryDirectory() as d:
            from stoker_lab.sample_data import make_sample_data

            make_sample_data(d, images=32, classes=2, seed=1)
            for root, _, files in os.walk(d):
                photos += [open(os.path.join(root, f), "rb").read() for f in sorted(files) if f.endswith(".JPEG")]
        checks["train"] = lambda: check_train(a.device, photos)
    except RuntimeError as exc:
        out["skipped"] = {"decode": str(exc), "train": str(exc)}
    work = tempfile.mkdtemp(prefix="stoker-gpu-check-")
    checks["loader"] = lambda: check_loader(a.device, work)
    if a.peers_images > 0:
        checks["peers"] = lambda: check_peers(work, a.peers_images)
    for name, fn in checks.items():
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report every check, keep going
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["ok"] = all(out[k]["ok"] for k in checks)
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
