"""Commands on datasets: ``stoker pack``, ``ls``, ``stat``, ``verify``."""

from __future__ import annotations

import json
import sys

from ..store.dataset import open_dataset
from ..store.keytable import KeyTable
from ..store.listing import ls, stat
from ..store.manifests import finished_shards
from ..store.pack import pack
from ..store.pack_options import PackOptions
from ..store.shards import DEFAULT_SMALL_SAMPLE_BYTES
from ..store.verify import verify
from .args import OptionsFlag, json_options, show_progress, size_arg


def cmd_pack(a) -> int:
    """``stoker pack SRC DST``: the pack report as JSON. Ctrl-C: one line saying how many shards
    are finished (a rerun reuses them), exit 130."""
    if a.shard_size < 1:
        raise ValueError(f"--shard-size must be positive, got {a.shard_size}")
    both = json_options(a.storage_options)
    options = PackOptions(
        src_storage_options=json_options(a.src_options, a.src_flag) if a.src_options else None,
        dst_storage_options=json_options(a.dst_options, a.dst_flag) if a.dst_options else None,
        read_workers=a.read_workers,
        shuffle_seed=None if a.no_shuffle else a.shuffle_seed,
        column=a.column,
        key_column=a.key_column,
        small_sample_bytes=a.small_sample_bytes,
    )
    try:
        r = pack(
            a.src,
            a.dst,
            source=a.source,
            classes=a.classes,
            shard_bytes=a.shard_size,
            overwrite=a.overwrite,
            storage_options=both,
            progress=show_progress(a),
            options=options,
        )
    except KeyboardInterrupt:
        n = finished_shards(a.dst, both if options.dst_storage_options is None else options.dst_storage_options)
        print(
            f"\nstoker pack: interrupted: {n} shard{'' if n == 1 else 's'} of {a.dst} finished and kept, "
            "no index written; run the same command again to resume (finished shards are reused)",
            file=sys.stderr,
        )
        return 130
    print(json.dumps(r.as_dict(), indent=2))
    return 0


def _open_directory(a):
    ds = open_dataset(a.url, cache=False, check=False, storage_options=json_options(a.storage_options))
    return KeyTable(ds.index)


def cmd_ls(a) -> int:
    """``stoker ls URL [PREFIX]``: exit 2 when PREFIX names nothing."""
    d = _open_directory(a)
    try:
        lines = ls(d, a.prefix or "", None if a.limit <= 0 else a.limit)
    except KeyError as exc:
        print(f"stoker ls: {exc.args[0]}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def cmd_stat(a) -> int:
    """``stoker stat URL``: the summary as text, or as JSON with ``--json``."""
    d = _open_directory(a)
    if a.json:
        print(json.dumps({"url": a.url, **d.summary(), "class_names": list(d.index.classes)}, indent=2))
    else:
        for line in stat(d, a.url):
            print(line)
    return 0


def cmd_verify(a) -> int:
    """``stoker verify URL``: exit 0 when every shard and sample checks out, 1 otherwise."""
    r = verify(a.url, json_options(a.storage_options), a.workers, progress=show_progress(a))
    if a.json:
        print(json.dumps(r.as_dict(), indent=2))
    else:
        print(
            f"{r.url}: {r.samples} samples in {r.shards} shards, {r.bytes_read} bytes read: "
            + ("OK" if r.ok else f"{len(r.bad_samples)} bad samples, {len(r.bad_shards)} bad shards")
        )
        for b in r.bad_shards:
            print(f"  shard {b['shard']}: {b['reason']}")
        for b in r.bad_samples:
            print(f"  sample {b['key']!r} in {b['shard']}: {b['reason']}")
    return 0 if r.ok else 1


def add_parsers(sub) -> None:
    """Register ``pack``, ``ls``, ``stat`` and ``verify`` on the top-level subparsers ``sub``."""
    _add_pack(sub)

    p = sub.add_parser("ls", help="list the sample directory of a packed dataset under a key prefix")
    p.add_argument("url")
    p.add_argument("prefix", nargs="?", default="", help="directory or key (e.g. n01440764/)")
    p.add_argument("--limit", type=int, default=1000, help="most entries shown (0 = all; default 1000)")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.set_defaults(fn=cmd_ls)

    p = sub.add_parser(
        "stat",
        help="summary of a packed dataset: samples, bytes, shards, classes, version, "
        "and the class mapping (label -> class name)",
    )
    p.add_argument("url")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=cmd_stat)

    p = sub.add_parser("verify", help="check every shard and sample against the index; exit 1 if anything is wrong")
    p.add_argument("url")
    p.add_argument("--storage-options", help="fsspec storage options as JSON")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_verify)


def _add_pack(sub) -> None:
    """Register ``stoker pack``: its flags fill :func:`stoker.pack`'s keywords and a :class:`stoker.PackOptions`."""
    s = sub.add_parser(
        "pack", help="pack an ImageFolder tree, WebDataset shards or a file list into tar shards + a Parquet index"
    )
    s.add_argument(
        "src",
        help="fsspec URL: an ImageFolder root (<root>/<class>/<file>), WebDataset "
        ".tar/.tgz shards (file, directory, glob or {a..b} list), or a CSV/Parquet "
        "file list (columns path, label[, key])",
    )
    s.add_argument("dst", help="fsspec URL of the packed dataset")
    s.add_argument("--shard-size", type=size_arg, default=64 << 20, help="target shard size (default 64MiB)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset already at DST")
    s.add_argument(
        "--read-workers",
        type=int,
        default=16,
        help="source files read at once (threads; default 16): more for a far object store",
    )
    s.add_argument("--storage-options", help="fsspec storage options for SRC and DST, as JSON")
    s.add_argument(
        "--src-storage-options",
        "--src-options",
        dest="src_options",
        action=OptionsFlag,
        help="fsspec storage options for SRC only, as JSON (in place of --storage-options)",
    )
    s.add_argument(
        "--dst-storage-options",
        "--dst-options",
        dest="dst_options",
        action=OptionsFlag,
        help="fsspec storage options for DST only, as JSON (in place of --storage-options)",
    )
    s.add_argument(
        "--source",
        choices=["imagefolder", "webdataset", "filelist", "files", "parquet"],
        help="kind of source (default: detected from SRC); files: any directory tree, files grouped "
        "into samples by basename (utt1.flac + utt1.txt); parquet: rows whose --column holds "
        "the sample bytes (binary, or Hugging Face's {bytes, path} image/audio struct)",
    )
    s.add_argument(
        "--column", help="--source parquet: the column of the sample bytes (other columns are kept as fields)"
    )
    s.add_argument("--key-column", help="--source parquet: the column of the sample keys (default <file stem>/<row>)")
    s.add_argument(
        "--small-sample-bytes",
        type=size_arg,
        default=DEFAULT_SMALL_SAMPLE_BYTES,
        help="samples whose fields total fewer bytes are grouped, many to one tar member, at a few bytes "
        "each (default 4096; 0: one tar member per field, WebDataset's layout, for every sample)",
    )
    s.add_argument(
        "--shuffle-seed", type=int, default=0, help="seed of the random placement of samples in shards (default 0)"
    )
    s.add_argument("--no-shuffle", action="store_true", help="place samples in sorted order")
    s.add_argument(
        "--classes",
        metavar="FILE|URL",
        help="fix the labels: a class list (text, one name per line, label = line order; or "
        "JSON), or an existing packed dataset whose classes are reused; pack every split "
        "with the same list so that labels agree (read with the DST storage options)",
    )
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_pack)
