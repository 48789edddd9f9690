"""`stoker demo`: the main job end to end on real photographs, measured against the standard recipe.

Steps (one run, one machine): make the embedded sample data; start the emulated
remote origin (moto's S3 server behind a throttling proxy); upload the raw
ImageFolder tree; pack it into the origin; calibrate the limits (single-process
decode rate from memory, origin bandwidth / mean sample bytes); then measure the
baseline (torch DataLoader + fsspec + Pillow) and stoker (3 epochs: cold, warm,
warm), each with a consumer that takes no time and with an emulated accelerator.

The decode rate is timed in short rounds, stoker's recipe and Pillow's taking turns
(:func:`stoker_lab.decode_rate.measure_decode_rounds`), at three points of the run: after packing,
right before stoker's epochs with a consumer that takes no time, and right after them (the
loader closed, so nothing else decodes). The limits use the median of all the rounds
(:data:`CALIBRATION_ROUNDS`) in samples per CPU-second of the decoding thread, so the checks
against the decode bound rest neither on one moment of a shared machine nor on the share of a
core that other processes left the calibration; the rounds bracket the epochs they are compared
with. The report keeps each round's wall rate too, and the workers' share of the cores in each
epoch (``workers_cpu_share``), which says when a timing miss was the machine's load.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass

from stoker.loader.epoch_stats import process_cpu_s

from .harness import measure

QUICK = {"images": 1500, "classes": 10, "baseline_samples": 384}
FULL = {"images": 5000, "classes": 20, "baseline_samples": 1024}
#: Named origins: (per-request latency in ms, bandwidth in MB/s). ``near``: the demo's default (an
#: origin in the same region); ``far``: another region, or S3's first-byte latency at its tail.
ORIGINS = {"near": (20.0, 100.0), "far": (100.0, 1000.0)}
#: Timed decode rounds per recipe at each calibration point: after packing, before stoker's
#: epochs, after them (:func:`run_demo`); each round at least :data:`ROUND_S` seconds.
CALIBRATION_ROUNDS = {"start": 3, "before": 2, "after": 2}
ROUND_S = 0.5


def origin_settings(origin: str | None, latency_ms: float | None, bandwidth_MBps: float | None) -> tuple[float, float]:
    """(latency ms, bandwidth MB/s) of the named ``origin`` preset (:data:`ORIGINS`; None = ``near``),
    with an explicit ``latency_ms`` / ``bandwidth_MBps`` taking precedence. ValueError for an
    unknown name."""
    if origin is not None and origin not in ORIGINS:
        raise ValueError(f"unknown origin preset {origin!r}; known: {sorted(ORIGINS)}")
    lat, bw = ORIGINS[origin or "near"]
    return (lat if latency_ms is None else float(latency_ms), bw if bandwidth_MBps is None else float(bandwidth_MBps))


@dataclass
class DemoConfig:
    """Demo parameters. Bytes in bytes, rates in samples/s, latency in ms, bandwidth in MB/s (1e6 B/s)."""

    quick: bool = False
    images: int | None = None
    classes: int | None = None
    seed: int = 0
    latency_ms: float = 20.0
    bandwidth_MBps: float = 100.0
    workers: int = 2
    batch_size: int = 64
    epochs: int = 3
    consumer_rate: float = 800.0
    block_bytes: int = 1 << 20
    shard_bytes: int = 64 << 20
    baseline_samples: int | None = None
    baseline: bool = True  # measure the torch DataLoader baseline too
    origin: str | None = None  # the preset's name, recorded in the report (origin_settings())
    workdir: str | None = None
    json_path: str | None = None
    plot_path: str | None = None


def _log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def decode_limits(rounds: dict, workers: int, storage_bound: float) -> dict:
    """The report's ``limits`` from the calibration rounds so far (``{"stoker": [DecodeRound, ...],
    "pillow": [...]}``, :func:`stoker_lab.decode_rate.measure_decode_rounds`): the per-core rates are
    the medians of the rounds' samples per CPU-second of the decoding thread (one core's rate
    with the core to itself, which the machine's other load does not move), ``decode_bound`` =
    the stoker median x ``workers``; every round's CPU and wall rates are kept beside them."""
    from stoker_lab.decode_rate import median_rate

    cpu = {k: [r.cpu_rate for r in v] for k, v in rounds.items()}
    per_core = median_rate(cpu["stoker"])
    return {
        "decode_per_core": per_core,
        "decode_per_core_rounds": [round(r, 1) for r in cpu["stoker"]],
        "decode_per_core_wall_rounds": [round(r.wall_rate, 1) for r in rounds["stoker"]],
        "pillow_per_core": median_rate(cpu["pillow"]),
        "pillow_per_core_rounds": [round(r, 1) for r in cpu["pillow"]],
        "calibration": (
            f"median of {len(cpu['stoker'])} interleaved rounds of >= {ROUND_S} s per recipe, "
            "samples per CPU-second of one process"
        ),
        "workers": workers,
        "decode_bound": per_core * workers,
        "storage_bound": storage_bound,
    }


def run_demo(cfg: DemoConfig) -> dict:
    """Run the demo; returns the report dict (also written to ``cfg.json_path``)."""
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack
    from stoker_lab.decode_rate import measure_decode_rounds

    from ..sample_data import make_sample_data
    from .baseline import FsspecImageFolder, make_baseline_loader
    from .origin import ORIGIN_NICE, LocalS3Origin, upload_tree
    from .report import check_done, print_table, save_report, write_plot

    preset = QUICK if cfg.quick else FULL
    images = cfg.images or preset["images"]
    classes = cfg.classes or preset["classes"]
    baseline_samples = cfg.baseline_samples or preset["baseline_samples"]
    workdir = cfg.workdir or os.path.join(tempfile.gettempdir(), "stoker-demo")
    os.makedirs(workdir, exist_ok=True)
    data_dir = os.path.join(workdir, "data")

    _log(f"sample data: {images} images, {classes} classes -> {data_dir}")
    sd = make_sample_data(data_dir, images=images, classes=classes, seed=cfg.seed)
    _log(f"  {sd['images']} images, {sd['bytes'] / 1e6:.1f} MB")

    report: dict = {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "origin": {
            "preset": cfg.origin,
            "latency_ms": cfg.latency_ms,
            "bandwidth_MBps": cfg.bandwidth_MBps,
            "server": "moto S3 on 127.0.0.1 behind a throttling TCP proxy",
            "server_nice": ORIGIN_NICE,
        },
        "config": {
            "workers": cfg.workers,
            "batch_size": cfg.batch_size,
            "epochs": cfg.epochs,
            "consumer_rate": cfg.consumer_rate,
            "block_bytes": cfg.block_bytes,
            "shard_bytes": cfg.shard_bytes,
            "transform": "train (RandomResizedCrop(224) + flip)",
            "quick": cfg.quick,
        },
        "runs": [],
    }
    with LocalS3Origin(latency_ms=cfg.latency_ms, bandwidth_MBps=cfg.bandwidth_MBps) as origin:
        _log(f"origin: {origin.endpoint_url} (latency {cfg.latency_ms} ms, {cfg.bandwidth_MBps} MB/s)")
        raw_url, packed_url = origin.url("raw/train"), origin.url("packed/train")
        t = time.perf_counter()
        upload_tree(os.path.join(data_dir, "train"), raw_url, origin.storage_options(throttled=False))
        _log(f"uploaded raw tree in {time.perf_counter() - t:.1f} s")
        pr = pack(
            raw_url,
            packed_url,
            shard_bytes=cfg.shard_bytes,
            overwrite=True,
            storage_options=origin.storage_options(throttled=False),
            progress=False,
        )
        _log(f"packed {pr.samples} samples into {pr.shards} shards in {pr.seconds:.1f} s")
        opts = origin.storage_options(throttled=True)

        # Calibration: decode rate from memory on the same files; origin limit.
        probe = open_dataset(packed_url, storage_options=opts, cache=False)
        n = len(probe)
        mean_bytes = probe.index.total_bytes / n
        local = [os.path.join(data_dir, "train", f"{probe.key(i)}.JPEG") for i in range(0, n, max(1, n // 300))]
        payloads = [open(p, "rb").read() for p in local if os.path.exists(p)]
        rounds: dict[str, list] = {"stoker": [], "pillow": []}

        def calibrate(point: str) -> None:
            got = measure_decode_rounds(payloads, CALIBRATION_ROUNDS[point], round_seconds=ROUND_S)
            for recipe, timed in got.items():
                rounds[recipe] += timed

            def show(recipe: str) -> str:
                return ", ".join(f"{r.cpu_rate:.0f} ({r.wall_rate:.0f})" for r in got[recipe])

            _log(
                f"decode rounds ({point}), samples per CPU-second (per wall second): "
                f"stoker {show('stoker')}; Pillow {show('pillow')}"
            )

        calibrate("start")
        storage_bound = cfg.bandwidth_MBps * 1e6 / mean_bytes
        report["dataset"] = {
            "samples": n,
            "bytes": int(probe.index.total_bytes),
            "classes": len(probe.index.classes),
            "mean_sample_bytes": mean_bytes,
            "shards": pr.shards,
            "version": probe.version,
        }
        lim = report["limits"] = decode_limits(rounds, cfg.workers, storage_bound)
        _log(
            f"limits so far: decode {lim['decode_per_core']:.0f}/s per core (Pillow {lim['pillow_per_core']:.0f}), "
            f"decode_bound {lim['decode_bound']:.0f}/s, storage_bound {storage_bound:.0f}/s"
        )
        rates = [0.0] + ([cfg.consumer_rate] if cfg.consumer_rate > 0 else [])

        # Baseline: torch DataLoader + fsspec + Pillow, through the same throttled origin.
        base_ds = FsspecImageFolder(raw_url, opts, seed=cfg.seed)
        for rate in rates if cfg.baseline else []:
            before = origin.stats()
            loader = make_baseline_loader(base_ds, cfg.batch_size, cfg.workers, cfg.seed)
            m = measure(loader, rate, max_samples=baseline_samples)
            del loader
            after = origin.stats()
            report["runs"].append(
                _run("baseline", 0, rate, m, after.get("bytes_served", 0) - before.get("bytes_served", 0), None, None)
            )
            _log(
                f"baseline rate={rate:.0f}: {m.samples_per_s:.0f} samples/s"
                + (f", stall {m.stall_fraction:.2f}" if rate else "")
            )

        # stoker: cold epoch then warm epochs, a fresh cache per consumer setting; the decode rate
        # timed again right before and right after the epochs with no consumer.
        for rate in rates:
            if rate == 0:
                calibrate("before")
            cache_dir = os.path.join(workdir, f"cache-{int(rate)}")
            shutil.rmtree(cache_dir, ignore_errors=True)
            ds = open_dataset(
                packed_url,
                cache_dir=cache_dir,
                cache_bytes=2 * pr.shard_bytes + (64 << 20),
                storage_options=opts,
                block_bytes=cfg.block_bytes,
            )
            with Loader(ds, cfg.batch_size, num_workers=cfg.workers, seed=cfg.seed, transform="train") as loader:
                for epoch in range(cfg.epochs):
                    origin_cpu = process_cpu_s(origin.pid)
                    m = measure(loader, rate)
                    st = loader.stats
                    cpu = dict(st.cpu_s, origin_emulator=round(process_cpu_s(origin.pid) - origin_cpu, 3))
                    report["runs"].append(
                        _run(
                            "stoker",
                            epoch,
                            rate,
                            m,
                            st.origin_bytes,
                            st.cache_hit_ratio,
                            st.exactly_once,
                            origin_requests=st.origin_requests,
                            cpu_s=cpu,
                            decode_cpu_s=st.decode_cpu_s,
                            **loader_figures(st),
                        )
                    )
                    _log(
                        f"stoker epoch {epoch} rate={rate:.0f}: {m.samples_per_s:.0f} samples/s, "
                        + (f"stall {m.stall_fraction:.2f}, " if rate else "")
                        + f"origin {st.origin_bytes / 1e6:.1f} MB, "
                        f"hit ratio {st.cache_hit_ratio:.2f}, first batch {st.first_batch_s:.2f} s, "
                        f"in flight {st.inflight_requests:.1f} (target {st.inflight_target}), "
                        f"exactly_once {st.exactly_once}"
                    )
            shutil.rmtree(cache_dir, ignore_errors=True)
            if rate == 0:
                calibrate("after")
    lim = report["limits"] = decode_limits(rounds, cfg.workers, storage_bound)
    _log(
        f"limits: decode {lim['decode_per_core']:.0f}/s per core ({lim['calibration']}; "
        f"{min(lim['decode_per_core_rounds']):.0f}-{max(lim['decode_per_core_rounds']):.0f}), "
        f"Pillow {lim['pillow_per_core']:.0f}/s, "
        f"decode_bound {lim['decode_bound']:.0f}/s, storage_bound {storage_bound:.0f}/s"
    )
    for r in report["runs"]:
        if r["loader"] == "stoker":
            r.update(bound_figures(r, lim, cfg.bandwidth_MBps))
    report["checks"] = check_done(report)
    print_table(report)
    save_report(report, cfg.json_path, cfg.plot_path, write_plot, _log)
    return report


def _run(loader: str, epoch: int, rate: float, m, origin_bytes, hit_ratio, exactly_once, **extra) -> dict:
    return {
        "loader": loader,
        "epoch": epoch,
        "consumer_rate": rate,
        "samples": m.samples,
        "seconds": m.seconds,
        "samples_per_s": m.samples_per_s,
        "stall_fraction": m.stall_fraction,
        "origin_bytes": int(origin_bytes),
        "cache_hit_ratio": hit_ratio,
        "exactly_once": exactly_once,
        **extra,
    }


def loader_figures(st) -> dict:
    """The cold-start figures the loader measured in one epoch: ``first_batch_s``,
    ``origin_busy_fraction``, ``inflight_requests`` and ``inflight_target`` (``st``: the epoch's
    :class:`stoker.loader.epoch_stats.EpochStats`)."""
    return {
        "first_batch_s": st.first_batch_s,
        "origin_busy_fraction": st.origin_busy_fraction,
        "inflight_requests": st.inflight_requests,
        "inflight_target": st.inflight_target,
    }


def bound_figures(run: dict, limits: dict, bandwidth_MBps: float) -> dict:
    """One measured epoch (a run of the report: ``samples``, ``seconds``, ``samples_per_s``,
    ``origin_bytes``) against the calibrated limits: ``overlap_efficiency`` (max(origin bytes /
    bandwidth, samples / decode_bound) / seconds, stoker's design notes) and ``vs_bound``
    (samples/s / min(decode_bound, storage_bound)), and from the workers' CPU seconds
    (``cpu_s.workers``) ``workers_cpu_share`` (CPU seconds / (workers x seconds): the cores they
    got) and ``samples_per_worker_cpu_s``. Computed once every calibration round is in."""
    from stoker.loader.epoch_stats import overlap_efficiency

    bound = min(limits["decode_bound"], limits["storage_bound"])
    decode_s = run["samples"] / limits["decode_bound"] if limits["decode_bound"] else 0.0
    workers_cpu = run.get("cpu_s", {}).get("workers", 0.0)
    return {
        "overlap_efficiency": overlap_efficiency(run["seconds"], run["origin_bytes"], bandwidth_MBps * 1e6, decode_s),
        "vs_bound": run["samples_per_s"] / bound if bound else 0.0,
        # the cores the workers got (1: each worker on a core all epoch) and what they did with them
        "workers_cpu_share": workers_cpu / (limits["workers"] * run["seconds"]) if run["seconds"] else 0.0,
        "samples_per_worker_cpu_s": run["samples"] / workers_cpu if workers_cpu else 0.0,
    }
