"""`stoker pack`: an ImageFolder tree at any fsspec URL into tar shards plus a Parquet index.

The pack is planned up front (sorted files, greedy shards of about ``shard_bytes``),
so every run over the same source makes the same shards. Each shard is written
whole (atomically), followed by a small manifest ``shards/<name>.json`` with its
entries and the plan's hash. The index is written last, atomically: a pack that is
interrupted leaves no index, so it is never opened as a dataset, and running it
again reuses every shard whose manifest matches the plan and finishes the job.
"""
from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash
from tqdm import tqdm

from ..storage import Origin
from .index import INDEX_NAME, SHARD_DIR, build_table, table_to_bytes
from .shards import build_shard, estimate_member_bytes, member_name
from .sources import SourceFile, list_image_folder

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 64 << 20


class DatasetExistsError(FileExistsError):
    """The destination already holds a packed dataset (pass overwrite=True)."""


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

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def plan_shards(files: list[SourceFile], shard_bytes: int) -> list[list[SourceFile]]:
    """Greedy split of the sorted files into shards of about ``shard_bytes`` (at least one sample each)."""
    shards, cur, cur_bytes = [], [], 0
    for f in files:
        est = estimate_member_bytes(f.key, f.ext, f.size)
        if cur and cur_bytes + est > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(f)
        cur_bytes += est
    if cur:
        shards.append(cur)
    return shards


def _plan_hash(members: list[SourceFile]) -> str:
    h = xxhash.xxh3_64()
    for f in members:
        h.update(f"{f.rel}\0{f.size}\0{f.stamp}\0{f.key}\0{f.label}\n".encode())
    return h.hexdigest()


def _shard_name(i: int) -> str:
    return f"{SHARD_DIR}/shard-{i:06d}.tar"


def pack(src: str, dst: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
         src_options: dict | None = None, dst_options: dict | None = None,
         read_workers: int = 16, progress: bool = True, shuffle_seed: int | None = 0) -> PackResult:
    """Pack the ImageFolder tree at ``src`` into a stoker dataset at ``dst`` (fsspec URLs).

    ``shard_bytes``: target shard size in bytes (default 64 MiB). ``read_workers``:
    concurrent source reads. ``shuffle_seed``: samples are placed in the shards in
    a random order from this seed (None = sorted), so that any run of a shard mixes
    classes (what a windowed/quasi-random read order needs); sample ids stay in
    sorted key order either way. Raises :class:`DatasetExistsError` if ``dst`` already
    holds an index and ``overwrite`` is false; FileNotFoundError/ValueError from the
    source listing; :class:`stoker.storage.OriginError` on storage failures.
    """
    t0 = time.perf_counter()
    source = Origin(src, src_options or {})
    dest = Origin(dst, dst_options or {})
    if dest.exists(INDEX_NAME):
        if not overwrite:
            raise DatasetExistsError(f"{dest.full_url(INDEX_NAME)} exists: {dst} already holds a "
                                     "dataset (pass --overwrite to replace it)")
        dest.fs.rm(dest.path(INDEX_NAME))
    listing = list_image_folder(source)
    placed = listing.files
    if shuffle_seed is not None:
        perm = np.random.Generator(np.random.PCG64(int(shuffle_seed))).permutation(len(placed))
        placed = [placed[i] for i in perm]
    plan = plan_shards(placed, shard_bytes)
    total = sum(f.size for f in listing.files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"pack {len(plan)} shards",
               disable=not progress, mininterval=0.5)
    pool = ThreadPoolExecutor(read_workers)

    def do_shard(i: int, members: list[SourceFile]):
        name = _shard_name(i)
        manifest_rel = f"{name}.json"
        phash = _plan_hash(members)
        try:
            if not overwrite and dest.exists(manifest_rel):
                man = json.loads(dest.read(manifest_rel))
                if man.get("plan") == phash and dest.exists(name) and dest.size(name) == man["bytes"]:
                    bar.update(sum(f.size for f in members))
                    return man, True
        except (ValueError, KeyError, OSError) as exc:
            log.warning("ignoring unreadable manifest %s: %s", dest.full_url(manifest_rel), exc)

        def read_member(f: SourceFile):
            data = source.read(f.rel)
            bar.update(f.size)
            return member_name(f.key, f.ext), data

        payloads = list(pool.map(read_member, members))
        data, entries = build_shard(payloads)
        dest.write_atomic(name, data)
        man = {"name": name, "bytes": len(data), "plan": phash,
               "entries": [[off, n, ck] for off, n, ck in entries]}
        dest.write_atomic(manifest_rel, json.dumps(man).encode())
        return man, False

    try:
        # Two shards in flight: one being read while the previous is uploaded.
        with ThreadPoolExecutor(2) as shard_pool:
            results = list(shard_pool.map(lambda a: do_shard(*a), enumerate(plan)))
    finally:
        pool.shutdown()
        bar.close()

    shard_table, where = [], {}
    for i, (members, (man, _)) in enumerate(zip(plan, results)):
        shard_table.append({"name": man["name"], "bytes": man["bytes"], "samples": len(members)})
        for f, entry in zip(members, man["entries"]):
            where[f.key] = (i, *entry)
    files = listing.files  # sample ids in sorted key order
    keys = [f.key for f in files]
    labels = [f.label for f in files]
    cnames = [f.class_name for f in files]
    shard_ids, offsets, lengths, checks = zip(*(where[k] for k in keys)) if keys else ((), (), (), ())
    table, version = build_table(keys, labels, cnames, shard_ids, offsets, lengths, checks,
                                 shard_table, listing.classes)
    dest.write_atomic(INDEX_NAME, table_to_bytes(table))
    return PackResult(url=dst, samples=len(keys), classes=len(listing.classes), shards=len(plan),
                      payload_bytes=int(sum(lengths)), shard_bytes=sum(s["bytes"] for s in shard_table),
                      reused_shards=sum(1 for _, reused in results if reused),
                      skipped_files=len(listing.skipped), seconds=time.perf_counter() - t0,
                      version=version)
