"""The shards a pack writes and their manifests: what makes a pack resumable.

Each shard is written whole (atomically), followed by a small manifest ``shards/<name>.json``
with its members and the hash of the plan that made it. A run of the same plan reuses every
shard whose manifest matches and whose size agrees (:meth:`ShardWriter.write`); once the index
is written, the shards of an earlier pack that it does not use are removed
(:func:`remove_stale_shards`), and so are the manifests (:func:`remove_manifests`): a finished
dataset is its index and its shards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
from collections.abc import Callable

import xxhash

from .._procs import pid_alive
from ..storage import Origin
from .index import SHARD_DIR
from .pack_options import PackOptions
from .rows import Rows, decode, encode
from .shards import DEFAULT_SMALL_SAMPLE_BYTES, build_shard
from .sources import SourceFile

log = logging.getLogger(__name__)

#: Version of the shard manifest layout, part of every plan hash (3: columnar rows, :mod:`.rows`).
MANIFEST_FORMAT = 3


def plan_hash(members: list[SourceFile], small_sample_bytes: int = DEFAULT_SMALL_SAMPLE_BYTES) -> str:
    """The hash of a planned ImageFolder shard: its files' paths, sizes, stamps, keys, labels, fields,
    and the small-sample threshold (which sets the layout, :mod:`.shards`)."""
    h = xxhash.xxh3_64(f"v{MANIFEST_FORMAT}{_layout(small_sample_bytes)}\n".encode())
    for f in members:
        h.update(f"{f.rel}\0{f.size}\0{f.stamp}\0{f.key}\0{f.label}\0{f.field}\n".encode())
    return h.hexdigest()


def _layout(small_sample_bytes: int) -> str:
    """The threshold's part of a plan hash ("" for the default, so default plans hash as before)."""
    return "" if small_sample_bytes == DEFAULT_SMALL_SAMPLE_BYTES else f"-small{int(small_sample_bytes)}"


def stream_hash(samples: list[tuple[str, list]], small_sample_bytes: int = DEFAULT_SMALL_SAMPLE_BYTES) -> str:
    """The hash of a streamed shard of ``samples`` = ``[(key, [(field, bytes), ...])]``: their
    keys, fields and bytes, and the small-sample threshold."""
    h = xxhash.xxh3_64(f"v{MANIFEST_FORMAT}-stream{_layout(small_sample_bytes)}\n".encode())
    for key, members in samples:
        for field, data in members:
            h.update(f"{key}\0{field}\0{len(data)}\n".encode())
            h.update(data)
    return h.hexdigest()


class ShardWriter:
    """The shards of one pack at ``dest``, in shard order: each written whole with its manifest,
    or reused from an earlier run of the same plan (unless ``overwrite``). ``guard()`` is called
    before each write (the lease check: it raises when the lease was lost); ``options`` (a
    :class:`.pack_options.PackOptions`): samples under its ``small_sample_bytes`` are grouped
    (:mod:`.shards`).

    :meth:`write` may run in several threads; :meth:`add` records the shards in order, into
    ``table`` (the index's shard table), ``rows`` (:class:`.rows.Rows`: key, shard, members per
    sample, columnar) and ``reused`` (a count).
    """

    def __init__(self, dest: Origin, overwrite: bool, guard: Callable[[], None], options: PackOptions | None = None):
        self.dest, self.overwrite, self.guard = dest, overwrite, guard
        self.options = options or PackOptions()
        self.table: list[dict] = []
        self.rows = Rows()
        self.reused = 0

    def write(self, i: int, phash: str, read: Callable[[], list[tuple[str, list]]]) -> tuple[dict, bool]:
        """(manifest, reused) of shard ``i`` of plan hash ``phash``: the one a run of the same plan
        finished, else one written from ``read()`` = ``[(key, [(field, bytes), ...])]``."""
        name = f"{SHARD_DIR}/shard-{i:06d}.tar"
        man = _reusable(self.dest, name, phash, self.overwrite)
        if man is not None:
            return man, True
        self.guard()
        options = self.options
        return write_shard(self.dest, name, phash, read(), int(options.small_sample_bytes)), False

    def add(self, man: dict, reused: bool) -> None:
        """Record the next shard (its manifest and whether it was reused)."""
        shard_rows = decode(man["rows"])
        i, entry = len(self.table), {"name": man["name"], "bytes": man["bytes"], "samples": len(shard_rows)}
        self.table.append({**entry, "etag": man["etag"]} if man.get("etag") else entry)
        self.rows.extend(shard_rows, i)
        self.reused += reused


def _reusable(dest: Origin, name: str, phash: str, overwrite: bool) -> dict | None:
    """The manifest of shard ``name`` if it was written by the same plan and is whole, else None."""
    manifest_rel = f"{name}.json"
    try:
        if not overwrite and dest.exists(manifest_rel):
            man = json.loads(dest.read(manifest_rel))
            if man.get("plan") == phash and dest.exists(name) and dest.size(name) == man["bytes"]:
                decode(man["rows"])  # readable, or the shard is written again
                return man
    except (ValueError, KeyError, OSError) as exc:
        log.warning("ignoring unreadable manifest %s: %s", dest.full_url(manifest_rel), exc)
    return None


def write_shard(
    dest: Origin,
    name: str,
    phash: str,
    samples: list[tuple[str, list]],
    small_sample_bytes: int = DEFAULT_SMALL_SAMPLE_BYTES,
) -> dict:
    """Build and write one shard of ``samples`` = ``[(key, [(field, bytes), ...])]``, samples under
    ``small_sample_bytes`` grouped (:func:`.shards.build_shard`), and its manifest (returned);
    :class:`stoker.storage.OriginError` on storage failures."""
    data, entries = build_shard(samples, small_sample_bytes)
    dest.write_atomic(name, data)
    size = len(data)
    del data
    it = iter(entries)
    rows = Rows()
    for key, members in samples:
        rows.append(key, 0, [(field, *next(it)) for field, _ in members])
    del entries
    man = {"name": name, "bytes": size, "plan": phash, "format": MANIFEST_FORMAT, "rows": encode(rows)}
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


def remove_stale_shards(dest: Origin, keep: set) -> None:
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
        with contextlib.suppress(FileNotFoundError):
            dest.fs.rm(full)


def remove_manifests(dest: Origin, shards: set) -> None:
    """After the index is written: delete the manifests of ``shards`` (names). They serve only a
    rerun of an interrupted pack (:meth:`ShardWriter.write`), and with a grouped layout they hold
    more bytes per sample than the shards (a key and a checksum per field as JSON); a dataset
    that has its index is replaced only with ``overwrite``, which reuses nothing."""
    for name in shards:
        with contextlib.suppress(FileNotFoundError):
            dest.fs.rm(dest.path(f"{name}.json"))


def finished_shards(dst: str, storage_options: dict | None = None) -> int:
    """Shards of an unfinished pack at ``dst`` that are complete (a shard and its manifest), which
    the next pack of the same source reuses. 0 when nothing can be listed."""
    dest = Origin(dst, storage_options or {}, retry_budget_s=0)
    try:
        names = {posixpath.basename(e["name"].rstrip("/")) for e in dest.ls(SHARD_DIR)}
    except Exception:  # noqa: BLE001 - only a count in a message is lost
        return 0
    return sum(1 for n in names if n.endswith(".tar") and f"{n}.json" in names)
