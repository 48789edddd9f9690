"""``stoker demo`` (the end-to-end demo) and ``stoker origin-server`` (the emulated origin it starts)."""

from __future__ import annotations

from stoker.cli.args import size_arg

from .bandwidth import rate_arg

#: ``stoker origin-server``'s port and bucket unless told: the endpoint and bucket of the guide's
#: S3 example (docs/guide.md, "S3, MinIO and other object stores"); MinIO's port too.
DEFAULT_PORT = 9000
DEFAULT_BUCKET = "my-bucket"


def cmd_demo(a) -> int:
    """``stoker demo``: exit 1 with ``--strict`` when a done-criterion is missed, else 0."""
    from ..bench.demo import origin_settings

    latency_ms, bandwidth_MBps = origin_settings(a.origin, a.latency_ms, a.bandwidth_mbps)
    if a.kind == "tokens":
        from ..bench.tokens_demo import TokensDemoConfig, run_tokens_demo

        tcfg = TokensDemoConfig(
            quick=a.quick,
            latency_ms=latency_ms,
            bandwidth_MBps=bandwidth_MBps,
            workers=a.workers,
            epochs=a.epochs,
            seed=a.seed,
            workdir=a.workdir,
            json_path=a.json,
            batch_size=a.batch_size,
        )
        report = run_tokens_demo(tcfg)
        return 0 if all(c["ok"] for c in report["checks"].values()) or not a.strict else 1
    from ..bench.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        quick=a.quick,
        images=a.images,
        classes=a.classes,
        seed=a.seed,
        latency_ms=latency_ms,
        bandwidth_MBps=bandwidth_MBps,
        origin=a.origin,
        workers=a.workers,
        batch_size=a.batch_size,
        epochs=a.epochs,
        consumer_rate=a.consumer_rate,
        block_bytes=a.block_size,
        shard_bytes=a.shard_size,
        baseline_samples=a.baseline_samples,
        workdir=a.workdir,
        json_path=a.json,
        plot_path=a.plot,
    )
    report = run_demo(cfg)
    return 0 if all(c["ok"] for c in report["checks"].values()) or not a.strict else 1


def cmd_origin_server(a) -> int:
    """``stoker origin-server``: run the emulated S3 origin in this process until killed."""
    from ..bench.origin import serve_origin

    serve_origin(
        latency_ms=a.latency_ms,
        bandwidth_MBps=a.bandwidth,
        ready_file=a.ready_file,
        buckets=tuple(a.bucket or [DEFAULT_BUCKET]),
        fast_range=not a.no_fast_range,
        parent_pid=a.parent_pid,
        host=a.host,
        port=a.port,
        announce=True,
    )
    return 0


def add_parsers(sub) -> None:
    """Register ``demo`` and ``origin-server`` on the top-level subparsers ``sub``."""
    s = sub.add_parser("demo", help="end-to-end demo and benchmark against the standard recipe")
    s.add_argument(
        "--kind",
        choices=["images", "tokens"],
        default="images",
        help="images: JPEG classification (default); tokens: LM pre-training input (standard-library "
        ".py files, byte-level BPE, pack_tokens) against a torch DataLoader over fsspec files",
    )
    s.add_argument("--quick", action="store_true", help="smaller run (under 5 minutes on 2 cores)")
    s.add_argument("--images", type=int)
    s.add_argument("--classes", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--origin",
        choices=["near", "far"],
        help="origin preset: near = 20 ms, 100 MB/s (the default); far = 100 ms, 1000 MB/s",
    )
    s.add_argument("--latency-ms", type=float, help="origin per-request latency (ms; overrides --origin)")
    s.add_argument(
        "--bandwidth-MBps",
        "--bandwidth-mbps",
        dest="bandwidth_mbps",
        type=rate_arg,
        help="origin bandwidth cap in MB/s (a number, or e.g. 100MB/s; overrides --origin)",
    )
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--epochs", type=int, default=3)
    s.add_argument(
        "--consumer-rate", type=float, default=800.0, help="emulated accelerator rate in samples/s (0 = skip that pass)"
    )
    s.add_argument("--block-size", type=size_arg, default=1 << 20, help="cache block size (default 1MiB)")
    s.add_argument("--shard-size", type=size_arg, default=64 << 20)
    s.add_argument("--baseline-samples", type=int, help="samples the baseline is measured over")
    s.add_argument("--workdir", help="where sample data and caches go (default: $TMPDIR/stoker-demo)")
    s.add_argument("--json", help="write the report here")
    s.add_argument("--plot", help="write a PNG plot here")
    s.add_argument("--strict", action="store_true", help="exit 1 if a done-criterion is missed")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser(
        "origin-server",
        help="run a local S3 (moto behind a throttling proxy) until Ctrl-C: to try stoker on S3, "
        "and the origin of the demo and the benchmarks; prints the endpoint and the AWS settings to use",
    )
    s.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"the endpoint's port (default {DEFAULT_PORT}; 0: a free one)"
    )
    s.add_argument("--latency-ms", type=float, default=20.0, help="added to every request (ms)")
    s.add_argument(
        "--bandwidth-MBps",
        "--bandwidth-mbps",
        dest="bandwidth",
        type=rate_arg,
        default=100.0,
        help="megabytes (1e6 bytes) per second, or e.g. 100MB/s; 0 = unlimited",
    )
    s.add_argument("--ready-file", help="write {endpoint_url, direct_url, pid} as JSON here once listening")
    s.add_argument(
        "--bucket", action="append", default=[], help=f"create this bucket (repeatable; default {DEFAULT_BUCKET})"
    )
    s.add_argument("--no-fast-range", action="store_true", help="serve ranged GETs by moto's own path")
    s.add_argument("--parent-pid", type=int, help="exit when this process exits")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.set_defaults(fn=cmd_origin_server)
