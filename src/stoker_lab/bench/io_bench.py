"""``stoker bench io``: the CPU-seconds per GB and GB/s of each stage of the byte path, beside its floor.

One run, one machine, the same bytes for every stage (stoker's design notes, "Measuring"):

1. sample photos (:func:`stoker_lab.sample_data.make_sample_data`) packed into the emulated S3
   origin (:class:`stoker_lab.bench.origin.LocalS3Origin`);
2. the stages (:mod:`stoker_lab.bench.io_stages`), each against its floor: origin -> memory (obstore
   and s3fs; the origin's direct endpoint, no latency or bandwidth cap, so that the client's CPU is
   what is measured), the fill's checksum pass, memory -> cache tier (disk and shared memory),
   cache tier -> worker; with ``peer`` the peer stage (a peer's cache service's data endpoint to a
   rank on Ray and to a worker process of it, over loopback and over a shaped link between network
   namespaces, each end's CPU beside a bare TCP ``sendfile``/``recv_into`` of the same blocks:
   :mod:`stoker_lab.bench.peer_stage`), else its row says it was left out;
3. the whole cold epoch with decode off (a ``decode=`` that returns the raw bytes), through the
   throttled origin (``latency_ms``, ``bandwidth_MBps``), then a warm epoch: samples/s per core,
   CPU-s/GB per process kind, the prefetcher's CPU over the origin bytes
   (``origin_to_cache_cpu_s_per_GB``), the emulated origin's own CPU apart
   (``emulated_origin_cpu_s_per_GB``), and the decode workers' CPU per sample cold over warm
   (``cold_vs_warm_worker_cpu``). The prefetcher's floor is ``link_floor``: a bare GET + write
   loop of the same blocks through the same throttled endpoint, in a fresh process, before and
   after the epochs (:func:`stoker_lab.bench.io_stages.link_floor`).

4. ``bytes_only`` (:mod:`stoker_lab.bench.bytes_only`): what a bytes-only training job gets, in the
   steady state (:mod:`stoker_lab.bench.steady_state`: the CPU of every process as the difference of
   a short and a long run of warm epochs, at least ``bytes_only_min_epochs`` warm epochs and, where
   it can, ``bytes_only_min_cpu_s`` CPU-seconds behind each figure; the first epochs reported
   apart), on 114,660 B samples: stoker with a per-sample decode, stoker's ragged and fixed-shape
   raw batches, a plain torch DataLoader over the same bytes as ``.npy`` files, DLIO's PyTorch
   reader as released and without its per-sample debug string, and the floor (bare ``os.preadv``
   into a reused buffer). ``bytes_only_files=0`` leaves it out; ``only_bytes`` measures it alone.

``quick`` (:func:`quick`): every part at a size a test runs in well under a minute.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

from stoker.loader.epoch_stats import process_cpu_s

from . import io_stages as st

GB = 1e9


@dataclass
class IoConfig:
    """``images``: sample photos (about 65 kB each on average: 4,600 are about 300 MB);
    ``latency_ms`` / ``bandwidth_MBps``: the throttled origin of the cold epoch; ``block_bytes``: the
    cache unit; ``concurrency``: ranged GETs in flight in the origin stage (the loader's default
    ``fetch_concurrency``); ``reps``: runs of each loop (alternating, the least CPU kept);
    ``workers`` / ``batch_size``: the cold epoch's Loader and every reader of ``bytes_only``;
    ``bytes_only_files``: its 114,660 B samples (0: not measured); ``bytes_only_min_epochs`` /
    ``bytes_only_min_cpu_s``: the warm epochs and CPU-seconds behind each of its steady figures;
    ``dlio``: run DLIO's rows; ``make_dlio_venv``: make DLIO's environment when missing (off: its
    rows say how to install it); ``only_bytes``: measure ``bytes_only`` alone (no stages, no
    epochs); ``peer``: the peer stage's links, ``"off"`` or a comma-separated list of ``loopback``
    and ``netns`` (:data:`PEER_LINKS`); ``peer_mbit``: the ``netns`` link's ``tbf`` rate, Mbit/s
    each way; ``peer_profile_s``: seconds of profile of a peer row over 2x its floor (0: none)."""

    images: int = 4600
    classes: int = 10
    latency_ms: float = 20.0
    bandwidth_MBps: float = 100.0
    block_bytes: int = 1 << 20
    shard_bytes: int = 16 << 20
    concurrency: int = 8
    reps: int = 3
    workers: int = 2
    batch_size: int = 64
    workdir: str | None = None
    bytes_only_files: int = 1024
    bytes_only_min_epochs: int = 10
    bytes_only_min_cpu_s: float = 3.0
    dlio: bool = True
    make_dlio_venv: bool = False
    only_bytes: bool = False
    peer: str = "off"
    peer_mbit: float = 1000.0
    peer_profile_s: float = 2.0


def quick(cfg: IoConfig) -> IoConfig:
    """``cfg`` at a test's size (``stoker bench io --quick``): 48 photos in 256 KiB blocks, one
    repetition, an origin of 2 ms and 500 MB/s, 128 bytes-only samples over 2 warm epochs."""
    from dataclasses import replace

    return replace(
        cfg,
        images=48,
        classes=3,
        reps=1,
        shard_bytes=1 << 20,
        block_bytes=256 << 10,
        latency_ms=2.0,
        bandwidth_MBps=500.0,
        bytes_only_files=min(cfg.bytes_only_files, 128),
        bytes_only_min_epochs=2,
        bytes_only_min_cpu_s=0.0,
    )


#: The links the peer stage can run over (``IoConfig.peer``).
PEER_LINKS = ("loopback", "netns")


def peer_links(spec: str) -> tuple[str, ...]:
    """The links of ``IoConfig.peer`` (``"off"``, ``"loopback"``, ``"netns"``, ``"loopback,netns"``);
    ValueError naming the setting for anything else."""
    links = tuple(x.strip() for x in spec.split(",") if x.strip())
    if links == ("off",):
        return ()
    bad = [x for x in links if x not in PEER_LINKS]
    if bad or not links:
        raise ValueError(f"peer must be 'off' or a comma-separated list of {', '.join(PEER_LINKS)}; got {spec!r}")
    return tuple(dict.fromkeys(links))


def raw_bytes(fields, rng):
    """Decode off: the sample's primary payload, as it arrived (a module-level function: picklable)."""
    return next(iter(fields.values()))


def keep_list(samples):
    """Collate off: the list of payloads."""
    return samples


class _Drained:
    def __init__(self, samples: int, seconds: float):
        self.samples, self.seconds = samples, seconds
        self.samples_per_s = samples / seconds if seconds > 0 else 0.0


def drain(loader) -> _Drained:
    """One epoch of ``loader`` (batches: lists of payloads, :func:`keep_list`) with a consumer that
    takes no time; (samples, seconds)."""
    t0, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch)
    return _Drained(n, time.perf_counter() - t0)


def _log(msg: str) -> None:
    print(f"[bench io {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cfg: IoConfig | None = None) -> dict:
    """Run the benchmark; returns the report (see the module docstring and :func:`table`)."""
    from stoker.cache.spec import CacheOptions
    from stoker.store.dataset import open_dataset
    from stoker.store.pack import pack

    from ..sample_data import make_sample_data
    from .origin import LocalS3Origin, upload_tree

    cfg = cfg or IoConfig()
    links = peer_links(cfg.peer)
    workdir = cfg.workdir or os.path.join(tempfile.gettempdir(), "stoker-bench-io")
    os.makedirs(workdir, exist_ok=True)
    if cfg.only_bytes:
        t_start = time.perf_counter()
        report: dict = {
            "machine": machine(),
            "config": asdict(cfg),
            "bytes_only": measure_bytes_only(cfg, workdir),
        }
        report["seconds"] = time.perf_counter() - t_start
        return report
    shm = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else workdir, f"stoker-bench-io-{os.getpid()}")
    sd = make_sample_data(os.path.join(workdir, "data"), images=cfg.images, classes=cfg.classes)
    _log(f"sample data: {sd['images']} images, {sd['bytes'] / 1e6:.1f} MB")
    report = {
        "machine": machine(),
        "config": asdict(cfg),
    }
    t_start = time.perf_counter()
    with LocalS3Origin(latency_ms=cfg.latency_ms, bandwidth_MBps=cfg.bandwidth_MBps) as origin:
        raw_url, url = origin.url("raw/train"), origin.url("packed/train")
        direct, throttled = origin.storage_options(throttled=False), origin.storage_options(throttled=True)
        upload_tree(os.path.join(workdir, "data", "train"), raw_url, direct)
        pr = pack(raw_url, url, shard_bytes=cfg.shard_bytes, overwrite=True, storage_options=direct, progress=False)
        probe = open_dataset(url, storage_options=direct, cache=False, block_bytes=cfg.block_bytes)
        report["dataset"] = {
            "samples": len(probe),
            "bytes": int(probe.index.total_bytes),
            "shards": pr.shards,
            "blocks": len(probe.blocks),
            "block_bytes": cfg.block_bytes,
            "mean_sample_bytes": probe.index.total_bytes / max(1, len(probe)),
        }
        report["origin"] = {
            "server": "moto S3 on 127.0.0.1 behind a throttling TCP proxy",
            "stages": "direct endpoint (no latency, no bandwidth cap)",
            "cold_epoch": {"latency_ms": cfg.latency_ms, "bandwidth_MBps": cfg.bandwidth_MBps},
        }
        _log(f"packed {len(probe)} samples into {pr.shards} shards, {len(probe.blocks)} blocks")
        # the epochs first: obstore's runtime in this process would make the Loader start its
        # workers with forkserver instead of fork (stoker.loader.procs), unlike a training job
        _log("cold and warm epochs, decode off")
        budget = 4 * int(probe.index.total_bytes) + (64 << 20)
        ranges = st.block_ranges(probe)
        link_root = os.path.join(workdir, "floor-link")
        floors = [st.link_floor(url, throttled, ranges, cfg.concurrency, link_root)]
        epochs = cold_epoch(url, throttled, os.path.join(workdir, "cache-epoch"), budget, origin.pid, cfg)
        floors.append(st.link_floor(url, throttled, ranges, cfg.concurrency, link_root))
        epochs["link_floor"] = {
            "what": f"bare obstore.get_range + os.write of the same {len(ranges)} blocks into new files, through the "
            f"cold epoch's throttled endpoint, {cfg.concurrency} threads, in a fresh process; run before and after "
            "the epochs",
            "runs": floors,
            "cpu_s_per_GB": sum(f["cpu_s_per_GB"] for f in floors) / len(floors),
            "GBps": sum(f["GBps"] for f in floors) / len(floors),
        }
        _log("stages")
        stages, blocks = st.origin_stage(url, direct, ranges, cfg.concurrency, cfg.reps)
        stages.append(st.verify_stage(probe, blocks, cfg.reps))
        tiers = {
            "disk": open_dataset(
                url, os.path.join(workdir, "cache-disk"), budget, storage_options=direct, block_bytes=cfg.block_bytes
            ),
            "memory": open_dataset(
                url,
                os.path.join(workdir, "cache-tiered"),
                budget,
                storage_options=direct,
                block_bytes=cfg.block_bytes,
                cache=CacheOptions(memory_bytes=2 * int(probe.index.total_bytes), memory_dir=shm),
            ),
        }
        try:
            stages += st.cache_put_stage(
                tiers, blocks, {"disk": os.path.join(workdir, "floor-disk"), "memory": shm + "-floor"}, cfg.reps
            )
            stages += st.cache_read_stage(tiers, cfg.reps)
        finally:
            for ds in tiers.values():
                st.clear_cache(ds)
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(shm + "-floor", ignore_errors=True)
        stages += peer_stages(links, url, direct, workdir, cfg)
    report["stages"] = stages + [epochs.pop("stage")]
    report.update(epochs)
    report["bytes_only"] = measure_bytes_only(cfg, workdir)
    floor_of(report)
    report["seconds"] = time.perf_counter() - t_start
    return report


def machine() -> dict:
    """Cores, Python, platform and the load average at the start (1, 5, 15 min; a shared machine's
    figures are read beside it)."""
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
    }


def peer_stages(links: tuple[str, ...], url: str, storage_options: dict, workdir: str, cfg: IoConfig) -> list:
    """The peer stage's rows over each of ``links`` (:func:`peer_links`): loopback
    (:func:`stoker_lab.bench.peer_stage.loopback_process`: the dataset at ``url``, in a process of
    its own, since this one has read through obstore and Ray forks its daemons) and netns
    (:func:`stoker_lab.bench.peer_netns.run`, the sample photos under ``workdir`` packed into an
    origin inside the namespaces). A link that cannot be measured (no Ray, no network namespaces)
    or whose run fails gets one row whose ``exception`` says why; no links: one row saying the
    stage was left out."""
    from .peer_stage import loopback_process, not_measured

    if not links:
        return [
            not_measured(
                "not measured (--peer off, the default: the stage starts a 2-node Ray cluster and adds about "
                "a minute or two a link); --peer loopback, netns or loopback,netns measures it"
            )
        ]
    rows = []
    for link in links:
        _log(f"peer stage over {link}")
        try:
            if link == "loopback":
                rows += loopback_process(
                    url,
                    storage_options,
                    cfg.block_bytes,
                    workdir,
                    cfg.concurrency,
                    cfg.reps,
                    profile_s=cfg.peer_profile_s,
                )
            else:
                from .netcluster import NetnsUnavailable
                from .peer_netns import run as run_netns

                try:
                    rows += run_netns(
                        os.path.join(workdir, "data", "train"),
                        cfg.block_bytes,
                        cfg.shard_bytes,
                        cfg.concurrency,
                        cfg.reps,
                        cfg.peer_mbit,
                        cfg.peer_profile_s,
                    )
                except NetnsUnavailable as exc:
                    rows.append(not_measured(f"not measured: network namespaces are not available here: {exc}", link))
        except ImportError as exc:
            rows.append(not_measured(f"not measured: Ray is not installed (the cluster extra): {exc}", link))
        except Exception as exc:  # noqa: BLE001 - one stage's failure is reported in its row, the run goes on
            rows.append(not_measured(f"failed: {type(exc).__name__}: {exc}", link))
    return rows


def measure_bytes_only(cfg: IoConfig, workdir: str) -> dict:
    """The ``bytes_only`` report (:func:`stoker_lab.bench.bytes_only.run`), or ``{"exception": why}``."""
    from .bytes_only import BytesOnlyConfig
    from .bytes_only import run as run_bytes_only

    if cfg.bytes_only_files <= 0:
        return {"exception": "not measured (bytes_only_files=0)"}
    peers = "a torch DataLoader, DLIO" if cfg.dlio else "a torch DataLoader (DLIO off)"
    _log(f"bytes only: steady state of stoker, {peers} and the floor; samples and caches in {workdir}")
    return run_bytes_only(
        BytesOnlyConfig(
            files=cfg.bytes_only_files,
            min_epochs=cfg.bytes_only_min_epochs,
            min_cpu_s=cfg.bytes_only_min_cpu_s,
            workers=cfg.workers,
            batch_size=cfg.batch_size,
            dlio=cfg.dlio,
            make_venv=cfg.make_dlio_venv,
            workdir=os.path.join(workdir, "bytes-only"),
        )
    )


def cold_epoch(
    url: str, storage_options: dict, cache_dir: str, cache_bytes: int, origin_pid: int | None, cfg: IoConfig
) -> dict:
    """A cold then a warm epoch of a Loader with decode and collate off over a fresh cache.

    Returns ``{"stage": the report row of the cold epoch's origin -> cache path (the prefetcher's
    CPU over the origin bytes, against the floor: the bare obstore GET loop plus bare pwrite of the
    same bytes, filled in by :func:`floor_of`), "epochs": per epoch figures,
    "origin_to_cache_cpu_s_per_GB", "emulated_origin_cpu_s_per_GB", "cold_vs_warm_worker_cpu"}``."""
    from stoker.loader import Loader
    from stoker.store.dataset import open_dataset

    shutil.rmtree(cache_dir, ignore_errors=True)
    ds = open_dataset(url, cache_dir, cache_bytes, storage_options=storage_options, block_bytes=cfg.block_bytes)
    rows = []
    with Loader(ds, cfg.batch_size, num_workers=cfg.workers, seed=0, decode=raw_bytes, collate=keep_list) as loader:
        for epoch in range(2):
            o0 = process_cpu_s(origin_pid)
            m = drain(loader)
            s = loader.stats
            cpu = {k: float(v) for k, v in s.cpu_s.items()}
            stoker_cpu = sum(cpu.values())
            rows.append(
                {
                    "epoch": epoch,
                    "samples": m.samples,
                    "seconds": m.seconds,
                    "samples_per_s": m.samples_per_s,
                    "origin_bytes": int(s.origin_bytes),
                    "origin_requests": int(s.origin_requests),
                    "cache_hit_ratio": s.cache_hit_ratio,
                    "first_batch_s": s.first_batch_s,
                    "cpu_s": cpu,
                    "emulated_origin_cpu_s": process_cpu_s(origin_pid) - o0,
                    "stoker_cpu_s": stoker_cpu,
                    "samples_per_cpu_s": m.samples / stoker_cpu if stoker_cpu else 0.0,
                    "samples_per_s_per_core": m.samples_per_s / (os.cpu_count() or 1),
                    "cpu_s_per_GB": stoker_cpu / (int(ds.index.total_bytes) / GB),
                    "cpu_s_per_1000_samples": 1e3 * stoker_cpu / max(1, m.samples),
                }
            )
    shutil.rmtree(cache_dir, ignore_errors=True)
    cold, warm = rows
    gb = cold["origin_bytes"] / GB
    prefetch = cold["cpu_s"].get("prefetch", 0.0)
    wcold = cold["cpu_s"].get("workers", 0.0) / max(1, cold["samples"])
    wwarm = warm["cpu_s"].get("workers", 0.0) / max(1, warm["samples"])
    stage = {
        "stage": "origin->cache (prefetcher, cold epoch)",
        "bytes": cold["origin_bytes"],
        "cpu_s": prefetch,
        "wall_s": cold["seconds"],
        "cpu_s_per_GB": prefetch / gb if gb else 0.0,
        "GBps": gb / cold["seconds"] if cold["seconds"] else 0.0,
        "floor": None,
        "ratio": None,
        "exception": None,
        "note": "GBps is the cold epoch's, capped by the throttled origin",
    }
    return {
        "stage": stage,
        "epochs": rows,
        "origin_to_cache_cpu_s_per_GB": stage["cpu_s_per_GB"],
        "origin_to_cache_note": "the prefetch process's CPU over the origin bytes; fills made by the decode "
        "workers on a miss are in their CPU, not here",
        "emulated_origin_cpu_s_per_GB": cold["emulated_origin_cpu_s"] / gb if gb else 0.0,
        "cold_vs_warm_worker_cpu": {
            "cold_cpu_s_per_sample": wcold,
            "warm_cpu_s_per_sample": wwarm,
            "ratio": wcold / wwarm if wwarm else None,
        },
    }


def floor_of(report: dict) -> None:
    """Fill in the floor of the cold epoch's origin -> cache row: the bare GET + write loop of the
    same blocks over the same throttled link (``link_floor``), and beside it, as
    ``floor_direct_stages``, the sum of the bare obstore GET loop on the direct endpoint and bare
    pwrite into the disk tier's filesystem (the stages above; all measured in this run)."""
    by = {r["stage"]: r for r in report["stages"]}
    get, put = by.get("origin->memory (obstore)"), by.get("memory->cache (disk tier)")
    row = by.get("origin->cache (prefetcher, cold epoch)")
    if row is None:
        return
    link = report.get("link_floor")
    if link:
        row["floor"] = {"what": link["what"], "cpu_s_per_GB": link["cpu_s_per_GB"], "GBps": link["GBps"]}
        row["ratio"] = row["cpu_s_per_GB"] / link["cpu_s_per_GB"] if link["cpu_s_per_GB"] > 0 else None
    if get and put:
        cpu = get["floor"]["cpu_s_per_GB"] + put["floor"]["cpu_s_per_GB"]
        row["floor_direct_stages"] = {
            "what": "bare obstore.get_range loop on the direct endpoint + bare os.pwrite of the same bytes "
            "(stages above)",
            "cpu_s_per_GB": cpu,
        }
        if not link:
            row["floor"], row["ratio"] = dict(row["floor_direct_stages"], GBps=None), row["cpu_s_per_GB"] / cpu


def _ends_line(r: dict) -> list[str]:
    """A peer row's ends under it: sender and receiver CPU-s/GB beside the floor's, and the share of
    a shaped link's rate (none for a row without them)."""
    snd, rcv, f = r.get("sender") or {}, r.get("receiver") or {}, r.get("floor") or {}
    if not isinstance(snd.get("cpu_s_per_GB"), (int, float)) or not isinstance(rcv.get("cpu_s_per_GB"), (int, float)):
        return []
    fs, fr = (f.get(k) or {} for k in ("sender", "receiver"))
    line = (
        f"    sender {snd['cpu_s_per_GB']:.3f} (floor {fs.get('cpu_s_per_GB', float('nan')):.3f}), receiver "
        f"{rcv['cpu_s_per_GB']:.3f} (floor {fr.get('cpu_s_per_GB', float('nan')):.3f}) CPU-s/GB"
    )
    if isinstance(r.get("link_fraction"), (int, float)):
        line += f"; {100 * r['link_fraction']:.1f}% of the link (floor {100 * f.get('link_fraction', 0.0):.1f}%)"
    return [line]


def table(report: dict) -> str:
    """The report as text: one line per stage (stoker, floor, ratio), then the cold epoch's figures,
    then ``bytes_only``."""
    from .bytes_only import table as bytes_table

    bo = report.get("bytes_only") or {}
    bo_text = bytes_table(bo) if "rows" in bo else f"bytes only: {bo.get('exception')}"
    if "stages" not in report:
        return bo_text
    d, o = report["dataset"], report["origin"]["cold_epoch"]
    lines = [
        f"machine: {report['machine']['cores']} cores; dataset {d['samples']} samples, {d['bytes'] / 1e6:.1f} MB "
        f"in {d['blocks']} blocks of {d['block_bytes'] >> 10} KiB; cold epoch origin {o['latency_ms']:g} ms, "
        f"{o['bandwidth_MBps']:g} MB/s (stages: the origin's direct endpoint)",
        f"{'stage':62} {'CPU-s/GB':>9} {'GB/s':>7} {'floor CPU-s/GB':>14} {'floor GB/s':>10} {'ratio':>6}",
    ]

    def num(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    for r in report["stages"]:
        f = r.get("floor") or {}
        lines.append(
            f"{r['stage']:62} {num(r['cpu_s_per_GB'], '9.3f')} {num(r['GBps'], '7.3f')} "
            f"{num(f.get('cpu_s_per_GB'), '14.3f')} {num(f.get('GBps'), '10.3f')} {num(r['ratio'], '6.2f')}"
            + (f"  ({r['exception']})" if r.get("exception") else "")
        )
        lines += _ends_line(r)
    for e in report["epochs"]:
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(e["cpu_s"].items()))
        kind = "cold" if e["epoch"] == 0 else "first warm; the steady state is in bytes only"
        lines.append(
            f"epoch {e['epoch']} ({kind}): {e['samples_per_s']:.0f} samples/s "
            f"(first batch {e['first_batch_s']:.2f} s), "
            f"{e['samples_per_cpu_s']:.0f} samples per CPU-s, {e['cpu_s_per_GB']:.2f} CPU-s/GB, "
            f"origin {e['origin_bytes'] / 1e6:.1f} MB; CPU-s: {cpu}; emulated origin "
            f"{e['emulated_origin_cpu_s']:.2f}"
        )
    cw = report["cold_vs_warm_worker_cpu"]
    lines.append(
        f"origin_to_cache_cpu_s_per_GB {report['origin_to_cache_cpu_s_per_GB']:.2f} (prefetcher); "
        f"emulated_origin_cpu_s_per_GB {report['emulated_origin_cpu_s_per_GB']:.2f}; workers' CPU per sample "
        f"cold/warm {num(cw['ratio'], '.2f')} ({1e3 * cw['cold_cpu_s_per_sample']:.3f} / "
        f"{1e3 * cw['warm_cpu_s_per_sample']:.3f} ms)"
    )
    lines.append(bo_text)
    return "\n".join(lines)
