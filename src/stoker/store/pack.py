"""`stoker pack`: a source at any fsspec URL into tar shards plus a Parquet index.

Sources (chosen by :func:`.sources.detect_source`, or ``source=``): ImageFolder
trees, WebDataset shards (:mod:`.wds`), CSV/Parquet file lists (:mod:`.filelist`).

ImageFolder packs are planned up front (sorted files, greedy shards of about
``shard_bytes``) from the listing's file sizes. Streamed sources (WebDataset,
file lists) are cut into shards as samples arrive, by their actual sizes. Either
way every run over the same source makes the same shards. Each shard is written
whole (atomically), followed by a small manifest ``shards/<name>.json`` with its
members and the plan's hash. The index is written last, atomically: a pack that
is interrupted leaves no index, so it is never opened as a dataset, and running
it again reuses every shard whose manifest matches (ImageFolder: without reading
its files again; streamed sources are read again but matching shards are not
rewritten) and finishes the job.

A sample's members are written contiguously, primary payload first, as tar
members ``<key>.<field>``; sample ids are in sorted key order for every source.
"""

from __future__ import annotations

import json
import posixpath
import logging
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
from tqdm import tqdm

from .._units import parse_size
from ..errors import DatasetExistsError  # noqa: F401 - re-exported
from .._procs import pid_alive
from ..storage import Origin
from .anysource import iter_files, iter_parquet, list_file_samples
from .classlist import load_class_list
from .filelist import iter_file_list, read_file_list
from .lease import DEFAULT_LEASE_S, PackLease
from .index import INDEX_NAME, SHARD_DIR, build_table, table_to_bytes
from .shards import build_shard, estimate_member_bytes, member_name
from .sources import SourceFile, StreamSample, detect_source, list_image_folder, resolve_labels
from .wds import expand_urls, iter_samples

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 64 << 20
#: Version of the shard manifest layout, part of every plan hash.
MANIFEST_FORMAT = 2


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


def plan_shards(files: list[SourceFile], shard_bytes: int) -> list[list[SourceFile]]:
    """Greedy split of the sorted files into shards of about ``shard_bytes`` (at least one sample each)."""
    shards: list[list[SourceFile]] = []
    cur: list[SourceFile] = []
    cur_bytes = 0
    for f in files:
        est = estimate_member_bytes(f.key, f.field, f.size)
        if cur and cur_bytes + est > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(f)
        cur_bytes += est
    if cur:
        shards.append(cur)
    return shards


def _plan_hash(members: list[SourceFile]) -> str:
    h = xxhash.xxh3_64(f"v{MANIFEST_FORMAT}\n".encode())
    for f in members:
        h.update(f"{f.rel}\0{f.size}\0{f.stamp}\0{f.key}\0{f.label}\0{f.field}\n".encode())
    return h.hexdigest()


def _stream_hash(samples: list[StreamSample]) -> str:
    h = xxhash.xxh3_64(f"v{MANIFEST_FORMAT}-stream\n".encode())
    for s in samples:
        for field, data in s.members:
            h.update(f"{s.key}\0{field}\0{len(data)}\n".encode())
            h.update(data)
    return h.hexdigest()


def _shard_name(i: int) -> str:
    return f"{SHARD_DIR}/shard-{i:06d}.tar"


def _reusable(dest: Origin, name: str, phash: str, overwrite: bool) -> dict | None:
    """The manifest of shard ``name`` if it was written by the same plan and is whole, else None."""
    manifest_rel = f"{name}.json"
    try:
        if not overwrite and dest.exists(manifest_rel):
            man = json.loads(dest.read(manifest_rel))
            if man.get("plan") == phash and dest.exists(name) and dest.size(name) == man["bytes"]:
                return man
    except (ValueError, KeyError, OSError) as exc:
        log.warning("ignoring unreadable manifest %s: %s", dest.full_url(manifest_rel), exc)
    return None


def _write_shard(dest: Origin, name: str, phash: str, samples: list[tuple[str, list]]) -> dict:
    """Build and write one shard of ``samples`` = ``[(key, [(field, bytes), ...])]`` and its manifest."""
    flat = [(member_name(key, field), data) for key, members in samples for field, data in members]
    data, entries = build_shard(flat)
    dest.write_atomic(name, data)
    it = iter(entries)
    rows = [[key, [[field, *next(it)] for field, _ in members]] for key, members in samples]
    man = {"name": name, "bytes": len(data), "plan": phash, "format": MANIFEST_FORMAT, "samples": rows}
    etag = _etag(dest, name)
    if etag:
        man["etag"] = etag
    dest.write_atomic(f"{name}.json", json.dumps(man).encode())
    return man


def _etag(dest: Origin, name: str) -> str | None:
    """The object store's ETag of a shard just written (None on filesystems without one), so
    that opening the dataset can tell a same-size rewrite of the shard (verify.check_shards)."""
    try:
        info = dest.info(name)  # asked now: never a listing cached before the write
    except (OSError, ValueError):
        return None
    tag = info.get("ETag") or info.get("etag")
    return str(tag).strip('"') if tag else None


def pack(
    src: str,
    dst: str,
    *,
    shard_bytes: int | str = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    storage_options: dict | None = None,
    src_storage_options: dict | None = None,
    dst_storage_options: dict | None = None,
    read_workers: int = 16,
    progress: bool = False,
    shuffle_seed: int | None = 0,
    source: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    classes: list[str] | str | None = None,
    src_options: dict | None = None,
    dst_options: dict | None = None,
    column: str | None = None,
    key_column: str | None = None,
) -> PackResult:
    """Pack the source at ``src`` into a stoker dataset at ``dst`` (fsspec URLs).

    Storage options (fsspec; S3: ``endpoint_url``, ``key``, ``secret``, ``profile``, ...):
    ``storage_options`` for both URLs (one store), or ``src_storage_options`` /
    ``dst_storage_options`` for each side, which take the place of ``storage_options`` on that
    side. ``src_options`` / ``dst_options`` are the deprecated names of the per-side pair (a
    DeprecationWarning; ValueError when given with the new name of the same side).

    ``source``: "imagefolder", "webdataset", "filelist", "files" (any file tree, members grouped
    into samples by basename) or "parquet" (rows of sample bytes in ``column``, e.g. a Hugging Face
    export; ``key_column`` optional), see :mod:`.anysource`; default: chosen by what
    ``src`` is (:func:`stoker.store.sources.detect_source`: tar archive names, brace
    lists, globs, prefixes or a directory of archives -> webdataset; ``.csv``/
    ``.parquet`` -> filelist; otherwise an ImageFolder tree).
    ``shard_bytes``: target shard size in bytes, an int or a string such as ``"64MiB"``
    (:func:`stoker.parse_size`; default 64 MiB). ``read_workers``:
    concurrent source reads. ``progress``: a tqdm bar on stderr (off by default: a library call
    prints nothing; ``stoker pack`` shows it on a terminal). ``shuffle_seed``: ImageFolder and file-list samples are
    placed in the shards in a random order from this seed (None = source order), so
    that any run of a shard mixes classes; WebDataset samples keep their archive
    order (archives are streams; WebDataset shards are normally shuffled when made).
    Sample ids are in sorted key order either way.

    Every member is stored byte-exact (no decode): images, and non-image payloads
    as raw bytes. Keys are UTF-8 strings: a file or tar member whose name is not
    valid UTF-8 is refused with a ValueError naming it (keys are never rewritten).
    Long (> 100 byte) and Unicode names are written with pax headers.

    ``classes``: the class list, label = position (a list of names, or a URL: an
    existing packed dataset, whose class list is reused, or a text/JSON file; see
    :mod:`.classlist`; a URL is read with the destination's storage options). Packing every split with
    the same list gives identical labels. Without it, labels come from the source
    (ImageFolder: sorted class directories). The class list is recorded in the index
    metadata (``stoker stat`` prints it). A class directory, or a streamed sample's
    label, that is not in the list is a ValueError naming it.

    One pack at a time writes a destination: the run holds a lease object at ``dst``
    (:mod:`.lease`, ``lease_s`` seconds long, renewed while it packs) and installs the
    index only while it still holds it. Raises
    :class:`stoker.store.lease.PackLeaseError` (a FileExistsError) at once, naming the
    other run and its lease's expiry, when another live pack holds ``dst``, and
    :class:`stoker.store.lease.PackLeaseLostError` (an OSError) when this run's lease
    was taken over while it wrote (then it installs no index).

    Raises :class:`DatasetExistsError` if ``dst`` already holds an index and
    ``overwrite`` is false; :class:`stoker.SourceNotFoundError` (a FileNotFoundError) or
    :class:`stoker.SourceError` (a ValueError) from the source listing (missing source,
    broken symlink, duplicate keys, non-UTF-8 names); :class:`stoker.SourceArchiveError`
    (a tarfile.TarError) for an unreadable source archive; :class:`stoker.storage.OriginError` on storage failures.
    """
    shard_bytes = parse_size(shard_bytes, "shard_bytes")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    src_options = side_options("src", storage_options, src_storage_options, src_options)
    dst_options = side_options("dst", storage_options, dst_storage_options, dst_options)
    t0 = time.perf_counter()
    source_origin = Origin(src, src_options or {})
    dest = Origin(dst, dst_options or {})
    kind = detect_source(source_origin, source)
    if (kind == "parquet") != (column is not None):
        raise ValueError(
            "column (--column) names the Parquet column of the sample bytes: it is needed with "
            f"source='parquet' and only there (source is {kind!r})"
        )
    if classes is not None:
        classes = load_class_list(classes, dst_options)
    made = _first_missing_dir(dest)
    try:
        return _pack_into(
            dest,
            dst,
            kind,
            src,
            source_origin,
            src_options,
            shard_bytes,
            overwrite,
            read_workers,
            progress,
            shuffle_seed,
            classes,
            column,
            key_column,
            lease_s,
            t0,
        )
    except BaseException:
        if made is not None:
            _remove_if_empty(dest, made)  # a failed first pack leaves no empty directories behind
        raise


def _first_missing_dir(dest: Origin) -> str | None:
    """The highest directory of the destination's path that does not exist yet (the root itself
    or one of its parents), which a pack would create; None when the root exists, and where the
    filesystem is not a local one (object stores have no directories to leave behind, and a
    listing there would fill fsspec's listing cache)."""
    protocol = dest.fs.protocol
    if "file" not in (protocol if isinstance(protocol, (tuple, list)) else (protocol,)):
        return None
    try:
        path, missing = os.path.abspath(dest.root), None
        while not os.path.isdir(path):
            if os.path.lexists(path):  # a file in the way: the pack fails, nothing of ours to remove
                return None
            missing, parent = path, os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        return missing
    except OSError:  # unknown: treated as existing, so nothing is removed
        return None


def _remove_if_empty(dest: Origin, top: str) -> None:
    """Remove ``top`` (the highest directory a failed pack created) if it holds no file; one with
    any file, such as a finished shard the next pack reuses, is kept."""
    try:
        if not dest.fs.find(top):
            dest.fs.rm(top, recursive=True)
    except Exception:  # noqa: BLE001 - tidying must not hide the pack's own error
        pass


def _pack_into(
    dest,
    dst,
    kind,
    src,
    source_origin,
    src_options,
    shard_bytes,
    overwrite,
    read_workers,
    progress,
    shuffle_seed,
    classes,
    column,
    key_column,
    lease_s,
    t0,
) -> PackResult:
    """The body of :func:`pack` from the lease on (arguments as there)."""
    with PackLease(dest, lease_s) as lease:
        if dest.exists(INDEX_NAME):
            if not overwrite:
                raise DatasetExistsError(
                    f"the destination {dst} already holds a dataset "
                    f"({dest.full_url(INDEX_NAME)} exists; pass --overwrite to replace it)"
                )
            dest.retry(dest.full_url(INDEX_NAME), lambda: dest.fs.rm(dest.path(INDEX_NAME)))
        if kind == "imagefolder":
            done = _pack_image_folder(
                source_origin, dest, shard_bytes, overwrite, read_workers, progress, shuffle_seed, lease.check, classes
            )
        else:
            done = _pack_stream(
                kind,
                src,
                source_origin,
                dest,
                shard_bytes,
                overwrite,
                read_workers,
                progress,
                shuffle_seed,
                src_options,
                lease.check,
                classes,
                (column, key_column),
            )
        shard_table, rows, labels, class_names, class_list, reused, skipped = done
        order = sorted(range(len(rows)), key=lambda j: rows[j][0])
        keys = [rows[j][0] for j in order]
        prim = [rows[j][2][0] for j in order]
        table, version = build_table(
            keys,
            [labels[j] for j in order],
            [class_names[j] for j in order],
            [rows[j][1] for j in order],
            [p[1] for p in prim],
            [p[2] for p in prim],
            [p[3] for p in prim],
            shard_table,
            class_list,
            field=[p[0] for p in prim],
            fields=[[tuple(m) for m in rows[j][2][1:]] or None for j in order],
        )
        lease.renew()  # still ours, with a full lease_s ahead for the index write
        dest.write_atomic(INDEX_NAME, table_to_bytes(table))
        _remove_stale_shards(dest, {s["name"] for s in shard_table})
    payload = sum(m[2] for r in rows for m in r[2])
    return PackResult(
        url=dst,
        samples=len(keys),
        classes=len(class_list),
        shards=len(shard_table),
        payload_bytes=int(payload),
        shard_bytes=sum(s["bytes"] for s in shard_table),
        reused_shards=reused,
        skipped_files=skipped,
        seconds=time.perf_counter() - t0,
        version=version,
        source=kind,
    )


def finished_shards(dst: str, storage_options: dict | None = None) -> int:
    """Shards of an unfinished pack at ``dst`` that are complete (a shard and its manifest), which
    the next pack of the same source reuses. 0 when nothing can be listed."""
    dest = Origin(dst, storage_options or {}, retry_budget_s=0)
    try:
        names = {posixpath.basename(e["name"].rstrip("/")) for e in dest.ls(SHARD_DIR)}
    except Exception:  # noqa: BLE001 - only a count in a message is lost
        return 0
    return sum(1 for n in names if n.endswith(".tar") and f"{n}.json" in names)


def side_options(side: str, both: dict | None, new: dict | None, old: dict | None) -> dict:
    """The storage options of one side (``"src"`` or ``"dst"``) of :func:`pack`: the side's own
    (``<side>_storage_options``, or its deprecated name ``<side>_options``, with a
    DeprecationWarning), else the shared ``storage_options``, else ``{}``.
    Raises ValueError when both names of one side are given."""
    if old is not None:
        if new is not None:
            raise ValueError(f"pack: give {side}_storage_options or its old name {side}_options, not both")
        warnings.warn(
            f"pack(): {side}_options= is deprecated; use {side}_storage_options= (or storage_options= for both URLs)",
            DeprecationWarning,
            stacklevel=3,
        )
        new = old
    return dict(new if new is not None else both or {})


def _remove_stale_shards(dest: Origin, keep: set) -> None:
    """After the index is written: delete shards and manifests of an earlier pack that the
    new index does not use (an --overwrite with fewer shards), and temporary files of
    writers that died (a pack killed mid-write)."""
    try:
        names = [e["name"] for e in dest.ls(SHARD_DIR)]  # listed now, not from a cached listing
    except FileNotFoundError:
        return
    for full in names:
        base = posixpath.basename(full.rstrip("/"))
        rel = f"{SHARD_DIR}/{base}"
        shard = rel[:-5] if rel.endswith(".json") else rel
        if shard in keep:
            continue
        if ".tmp-" in base:
            pid = base.split(".tmp-", 1)[1].split("-")[0]
            if pid.isdigit() and pid_alive(int(pid)):
                continue
        try:
            dest.fs.rm(full)
        except FileNotFoundError:
            pass


def _rows_of(shard: int, man: dict) -> list:
    """``[(key, shard, [[field, offset, length, checksum], ...])]`` of one shard manifest."""
    return [(key, shard, members) for key, members in man["samples"]]


def _pack_image_folder(
    source: Origin, dest: Origin, shard_bytes, overwrite, read_workers, progress, shuffle_seed, guard, classes
):
    listing = list_image_folder(source, classes)
    placed = listing.files
    if shuffle_seed is not None:
        perm = np.random.Generator(np.random.PCG64(int(shuffle_seed))).permutation(len(placed))
        placed = [placed[i] for i in perm]
    plan = plan_shards(placed, shard_bytes)
    total = sum(f.size for f in listing.files)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"pack {len(plan)} shards", disable=not progress, mininterval=0.5
    )
    pool = ThreadPoolExecutor(read_workers)

    def do_shard(i: int, members: list[SourceFile]):
        name = _shard_name(i)
        phash = _plan_hash(members)
        man = _reusable(dest, name, phash, overwrite)
        if man is not None:
            bar.update(sum(f.size for f in members))
            return man, True

        def read_member(f: SourceFile):
            data = source.read(f.rel)
            bar.update(f.size)
            return f.key, [(f.field, data)]

        guard()
        return _write_shard(dest, name, phash, list(pool.map(read_member, members))), False

    shard_pool = ThreadPoolExecutor(2)  # two shards in flight: one being read while the previous is uploaded
    try:
        results = list(shard_pool.map(lambda a: do_shard(*a), enumerate(plan)))
    finally:
        # on an error or Ctrl-C: the shards not started are dropped, the two in flight finish
        shard_pool.shutdown(cancel_futures=True)
        pool.shutdown(cancel_futures=True)
        bar.close()
    info = {f.key: f for f in listing.files}
    shard_table, rows = [], []
    for i, (members, (man, _)) in enumerate(zip(plan, results)):
        shard_table.append(
            {
                "name": man["name"],
                "bytes": man["bytes"],
                "samples": len(members),
                **({"etag": man["etag"]} if man.get("etag") else {}),
            }
        )
        rows += _rows_of(i, man)
    labels = [info[r[0]].label for r in rows]
    cnames = [info[r[0]].class_name for r in rows]
    reused = sum(1 for _, r in results if r)
    return shard_table, rows, labels, cnames, listing.classes, reused, len(listing.skipped)


def _pack_stream(
    kind,
    src,
    source: Origin,
    dest: Origin,
    shard_bytes,
    overwrite,
    read_workers,
    progress,
    shuffle_seed,
    src_options,
    guard,
    classes,
    columns=(None, None),
):
    skipped: list = []
    if kind == "webdataset":
        samples = iter_samples(expand_urls(src, src_options), src_options, skipped)
        total = None
    elif kind == "parquet":
        samples, total = iter_parquet(source, columns[0], columns[1]), None
    elif kind == "files":
        listing = list_file_samples(source)
        order = np.arange(len(listing))
        if shuffle_seed is not None:
            order = np.random.Generator(np.random.PCG64(int(shuffle_seed))).permutation(len(listing))
        samples, total = iter_files(source, order, listing, read_workers), len(listing)
    else:
        fl = read_file_list(source)
        order = np.arange(len(fl))
        if shuffle_seed is not None:
            order = np.random.Generator(np.random.PCG64(int(shuffle_seed))).permutation(len(fl))
        samples = iter_file_list(fl, order, src_options, read_workers)
        total = len(fl)
    bar = tqdm(total=total, unit=" samples", desc=f"pack {kind}", disable=not progress, mininterval=0.5)
    shard_table, rows, raw_labels = [], [], []
    seen: dict[str, str] = {}  # key -> where it came from
    raw_keys: list[str] = []
    reused = 0
    pending = None

    def finish(fut) -> None:
        nonlocal reused
        i, man, was_reused = fut.result()
        shard_table.append(
            {
                "name": man["name"],
                "bytes": man["bytes"],
                "samples": len(man["samples"]),
                **({"etag": man["etag"]} if man.get("etag") else {}),
            }
        )
        rows.extend(_rows_of(i, man))
        reused += was_reused

    def do_shard(i: int, batch: list[StreamSample]):
        name, phash = _shard_name(i), _stream_hash(batch)
        man = _reusable(dest, name, phash, overwrite)
        if man is not None:
            return i, man, True
        guard()
        return i, _write_shard(dest, name, phash, [(s.key, s.members) for s in batch]), False

    with ThreadPoolExecutor(1) as writer:  # one shard uploading while the next is read
        batch: list[StreamSample] = []
        est = 0
        for s in samples:
            if s.key in seen:
                raise ValueError(f"source {src}: duplicate key {s.key!r} in {seen[s.key]} and {s.where}")
            seen[s.key] = s.where
            raw_labels.append(s.label)
            raw_keys.append(s.key)
            size = sum(estimate_member_bytes(s.key, f, len(d)) for f, d in s.members)
            if batch and est + size > shard_bytes:
                if pending is not None:
                    finish(pending)
                pending = writer.submit(do_shard, len(shard_table), batch)
                batch, est = [], 0
            batch.append(s)
            est += size
            bar.update(1)
        if pending is not None:
            finish(pending)
            pending = None
        if batch:
            finish(writer.submit(do_shard, len(shard_table), batch))
    bar.close()
    if not rows:
        raise ValueError(f"source {src}: no samples found ({kind})")
    labels, cnames, class_list = resolve_labels(raw_labels, classes, raw_keys)
    return shard_table, rows, labels, cnames, class_list, reused, len(skipped)
