"""`stoker pack`: a source at any fsspec URL into tar shards plus a Parquet index.

Sources: :mod:`.sources` (which one, :func:`.sources.detect_source`, or ``source=``); the less
common settings travel in one :class:`PackOptions` (:mod:`.pack_options`). ImageFolder packs are
planned up front from the listing's file sizes, streamed sources are cut into shards as samples
arrive, by their actual sizes (both by :func:`cut`): every run over the same source makes the same
shards, each written whole with its manifest (:mod:`.manifests`). The index is written last
(this folder's README.md, "Invariants"): running an interrupted pack again reuses every finished
shard (ImageFolder: without reading its files again). A sample's members are written
contiguously, primary payload first, as tar members ``<key>.<field>``; sample ids are in sorted
key order for every source.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
from tqdm import tqdm

from .._units import parse_size
from ..errors import DatasetExistsError  # noqa: F401 - re-exported
from ..storage import Origin
from .anysource import iter_files, iter_parquet, list_file_samples
from .classlist import load_class_list
from .filelist import iter_file_list, read_file_list
from .lease import PackLease
from .manifests import ShardWriter, plan_hash, stream_hash
from .pack_options import PackOptions, resolve
from .publish import clear_destination, first_missing_dir, install_index, remove_if_empty
from .shards import estimate_sample_bytes
from .sources import SourceFile, detect_source, list_image_folder, resolve_labels
from .wds import expand_urls, iter_samples

DEFAULT_SHARD_BYTES = 64 << 20
T = TypeVar("T")


@dataclass
class PackResult:
    """Summary of a pack: counts, bytes (payload and on-origin shard bytes), seconds."""

    url: str
    samples: int
    classes: int
    shards: int
    payload_bytes: int
    shard_bytes: int
    reused_shards: int
    skipped_files: int
    seconds: float
    version: str
    source: str = "imagefolder"

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def cut(items: Iterable[T], size: Callable[[T], int], shard_bytes: int) -> Iterator[list[T]]:
    """The greedy split of ``items``, in their order, into shards of about ``shard_bytes`` by
    ``size(item)`` (at least one item each), each yielded once the next item does not fit."""
    batch: list[T] = []
    total = 0
    for x in items:
        n = size(x)
        if batch and total + n > shard_bytes:
            yield batch
            batch, total = [], 0
        batch.append(x)
        total += n
    if batch:
        yield batch


def pack(
    src: str,
    dst: str,
    *,
    source: str | None = None,
    classes: list[str] | str | None = None,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool = False,
    options: PackOptions | None = None,
    **deprecated,
) -> PackResult:
    """Pack the source at ``src`` into a stoker dataset at ``dst`` (fsspec URLs).

    ``source``: "imagefolder", "webdataset", "filelist", "files" (any file tree, members grouped
    into samples by basename) or "parquet" (rows of sample bytes in ``PackOptions.column``, e.g. a
    Hugging Face export; :mod:`.anysource`); default: chosen by what ``src`` is
    (:func:`stoker.store.sources.detect_source`: tar archive names, brace lists, globs, prefixes or
    a directory of archives -> webdataset; ``.csv``/``.parquet`` -> filelist; else ImageFolder).
    ``classes``: the class list, label = position (a list of names, or a URL: an existing packed
    dataset, whose class list is reused, or a text/JSON file, :mod:`.classlist`, read with the
    destination's storage options); packing every split with the same list gives identical labels.
    Without it, labels come from the source (ImageFolder: sorted class directories). The class
    list is recorded in the index (``stoker stat`` prints it); a class directory, or a streamed
    sample's label, that is not in it is a ValueError naming it. ``shard_bytes``: target shard
    size, an int or a string such as ``"64MiB"`` (:func:`stoker.parse_size`). ``overwrite``:
    replace a dataset at ``dst``. ``storage_options`` (fsspec; S3: ``endpoint_url``, ``key``,
    ``secret``, ``profile``, ...): for both URLs, unless ``options`` gives a side its own.
    ``progress``: a tqdm bar on stderr (a library call prints nothing by default). ``options``:
    the less common settings (:class:`PackOptions`); their old flat keywords (``read_workers=``,
    ``src_storage_options=``, ``src_options=``, ...) still work, with a DeprecationWarning.

    Every member is stored byte-exact (no decode). Keys are UTF-8 strings: a file or tar member
    whose name is not valid UTF-8 is refused with a ValueError naming it (keys are never
    rewritten); long (> 100 byte) and Unicode names are written with pax headers.

    One pack at a time writes a destination (:mod:`.lease`): the run holds a lease at ``dst``,
    renewed while it packs, and installs the index only while it still holds it.

    Raises:
        stoker.PackLeaseError: (a FileExistsError) at once, naming the other run and its lease's
            expiry, when another live pack holds ``dst``.
        stoker.PackLeaseLostError: (an OSError) this run's lease was taken over while it wrote
            (then it installs no index).
        stoker.DatasetExistsError: ``dst`` already holds an index and ``overwrite`` is false.
        stoker.SourceNotFoundError: (a FileNotFoundError) or :class:`stoker.SourceError` (a
            ValueError) from the source listing: missing source, broken symlink, duplicate keys,
            non-UTF-8 names.
        stoker.SourceArchiveError: (a tarfile.TarError) an unreadable source archive.
        stoker.OriginError: storage failures.
        TypeError: an unknown keyword, an old one with ``options``, ``options`` not a PackOptions.
    """
    t0 = time.perf_counter()
    options = resolve(options, deprecated, storage_options)
    shard_bytes = parse_size(shard_bytes, "shard_bytes")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    src, dst = os.fspath(src), os.fspath(dst)  # a pathlib.Path is a local path
    source_origin = Origin(src, options.src_storage_options or {})
    dest = Origin(dst, options.dst_storage_options or {})
    kind = detect_source(source_origin, source)
    _check_columns(kind, options)
    if classes is not None:
        classes = load_class_list(classes, options.dst_storage_options)
    if kind == "imagefolder":
        feed = partial(_pack_image_folder, source_origin, shard_bytes, progress, options, classes)
    else:
        feed = partial(_pack_stream, kind, src, source_origin, shard_bytes, progress, options, classes)
    made = first_missing_dir(dest)
    try:
        return _pack_into(dest, dst, kind, overwrite, options, feed, t0)
    except BaseException:
        if made is not None:
            remove_if_empty(dest, made)  # a failed first pack leaves no empty directories behind
        raise


def _check_columns(kind: str, options: PackOptions) -> None:
    """ValueError unless ``PackOptions.column`` is given with ``source="parquet"`` and only there,
    and ``key_column`` only there."""
    if (kind == "parquet") != (options.column is not None):
        raise ValueError(
            "PackOptions.column (--column) names the Parquet column of the sample bytes: it is needed "
            f"with source='parquet' and only there (source is {kind!r})"
        )
    if kind != "parquet" and options.key_column is not None:
        raise ValueError(
            f"PackOptions.key_column names a Parquet column: it is for source='parquet' (source is {kind!r})"
        )


def _pack_into(dest: Origin, dst: str, kind: str, overwrite: bool, options: PackOptions, feed, t0: float) -> PackResult:
    """The body of :func:`pack` from the lease on: ``feed(shards)`` writes the shards through a
    :class:`ShardWriter` and returns ``(labels, class names, class list, skipped files)``, one
    label and class name per row of ``shards.rows``; then the index is written."""
    with PackLease(dest, options.lease_s) as lease:
        clear_destination(dest, overwrite)
        shards = ShardWriter(dest, overwrite, lease.check, options)
        labels, class_names, class_list, skipped = feed(shards)
        rows = shards.rows
        version = install_index(dest, lease, rows, labels, class_names, class_list, shards.table)
    return PackResult(
        url=dst,
        samples=len(rows),
        classes=len(class_list),
        shards=len(shards.table),
        payload_bytes=rows.payload_bytes,
        shard_bytes=sum(s["bytes"] for s in shards.table),
        reused_shards=shards.reused,
        skipped_files=skipped,
        seconds=time.perf_counter() - t0,
        version=version,
        source=kind,
    )


def _placement(n: int, shuffle_seed: int | None) -> np.ndarray:
    """The order in which ``n`` listed samples are placed in the shards: a permutation from
    ``shuffle_seed``, or the listing's order (None)."""
    if shuffle_seed is None:
        return np.arange(n)
    return np.random.Generator(np.random.PCG64(int(shuffle_seed))).permutation(n)


def _pack_image_folder(
    source: Origin, shard_bytes: int, progress: bool, options: PackOptions, classes, shards: ShardWriter
) -> tuple[list, list, list, int]:
    """Pack an ImageFolder tree: planned up front from the listing's sizes, each shard's files read
    by ``options.read_workers`` threads, two shards in flight."""
    listing = list_image_folder(source, classes)
    placed = [listing.files[i] for i in _placement(len(listing.files), options.shuffle_seed)]
    small = int(options.small_sample_bytes)
    plan = list(cut(placed, lambda f: estimate_sample_bytes(f.key, [(f.field, f.size)], small), shard_bytes))
    total = sum(f.size for f in listing.files)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"pack {len(plan)} shards", disable=not progress, mininterval=0.5
    )
    pool = ThreadPoolExecutor(options.read_workers)

    def read_member(f: SourceFile):
        data = source.read(f.rel)
        bar.update(f.size)
        return f.key, [(f.field, data)]

    def do_shard(i: int, members: list[SourceFile]):
        man, reused = shards.write(i, plan_hash(members, small), lambda: list(pool.map(read_member, members)))
        if reused:
            bar.update(sum(f.size for f in members))
        return man, reused

    shard_pool = ThreadPoolExecutor(2)  # two shards in flight: one being read while the previous is uploaded
    try:
        for done in shard_pool.map(lambda a: do_shard(*a), enumerate(plan)):
            shards.add(*done)
    finally:
        # on an error or Ctrl-C: the shards not started are dropped, the two in flight finish
        shard_pool.shutdown(cancel_futures=True)
        pool.shutdown(cancel_futures=True)
        bar.close()
    info = {f.key: f for f in listing.files}
    files = [info[key] for key in shards.rows]
    return [f.label for f in files], [f.class_name for f in files], listing.classes, len(listing.skipped)


def _stream_of(kind: str, src: str, source: Origin, options: PackOptions, skipped: list):
    """(the samples of a streamed source in the order they are packed, their count or None)."""
    if kind == "webdataset":
        urls = expand_urls(src, options.src_storage_options)
        return iter_samples(urls, options.src_storage_options, skipped), None
    if kind == "parquet":
        assert options.column is not None  # pack checked it
        return iter_parquet(source, options.column, options.key_column), None
    if kind == "files":
        listing = list_file_samples(source)
        order = _placement(len(listing), options.shuffle_seed)
        return iter_files(source, order, listing, options.read_workers), len(listing)
    fl = read_file_list(source)
    order = _placement(len(fl), options.shuffle_seed)
    return iter_file_list(fl, order, options.src_storage_options, options.read_workers), len(fl)


def _stream_bytes(sample: tuple[str, list], small_sample_bytes: int) -> int:
    key, members = sample
    return estimate_sample_bytes(key, [(f, len(d)) for f, d in members], small_sample_bytes)


def _pack_stream(
    kind: str,
    src: str,
    source: Origin,
    shard_bytes: int,
    progress: bool,
    options: PackOptions,
    classes,
    shards: ShardWriter,
) -> tuple[list, list, list, int]:
    """Pack a streamed source (WebDataset, Parquet, a file tree or list): cut into shards as
    samples arrive, by their actual sizes."""
    skipped: list = []
    small = int(options.small_sample_bytes)
    samples, total = _stream_of(kind, src, source, options, skipped)
    bar = tqdm(total=total, unit=" samples", desc=f"pack {kind}", disable=not progress, mininterval=0.5)
    raw_labels: list = []  # a duplicate key is found when the index is built (install_index)

    def checked():  # (key, members): a shard's samples held without their labels and origins
        for s in samples:
            raw_labels.append(s.label)
            bar.update(1)
            yield s.key, s.members

    def do_shard(i: int, batch: list[tuple[str, list]]):
        return shards.write(i, stream_hash(batch, small), lambda: batch)

    with ThreadPoolExecutor(1) as writer:  # one shard uploading while the next is read
        pending = None
        for batch in cut(checked(), partial(_stream_bytes, small_sample_bytes=small), shard_bytes):
            if pending is not None:
                shards.add(*pending.result())
            pending = writer.submit(do_shard, len(shards.table), batch)
        if pending is not None:
            shards.add(*pending.result())
    bar.close()
    if not len(shards.rows):
        raise ValueError(f"source {src}: no samples found ({kind})")
    labels, cnames, class_list = resolve_labels(raw_labels, classes, shards.rows)
    return labels, cnames, class_list, len(skipped)
