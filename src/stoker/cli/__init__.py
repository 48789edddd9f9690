"""The `stoker` command: sample-data, pack, stat, demo."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _size(text: str) -> int:
    """Parse a byte size: 1048576, 64MiB, 1GiB, 500MB, 8G."""
    t = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1}
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            return int(float(t[: -len(u)]) * units[u])
    return int(t)


def _storage_errors() -> tuple:
    """Exception types of the S3 client stack (credentials, endpoint, HTTP errors), if installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)


def _opts(text: str | None) -> dict:
    return json.loads(text) if text else {}


def cmd_sample_data(a) -> int:
    from ..sample_data import make_sample_data
    print(json.dumps(make_sample_data(a.dir, images=a.images, classes=a.classes, seed=a.seed), indent=2))
    print(f"ImageFolder tree: {a.dir.rstrip('/')}/train  (pack it with: stoker pack {a.dir.rstrip('/')}/train DST)",
          file=sys.stderr)
    return 0


def cmd_pack(a) -> int:
    from ..store.pack import pack
    if a.shard_size < 1:
        raise ValueError(f"--shard-size must be positive, got {a.shard_size}")
    r = pack(a.src, a.dst, shard_bytes=a.shard_size, overwrite=a.overwrite,
             src_options=_opts(a.src_options), dst_options=_opts(a.dst_options),
             read_workers=a.read_workers, progress=not a.no_progress,
             shuffle_seed=None if a.no_shuffle else a.shuffle_seed, source=a.source, classes=a.classes)
    print(json.dumps(r.as_dict(), indent=2))
    return 0


def cmd_demo(a) -> int:
    from ..bench.demo import DemoConfig, run_demo
    cfg = DemoConfig(quick=a.quick, images=a.images, classes=a.classes, seed=a.seed, latency_ms=a.latency_ms,
                     bandwidth_MBps=a.bandwidth_mbps, workers=a.workers, batch_size=a.batch_size,
                     epochs=a.epochs, consumer_rate=a.consumer_rate, block_bytes=a.block_size,
                     shard_bytes=a.shard_size, baseline_samples=a.baseline_samples, workdir=a.workdir,
                     json_path=a.json, plot_path=a.plot)
    report = run_demo(cfg)
    return 0 if all(c["ok"] for c in report["checks"].values()) or not a.strict else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stoker", description="Keep accelerators fed with training data.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("sample-data", help="write the embedded real-photo ImageFolder set")
    s.add_argument("dir")
    s.add_argument("--images", type=int, default=2000)
    s.add_argument("--classes", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_sample_data)

    s = sub.add_parser("pack", help="pack an ImageFolder tree, WebDataset shards or a file list "
                                    "into tar shards + a Parquet index")
    s.add_argument("src", help="fsspec URL: an ImageFolder root (<root>/<class>/<file>), WebDataset "
                               ".tar/.tgz shards (file, directory, glob or {a..b} list), or a CSV/Parquet "
                               "file list (columns path, label[, key])")
    s.add_argument("dst", help="fsspec URL of the packed dataset")
    s.add_argument("--shard-size", type=_size, default=64 << 20, help="target shard size (default 64MiB)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    s.add_argument("--read-workers", type=int, default=16)
    s.add_argument("--src-options", help="fsspec storage options for SRC, as JSON")
    s.add_argument("--dst-options", help="fsspec storage options for DST, as JSON")
    s.add_argument("--source", choices=["imagefolder", "webdataset", "filelist"],
                   help="kind of source (default: detected from SRC)")
    s.add_argument("--shuffle-seed", type=int, default=0,
                   help="seed of the random placement of samples in shards (default 0)")
    s.add_argument("--no-shuffle", action="store_true", help="place samples in sorted order")
    s.add_argument("--classes", metavar="FILE|URL",
                   help="fix the labels: a class list (text, one name per line, label = line order; or "
                        "JSON), or an existing packed dataset whose classes are reused; pack every split "
                        "with the same list so that labels agree (read with --dst-options)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_pack)

    s = sub.add_parser("demo", help="end-to-end demo and benchmark against the standard recipe")
    s.add_argument("--quick", action="store_true", help="smaller run (under 5 minutes on 2 cores)")
    s.add_argument("--images", type=int)
    s.add_argument("--classes", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--latency-ms", type=float, default=20.0, help="origin per-request latency (ms)")
    s.add_argument("--bandwidth-mbps", type=float, default=100.0, help="origin bandwidth cap (MB/s)")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--epochs", type=int, default=3)
    s.add_argument("--consumer-rate", type=float, default=800.0,
                   help="emulated accelerator rate in samples/s (0 = skip that pass)")
    s.add_argument("--block-size", type=_size, default=1 << 20, help="cache block size (default 1MiB)")
    s.add_argument("--shard-size", type=_size, default=64 << 20)
    s.add_argument("--baseline-samples", type=int, help="samples the baseline is measured over")
    s.add_argument("--workdir", help="where sample data and caches go (default: $TMPDIR/stoker-demo)")
    s.add_argument("--json", help="write the report here")
    s.add_argument("--plot", help="write a PNG plot here")
    s.add_argument("--strict", action="store_true", help="exit 1 if a done-criterion is missed")
    s.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench", required=True)
    from ..bench import cache_bench, decode_bench
    from ..bench.peers import bench as peers_bench
    decode_bench.add_parser(bench_sub)
    cache_bench.add_parser(bench_sub)
    peers_bench.add_parser(bench_sub)
    from ..cluster import bench as cluster_bench
    cluster_bench.add_parser(bench_sub)
    from . import cluster as cluster_cli
    cluster_cli.add_parsers(sub, _size)

    from ..cache import status as cache_status
    from ..store import listing, verify
    listing.add_parsers(sub)
    verify.add_parsers(sub)
    cache_status.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; expected failures (bad input, storage errors) print one line, exit 2."""
    import tarfile

    from ..cache.status import CacheInUseError
    from ..storage import OriginError
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:  # e.g. `stoker ls URL | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (FileNotFoundError, FileExistsError, ValueError, OriginError, tarfile.TarError, IOError, CacheInUseError,
            *_storage_errors()) as exc:
        if args.verbose:
            raise
        where = getattr(args, "src", None) or getattr(args, "url", None)
        where = f" ({where})" if isinstance(where, str) and where not in str(exc) else ""
        print(f"stoker {args.cmd}{where}: {type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, OSError))
              else f"stoker {args.cmd}{where}: {exc}", file=sys.stderr)
        return 2

