"""``stoker bench <name>``: the benchmarks, one ``_add_<name>`` per subcommand.

Each subcommand is registered in :data:`SUBCOMMANDS`; to add one, write an ``_add_<name>(bench_sub)``
that declares its arguments and a ``_cmd_<name>(args)`` that calls the plain function of its library
module (under :mod:`stoker_lab.bench` or :mod:`stoker.cluster`) and prints, then list it in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .bandwidth import rate_arg


def _write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


# -- stoker bench decode ---------------------------------------------------------
def _add_decode(bench_sub) -> None:
    p = bench_sub.add_parser("decode", help="decode+augment per core (stoker, Pillow, DALI-CPU) and loader efficiency")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--seconds", type=float, default=3.0, help="per single-process measurement")
    p.add_argument("--no-dali", action="store_true", help="skip DALI (recorded as skipped)")
    p.add_argument(
        "--dali-venv", help="virtual environment for DALI (made on first use; default ~/.cache/stoker-bench/venvs/dali)"
    )
    p.set_defaults(fn=_cmd_decode)


def _cmd_decode(a) -> int:
    from ..bench.decode_bench import run

    r = run(images=a.images, seconds=a.seconds, dali=not a.no_dali, dali_venv=a.dali_venv)
    pc = r["per_core"]
    print(
        f"per core (samples/s): stoker {pc['stoker']:.0f}, Pillow {pc['pillow']:.0f}, DALI-CPU {pc['dali']:.0f}"
        if pc["dali"]
        else f"per core (samples/s): stoker {pc['stoker']:.0f}, Pillow {pc['pillow']:.0f}, DALI-CPU skipped"
    )
    for row in r["loader"]:
        print(
            f"loader, {row['workers']} worker(s): {row['samples_per_s']:.0f} samples/s, efficiency "
            f"{row['efficiency']:.2f}, trainer CPU {row['trainer_cpu_per_batch_s'] * 1e3:.2f} ms/batch "
            f"({100 * row['trainer_cpu_fraction']:.1f}% of a core)"
        )
    cf = r["cache_forms"]
    for name, row in cf["forms"].items():
        extra = (
            f", fill {row['fill_s_per_sample'] * 1e3:.1f} ms, pixel diff vs full mean {row['pixel_mad']:.2f} "
            f"p99 {row['pixel_p99']:.0f}"
            if name != "raw"
            else ""
        )
        print(
            f"form {name}: {row['bytes_per_sample'] / 1e3:.1f} kB/sample, {row['decode_per_core']:.0f} samples/s "
            f"per core{extra}"
        )
    print(
        f"cache_form=auto (2 workers): {cf['auto']['choice']}; loader with {cf['loader']['form']}, 2 workers, warm: "
        f"{cf['loader']['samples_per_s']:.0f} samples/s"
    )
    for s in r["skipped"]:
        print(f"skipped {s['loader']}: {s['reason']}")
    if a.json:
        _write_json(a.json, r)
    return 0


# -- stoker bench cache ----------------------------------------------------------
def _add_cache(bench_sub) -> None:
    from ..bench.cache_bench import POLICY_NAMES

    p = bench_sub.add_parser(
        "cache", help="origin bytes and stall per cache budget and policy (future/LRU/no-eviction)"
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fractions", default="0.1,0.25,0.5,1.0", help="cache budgets as fractions of the dataset")
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    p.add_argument(
        "--consumer-rate",
        type=float,
        default=None,
        help="emulated accelerator, samples/s (default: 2x origin headroom at the smallest budget)",
    )
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument(
        "--bandwidth-MBps", type=rate_arg, default=100.0, help="origin cap in MB/s (a number, or e.g. 100MB/s)"
    )
    p.add_argument("--no-two-jobs", action="store_true")
    p.add_argument("--staging-bytes", type=int, default=64 << 20, help="the loader's staging budget (bytes)")
    p.set_defaults(fn=_cmd_cache)


def _cmd_cache(a) -> int:
    from ..bench.cache_bench import run, summary

    t = time.perf_counter()
    r = run(
        images=a.images,
        epochs=a.epochs,
        fractions=[float(f) for f in a.fractions.split(",")],
        policies=a.policies.split(","),
        consumer_rate=a.consumer_rate,
        latency_ms=a.latency_ms,
        bandwidth_MBps=a.bandwidth_MBps,
        two_jobs_fractions=() if a.no_two_jobs else (1.0, 0.5),
        staging_bytes=a.staging_bytes,
    )
    print("steady state (epochs >= 1):")
    for s in summary(r):
        print(
            f"  C={s['cache_fraction']:4.2f}D {s['policy']:8} origin {s['origin_bytes'] / 1e6:7.1f} MB/epoch "
            f"(floor {s['floor_bytes'] / 1e6:6.1f}, excess {100 * s['excess_over_floor']:+.1f}% of D) "
            f"stall {s['stall_fraction']:.3f}"
        )
    print(f"({time.perf_counter() - t:.0f} s)")
    if a.json:
        r["summary"] = summary(r)
        _write_json(a.json, r)
    return 0


# -- stoker bench peers ----------------------------------------------------------
def _add_peers(bench_sub) -> None:
    from ..bench.peers.bench import LOADERS

    p = bench_sub.add_parser(
        "peers",
        help="stoker vs torch DataLoader, WebDataset, Streaming, LitData, DALI, SPDL, Ray Data on one origin",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument(
        "--loaders",
        help="comma-separated subset of " + ",".join(LOADERS) + " (default: all; with --device cuda: stoker,dali)",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--consumer-rate", type=float, default=2000.0, help="emulated accelerator, samples/s")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument(
        "--bandwidth-MBps",
        "--bandwidth-mbps",
        dest="bandwidth_mbps",
        type=rate_arg,
        default=100.0,
        help="origin cap in MB/s (a number, or e.g. 100MB/s)",
    )
    p.add_argument(
        "--dali-source",
        choices=["local", "s3"],
        default="local",
        help="DALI reads a local copy fetched in the first epoch (default) or s3:// directly",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: stoker's decode_device='cuda' against DALI's GPU pipeline (skipped, exit 0, without a GPU)",
    )
    p.add_argument(
        "--no-make-venvs",
        action="store_true",
        help="install nothing: skip peers whose environment or system packages (SPDL's FFmpeg) are missing, "
        "with the command that installs them",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per loader")
    p.add_argument("--retries", type=int, default=1, help="runs again of a loader that failed (each failure reported)")
    p.add_argument("--workdir", help="default: $TMPDIR/stoker-bench-peers")
    p.set_defaults(fn=_cmd_peers)


def _cmd_peers(a) -> int:
    from ..bench.peers.bench import GPU_LOADERS, LOADERS, PeersConfig, cuda_missing, run_peers

    if a.device == "cuda":
        why = cuda_missing()
        if why:
            print(f"stoker bench peers --device cuda: skipped, {why}", flush=True)
            return 0
    default = GPU_LOADERS if a.device == "cuda" else LOADERS
    loaders = tuple(x.strip() for x in a.loaders.split(",") if x.strip()) if a.loaders else default
    run_peers(
        PeersConfig(
            images=a.images,
            classes=a.classes,
            epochs=a.epochs,
            loaders=loaders,
            workers=a.workers,
            batch_size=a.batch_size,
            consumer_rate=a.consumer_rate,
            latency_ms=a.latency_ms,
            bandwidth_MBps=a.bandwidth_mbps,
            dali_source=a.dali_source,
            device=a.device,
            retries=a.retries,
            make_venvs=not a.no_make_venvs,
            run_timeout_s=a.timeout,
            workdir=a.workdir,
            json_path=a.json,
            plot_path=a.plot,
        )
    )
    return 0


# -- stoker bench cluster --------------------------------------------------------
def _add_cluster(bench_sub) -> None:
    s = bench_sub.add_parser(
        "cluster",
        help="2 jobs x 3 Ray nodes, co-located vs random placement "
        "(--netns: on network namespaces, bytes counted by the kernel)",
    )
    s.add_argument("--json", help="write the report here")
    s.add_argument("--images", type=int, default=900)
    s.add_argument("--epochs", type=int, default=3)
    s.add_argument("--latency-ms", type=float, default=20.0)
    s.add_argument(
        "--bandwidth-MBps",
        "--bandwidth-mbps",
        dest="bandwidth_mbps",
        type=rate_arg,
        default=100.0,
        help="origin cap in MB/s (a number, or e.g. 100MB/s; without --netns)",
    )
    s.add_argument("--workdir")
    n = s.add_argument_group("--netns", "a cluster of Linux network namespaces (needs CAP_NET_ADMIN)")
    n.add_argument(
        "--netns",
        action="store_true",
        help="hosts and origin in their own namespaces, tbf-shaped links; direct, random and co-located placement",
    )
    n.add_argument("--hosts", type=int, default=3, help="host namespaces (1..6)")
    n.add_argument("--host-mbit", type=float, default=400.0, help="each host link, Mbit/s per direction")
    n.add_argument("--origin-mbit", type=float, default=200.0, help="the origin link, Mbit/s per direction")
    n.add_argument(
        "--decode",
        action="store_true",
        help="every rank decodes every sample it reads, as training would (stoker.decode; default: read and verify)",
    )
    n.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every placement N times, each on empty caches, in one report (each row gets 'repeat'; default 1)",
    )
    n.add_argument(
        "--consumer-rate",
        type=float,
        default=0.0,
        help="samples/s each rank's accelerator takes after each read (1/rate s a sample, no read-ahead; "
        "default 0: none)",
    )
    n.add_argument(
        "--cache-mib",
        type=int,
        default=256,
        help="each node's cache budget, MiB (default 256; give more than the dataset for warm epochs that read "
        "nothing from the origin in the direct placement)",
    )
    n.add_argument(
        "--image-side",
        help="the sample photos' shorter side in pixels, MIN,MAX (default 300,500: about 65 KB a photo; "
        "400,600: about 90 KB)",
    )
    n.add_argument("--plot", help="write a PNG of the bytes per link per epoch here")
    n.add_argument(
        "--faults",
        default="kill,link_down",
        help="fault runs after the placements, comma-separated (kill, link_down) or 'none'",
    )
    n.add_argument(
        "--no-state-check",
        action="store_true",
        help="skip warm + cluster-state + extender prioritize on the namespace cluster",
    )
    s.set_defaults(fn=_cmd_cluster)


def _cmd_cluster(a) -> int:
    if a.netns:
        return _cmd_cluster_netns(a)
    from ..bench.cluster_bench import run, table

    t0 = time.perf_counter()
    report = run(
        images=a.images, epochs=a.epochs, latency_ms=a.latency_ms, bandwidth_MBps=a.bandwidth_mbps, workdir=a.workdir
    )
    report["seconds"] = time.perf_counter() - t0
    print(table(report))
    if a.json:
        _write_json(a.json, report)
    return 0


def _image_side(text: str | None) -> tuple[int, int] | None:
    """``--image-side MIN,MAX`` as two integers (None when not given). Raises ValueError naming
    the option for anything else."""
    if text is None:
        return None
    parts = text.replace("-", ",").split(",")
    try:
        lo, hi = (int(x) for x in parts)
    except ValueError:
        raise ValueError(f"--image-side {text!r}: want MIN,MAX pixels, e.g. 400,600") from None
    return lo, hi


def _cmd_cluster_netns(a) -> int:
    import signal

    from ..bench.netcluster import NetnsUnavailable
    from ..bench.netcluster_bench import fault_table, host_cpu_table, plot, run, table

    def _term(signum, frame):  # SIGTERM tears the namespaces down like Ctrl-C does
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        side = _image_side(a.image_side)
        from ..bench.netcluster_bench import check_options

        check_options(a.repeats, a.consumer_rate, side)
        if a.cache_mib < 1:
            raise ValueError(f"--cache-mib must be >= 1, got {a.cache_mib}")
    except ValueError as exc:
        print(f"stoker bench cluster --netns: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _term)
    try:
        faults = () if a.faults.strip() in ("", "none") else tuple(f.strip() for f in a.faults.split(","))
        report = run(
            images=a.images,
            epochs=a.epochs,
            hosts=a.hosts,
            host_mbit=a.host_mbit,
            origin_mbit=a.origin_mbit,
            latency_ms=a.latency_ms,
            decode=a.decode,
            workdir=a.workdir,
            faults=faults,
            state_check=not a.no_state_check,
            repeats=a.repeats,
            consumer_rate=a.consumer_rate,
            short_side=side,
            cache_bytes=a.cache_mib << 20,
        )
    except NetnsUnavailable as exc:
        print(f"stoker bench cluster --netns: cannot make network namespaces: {exc}", file=sys.stderr)
        return 2
    print(
        "links: "
        + ", ".join(f"{k} {v['mbit']:g} Mbit/s {v['qdisc']}" for k, v in report["links"].items())
        + f"; origin latency {a.latency_ms:g} ms/request; dataset {report['dataset']['samples']} samples, "
        f"{report['dataset']['bytes'] / 1e6:.1f} MB"
    )
    print(table(report))
    if host_cpu_table(report):
        print(host_cpu_table(report))
    if report.get("faults"):
        print(fault_table(report))
    if report.get("state"):
        print("warm + cluster-state + extender: " + json.dumps(report["state"]))
    print(json.dumps(report["summary"], indent=1))
    print(f"{report['seconds']:.0f} s")
    if a.json:
        _write_json(a.json, report)
    if a.plot:
        plot(report, a.plot)
    return 0


# -- stoker bench faults ---------------------------------------------------------
def _add_faults(bench_sub) -> None:
    p = bench_sub.add_parser(
        "faults",
        help="fault scenarios (origin errors, resets, stalls, exhausted disk and "
        "/dev/shm, SIGKILL, ...): outcome, samples lost, leftovers",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--quick", action="store_true", help="the short list, 5 SIGKILL rounds instead of 20")
    p.add_argument("--only", metavar="SCENARIO[,SCENARIO]", help="run just these (the clean run always runs)")
    p.add_argument("--images", type=int, help="dataset samples (default 96; 64 with --quick)")
    p.add_argument("--workdir", help="keep the inputs and caches here (default: a temporary directory, removed)")
    p.add_argument("--no-ray", action="store_true", help="skip the warm-up scenario (it starts a local Ray)")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every scenario is ok")
    p.set_defaults(fn=_cmd_faults)


def _cmd_faults(a) -> int:
    from ..bench.faults import run, table

    only = [s for s in (a.only or "").split(",") if s] or None
    report = run(a.json, quick=a.quick, only=only, images=a.images, workdir=a.workdir, ray=not a.no_ray)
    print(table(report))
    ok = all(r["ok"] or r["outcome"] == "skipped" for r in report["scenarios"])
    return 0 if ok or not a.strict else 1


#: The ``stoker bench`` subcommands, in ``--help`` order: one registration function each.
# -- stoker bench cold -----------------------------------------------------------
def _add_cold(bench_sub) -> None:
    p = bench_sub.add_parser(
        "cold",
        help="cold epoch from a near and a far origin: first batch, overlap efficiency, cold/bound, "
        "CPU ceiling, warm origin bytes",
        description="Runs the quick demo's stoker part once per origin preset (near: 20 ms, 100 MB/s; "
        "far: 100 ms, 1,000 MB/s; the emulated S3 origin on this machine) with a fresh cache and "
        "no accelerator, and prints per origin: the cold epoch's samples/s and its ratio to "
        "min(decode bound, storage bound) (cold/bound), time to first batch, overlap efficiency, "
        "origin busy fraction, requests in flight, the warm epochs' origin bytes and samples/s over "
        "the decode bound, and the CPU ceiling (JSON: cpu_ceiling_vs_bound): the epoch's samples "
        "over (the CPU seconds of every process of the cold epoch / the machine's cores), over the "
        "smaller bound, i.e. the best cold/bound those CPU costs allow on an otherwise idle "
        "machine (above 1: the cores are not what limits; on a busy machine or under a CPU quota "
        "fewer cores were really there, and the ceiling is lower than printed).",
    )
    p.add_argument("--images", type=int, help="sample images (default: the quick demo's 1500)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per origin: one cold, the rest warm (default 3)")
    p.add_argument("--workers", type=int, default=2, help="decode worker processes (default 2)")
    p.add_argument("--origin", action="append", choices=["near", "far"], help="only these (repeatable)")
    p.add_argument("--workdir", help="where sample data and caches go (default: $TMPDIR/stoker-demo)")
    p.add_argument("--json", help="write the report here")
    p.set_defaults(fn=_cmd_cold)


def _cmd_cold(a) -> int:
    from ..bench.cold_bench import print_rows, run

    r = run(
        images=a.images,
        epochs=a.epochs,
        workers=a.workers,
        workdir=a.workdir,
        origins=tuple(a.origin or ("near", "far")),
    )
    print()
    print_rows(r["rows"])
    if a.json:
        _write_json(a.json, r)
    return 0


# -- stoker bench io -------------------------------------------------------------
def _add_io(bench_sub) -> None:
    p = bench_sub.add_parser(
        "io",
        help="CPU-s/GB and GB/s of each stage of the byte path (origin, cache tiers, worker reads, "
        "cold epoch with decode off) beside its floor",
        description="Packs sample photos into the emulated S3 origin and measures, in one run on the same "
        "bytes, each stage of the byte path beside its floor (a bare loop of the same client "
        "library, bare os.pwrite / os.pread): origin -> memory (obstore, s3fs), the fill's checksum "
        "pass, memory -> cache tier (disk, shared memory), cache tier -> worker; then a cold and a "
        "warm epoch with decode off, reporting the prefetcher's CPU per GB from the origin "
        "(origin_to_cache_cpu_s_per_GB), the emulated origin's own CPU per GB apart, and the decode "
        "workers' CPU per sample cold over warm. With --peer, also a peer's cache service to a rank "
        "and a worker process of it in cluster mode (over the service's data endpoint), over loopback "
        "and/or a shaped link between network namespaces, each end's CPU-s/GB against a bare TCP "
        "transfer of the same blocks.",
    )
    p.add_argument("--json", help="write the report here")
    p.add_argument("--images", type=int, default=4600, help="sample photos (default 4600, about 300 MB)")
    p.add_argument("--reps", type=int, default=3, help="runs of each loop, alternating; the least CPU is kept")
    p.add_argument("--latency-ms", type=float, default=20.0, help="the cold epoch's origin latency per request")
    p.add_argument(
        "--bandwidth-MBps",
        dest="bandwidth_MBps",
        type=rate_arg,
        default=100.0,
        help="the cold epoch's origin cap in MB/s (a number, or e.g. 100MB/s)",
    )
    p.add_argument("--block-bytes", type=int, default=1 << 20, help="the cache unit (default 1 MiB)")
    p.add_argument("--workers", type=int, default=2, help="decode worker processes in the epochs")
    p.add_argument("--workdir", help="sample data and caches (default: $TMPDIR/stoker-bench-io)")
    p.add_argument(
        "--dlio",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bytes_only: also DLIO's PyTorch reader (dlio-benchmark 2.0.0) on the same files, as released "
        "and without its per-sample debug string, in its own virtual environment; not installed: its rows "
        "say how to install it (--make-dlio-venv) and are skipped (default: on)",
    )
    p.add_argument(
        "--make-dlio-venv",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="install DLIO's environment when it is missing (about 2.6 GB from the package index: torch, "
        "tensorflow-cpu, mpi4py + the mpich wheel; default: off)",
    )
    p.add_argument(
        "--bytes-only-files",
        type=int,
        default=1024,
        help="bytes_only: samples of 114,660 B (MLPerf Storage's ResNet-50 sample), default 1024 (117 MB); "
        "0 leaves bytes_only out",
    )
    p.add_argument(
        "--bytes-only-min-epochs",
        type=int,
        default=10,
        help="bytes_only: warm epochs behind each steady figure, at least (default 10)",
    )
    p.add_argument(
        "--bytes-only-min-cpu-s",
        type=float,
        default=3.0,
        help="bytes_only: CPU-seconds behind each steady figure where 400 epochs allow (default 3)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="every part at a test's size (48 photos, 128 bytes-only samples, 2 warm epochs a figure): "
        "checks that the bench runs; its figures mean little",
    )
    p.add_argument(
        "--only-bytes", action="store_true", help="measure bytes_only alone (no stages, no cold/warm epochs)"
    )
    p.add_argument(
        "--peer",
        type=_peer_arg,
        default="off",
        help="the peer stage (a peer's cache service's data endpoint to a rank and to a worker process of "
        "it, against bare TCP sendfile/recv_into of the same blocks): off (the default; it adds about a "
        "minute or two a link), loopback (a 2-node local Ray cluster), netns (two network namespaces and a "
        "tbf-shaped link; needs root) or loopback,netns",
    )
    p.add_argument(
        "--peer-mbit",
        type=float,
        default=1000.0,
        help="the netns peer link's rate, Mbit/s each way (default 1000; a pass moves about 6 s of it)",
    )
    p.add_argument(
        "--peer-profile-s",
        type=float,
        default=2.0,
        help="seconds of py-spy + perf profile of a peer row over 2x its floor, for its exception (0: none)",
    )
    p.set_defaults(fn=_cmd_io)


def _peer_arg(text: str) -> str:
    from ..bench.io_bench import peer_links

    try:
        peer_links(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cmd_io(a) -> int:
    from ..bench.io_bench import IoConfig, quick, run, table

    cfg = IoConfig(
        images=a.images,
        reps=a.reps,
        latency_ms=a.latency_ms,
        bandwidth_MBps=a.bandwidth_MBps,
        block_bytes=a.block_bytes,
        workers=a.workers,
        workdir=a.workdir,
        dlio=a.dlio,
        make_dlio_venv=a.make_dlio_venv,
        bytes_only_files=a.bytes_only_files,
        only_bytes=a.only_bytes,
        bytes_only_min_epochs=a.bytes_only_min_epochs,
        bytes_only_min_cpu_s=a.bytes_only_min_cpu_s,
        peer=a.peer,
        peer_mbit=a.peer_mbit,
        peer_profile_s=a.peer_profile_s,
    )
    r = run(quick(cfg) if a.quick else cfg)
    print(table(r))
    if a.json:
        _write_json(a.json, r)
    return 0


SUBCOMMANDS = (_add_decode, _add_cache, _add_peers, _add_cluster, _add_faults, _add_cold, _add_io)


def add_parsers(sub) -> None:
    """Register ``stoker bench <name>`` (every entry of :data:`SUBCOMMANDS`) on the top-level subparsers ``sub``."""
    b = sub.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench", required=True)
    for add in SUBCOMMANDS:
        add(bench_sub)
