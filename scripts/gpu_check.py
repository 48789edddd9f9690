#!/usr/bin/env python
"""Check stoker's accelerator path on a machine with a CUDA GPU; prints one JSON summary.

    python scripts/gpu_check.py [--cases ../shared/cases/pillow-jpeg] [--json out.json] [--peers-images N]

Needs a CUDA build of torch, and torchvision (GPU decode_jpeg) or nvImageCodec for the decode
checks (reported as skipped otherwise). Checks:

1. ``transfer``: batches copied from a pinned slot (:mod:`stoker.loader.device.transfer`: the slot
   registered once with ``cudaHostRegister``, copied on the side stream) arrive exactly (bytes equal
   after the copy), and the copy overlaps compute: CUDA-event times of a matmul loop alone, of the
   copies alone, and of both issued together (copies on the side stream); ``overlap`` = (compute +
   copy - together) / min(compute, copy), 1.0 = fully hidden, 0 = serialised.
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
6. ``bytes_only``: ``collate=stoker.collate.raw_bytes`` batches (no decode) of ``--bytes-files``
   random 114,660 B samples (MLPerf Storage's ResNet-50 record), 2 workers, batch 64, warm node
   cache, to the GPU with ``device="cuda"`` (pinned slots): samples/s and host CPU cores per GPU
   over ``--steady-epochs`` warm epochs after 2 not counted (the cold fill, the first warm one).
   Cores per GPU = the CPU seconds of every process of the loader (the training process, the
   workers, the prefetcher: ``/proc`` utime + stime, ``EpochStats.cpu_s``) over the wall seconds,
   with one GPU; DLBooster's figure to compare with is "< 1 core". Passes when every byte of the
   last batch equals the dataset's and every slot was registered.
7. ``decode_device``: the same figures for ``ImageOptions(decode_device="cuda")`` (the workers only
   read bytes; nvJPEG + the train transform on the GPU) over ``--decode-images`` sample JPEGs.
Checks that need what is not there (CUDA; a GPU JPEG decoder for ``decode``, ``train`` and
``decode_device``) are listed under ``skipped`` with the reason. Exit status 0 when every check
that ran passed (also when none could run: no CUDA, ``"ok": null``), 1 otherwise.
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
    from stoker.loader.shm import SlotRing

    n, size = 256, 224
    ring = SlotRing(n, size, 2, shared=True)
    tr = DeviceTransfer(ring, device)
    x = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8)
    y = torch.arange(n)

    for i in range(2):  # the batch in both slots (written once: the copies are what is timed)
        images, labels = ring.views(i)
        images[:] = x.numpy()
        labels[:] = y.numpy()
    del images, labels

    def send():
        return tr.images(ring.acquire(), n)  # a free slot: its last copy has completed (or is waited for)

    gx, gy = send()
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
    t_copy_wall = timed(lambda: [send() for _ in range(copies)])[1]  # side stream: wall time
    t_both = timed(lambda: (compute(), [send() for _ in range(copies)]))[1]
    overlap = (t_compute + t_copy_wall - t_both) / max(1e-9, min(t_compute, t_copy_wall))
    tr.close()
    ring.close()
    pinned = tr.stats.registered > 0 and tr.stats.register_failures == 0
    return {
        "exact": exact,
        "pinned": pinned,
        "transfer": tr.stats.__dict__,
        "batch_bytes": x.nbytes,
        "compute_s": t_compute,
        "copy_s": t_copy_wall,
        "together_s": t_both,
        "overlap": overlap,
        "copy_GBps": copies * x.nbytes / t_copy_wall / 1e9,
        "ok": exact and pinned and overlap > 0.5 and tr.stats.unregistered == tr.stats.registered,
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
    unpinned = stats["unregistered"] == stats["registered"] > 0  # every slot registered, all undone at close
    out = {
        "batches": len(gpu),
        "on_device": on_device,
        "equal_to_cpu_loader": equal,
        "transfer": stats,
        "ok": on_device and equal and unpinned,
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


def steady(loader, epochs: int, warm: int = 2) -> dict:
    """Samples/s and host CPU cores per GPU of ``loader`` over ``epochs`` epochs after ``warm`` not
    counted. Each batch's tensors are touched on the GPU (a sum on the consumer's stream), and the
    device is synchronised at each epoch's end. Cores = the CPU seconds of every process of the
    loader (``EpochStats.cpu_s``: training process, workers, prefetcher) over the wall seconds."""

    def run() -> int:
        n = 0
        for batch in loader:
            first = batch[0] if isinstance(batch, tuple) else batch
            first.sum()  # queued behind the copy's event, on the consumer's stream
            n += int(first.shape[0]) if first.dim() > 1 else len(batch[2])  # (RawBatch: its ids)
        torch.cuda.synchronize()
        return n

    for _ in range(warm):  # the cold fill and the first warm epoch
        run()
    t = time.perf_counter()
    samples = sum(run() for _ in range(epochs))
    wall_s = time.perf_counter() - t
    cpu = {}
    for st in loader.history[-epochs:]:
        for k, v in st.cpu_s.items():
            cpu[k] = cpu.get(k, 0.0) + v
    total = sum(cpu.values())
    return {
        "epochs": epochs,
        "samples": samples,
        "seconds": wall_s,
        "samples_per_s": samples / wall_s,
        "cpu_s": cpu,
        "host_cores_per_gpu": total / wall_s,
        "samples_per_cpu_s": samples / total if total > 0 else None,
    }


def check_bytes_only(device: str, work: str, files: int, epochs: int) -> dict:
    from stoker.collate import raw_bytes
    from stoker.loader import Loader, RunOptions
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack
    from stoker_lab.bench.bytes_only import make_files

    sample_bytes = 114_660
    root = make_files(os.path.join(work, "bytes", "files"), files, sample_bytes)
    packed = os.path.join(work, "bytes", "packed")
    pack(os.path.join(root, "train"), packed, source="files", overwrite=True, progress=False)
    ds = open_dataset(packed, cache_dir=os.path.join(work, "bytes", "cache"), cache_bytes=1 << 30)
    kw = dict(batch_size=64, num_workers=2, drop_last=True, collate=raw_bytes)
    with Loader(ds, run=RunOptions(device=device), **kw) as lo:
        figures = steady(lo, epochs)
        last = next(iter(lo))
        torch.cuda.synchronize()
        exact = last.data.is_cuda and all(
            last.sample(j).cpu().numpy().tobytes() == ds.read(int(last.ids[j])) for j in range(len(last.ids))
        )
        stats = lo.pipeline.transfer.stats.__dict__
    pinned = stats["registered"] > 0 and stats["register_failures"] == 0
    return {
        "samples_in_dataset": files,
        "sample_bytes": sample_bytes,
        "workers": 2,
        "batch_size": 64,
        **figures,
        "GBps": figures["samples_per_s"] * sample_bytes / 1e9,
        "exact": exact,
        "transfer": stats,
        "ok": bool(exact and pinned and stats["unregistered"] == stats["registered"]),
    }


def check_decode_device(device: str, work: str, images: int, epochs: int) -> dict:
    from stoker.loader import ImageOptions, Loader
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack
    from stoker_lab.sample_data import make_sample_data

    root = os.path.join(work, "jpegs")
    make_sample_data(os.path.join(root, "data"), images=images, classes=10, seed=2)
    pack(os.path.join(root, "data", "train"), os.path.join(root, "packed"), progress=False)
    ds = open_dataset(os.path.join(root, "packed"), cache_dir=os.path.join(root, "cache"), cache_bytes=1 << 30)
    kw = dict(batch_size=64, num_workers=2, drop_last=True)
    with Loader(ds, image=ImageOptions(decode_device=device), **kw) as lo:
        figures = steady(lo, epochs)
        dstats = lo.device_decode_stats.__dict__
    return {
        "images": images,
        "workers": 2,
        "batch_size": 64,
        **figures,
        "decode": dstats,
        "ok": figures["samples"] == epochs * (len(ds) // 64) * 64 and dstats["gpu"] > 0,
    }


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


ALL_CHECKS = ("transfer", "decode", "train", "loader", "peers", "bytes_only", "decode_device")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--cases", default=os.path.join(HERE, "..", "..", "shared", "cases", "pillow-jpeg"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tolerance", type=int, default=2, help="max abs diff from the Pillow reference (cases README)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--peers-images", type=int, default=1000, help="photos for the peers check (0: leave it out)")
    ap.add_argument("--bytes-files", type=int, default=1024, help="114,660 B samples of the bytes-only check")
    ap.add_argument("--decode-images", type=int, default=1024, help="JPEGs of the decode_device check")
    ap.add_argument("--steady-epochs", type=int, default=10, help="warm epochs counted per throughput figure")
    a = ap.parse_args()
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        reason = f"CUDA is not available to torch {torch.__version__} (CUDA build: {torch.version.cuda})"
        out["skipped"] = {name: reason for name in ALL_CHECKS}
        out["ok"] = None
        print(json.dumps(out, indent=2))
        return 0
    out["gpu"] = torch.cuda.get_device_name()
    work = tempfile.mkdtemp(prefix="stoker-gpu-check-")
    checks = {
        "transfer": lambda: check_transfer(a.device),
        "bytes_only": lambda: check_bytes_only(a.device, work, a.bytes_files, a.steady_epochs),
    }
    from stoker.decode.gpu import find_backend

    try:
        find_backend(a.device)
        checks["decode_device"] = lambda: check_decode_device(a.device, work, a.decode_images, a.steady_epochs)
        checks["decode"] = lambda: check_decode(a.device, a.cases, a.tolerance)
        photos = []
        with tempfile.TemporaryDirectory() as d:
            from stoker_lab.sample_data import make_sample_data

            make_sample_data(d, images=32, classes=2, seed=1)
            for root, _, files in os.walk(d):
                photos += [open(os.path.join(root, f), "rb").read() for f in sorted(files) if f.endswith(".JPEG")]
        checks["train"] = lambda: check_train(a.device, photos)
    except RuntimeError as exc:
        out["skipped"] = {"decode": str(exc), "train": str(exc), "decode_device": str(exc)}
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
