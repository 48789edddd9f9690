"""`stoker verify` and the open-time shard check: is the data at the origin what the index says?

Two levels:

- :func:`check_shards` (cheap, at every open): every shard must exist at the origin with the
  size (and ETag) the index recorded, so shards rewritten under an unchanged index are reported
  by name before any sample is served.
- :func:`verify` (full): reads every shard once, sequentially, and checks every
  sample's bytes against its xxh3-64 checksum, and its tar framing: a tar reader finds the
  sample's member at its offset, or (a small sample, :mod:`.shards`) the group member that holds
  it; lists each bad sample by key and shard.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import posixpath
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xxhash
from tqdm import tqdm

from ..errors import DatasetChangedError, OriginNotFoundError  # noqa: F401 - re-exported
from ..storage import Origin, OriginError
from .index import INDEX_NAME, DatasetIndex, read_index
from .shards import is_group

log = logging.getLogger(__name__)


def _stamp(info: dict) -> str | None:
    for k in ("ETag", "etag"):
        if info.get(k):
            return str(info[k]).strip('"')
    return None


#: HEAD requests in flight at once when an origin's listing gives no sizes (HTTP).
HEAD_CONCURRENCY = 16
_NOTED: set[str] = set()  # origins whose shard check was skipped, noted once per process


def _listing(origin: Origin, dirs: list[str]) -> dict[str, dict]:
    """``{shard path relative to the root: fsspec details}`` from one fresh listing per shard
    directory (:meth:`Origin.ls`: never a listing cached earlier in this process). A directory
    that cannot be listed (missing, or an HTTP server without index pages) lists nothing."""
    listing: dict[str, dict] = {}
    for d in dirs:
        rel = "" if d == "." else d
        try:
            entries = origin.ls(rel)
        except FileNotFoundError:
            entries = []
        for e in entries:
            name = e["name"].rstrip("/")
            listing[posixpath.join(rel, posixpath.basename(name)) if rel else posixpath.basename(name)] = e
    return listing


def _heads(origin: Origin, names: list[str]) -> dict[str, dict | None]:
    """``{shard: fsspec details from a HEAD, or None when it does not exist}``, asked
    :data:`HEAD_CONCURRENCY` at a time. Raises :class:`OriginError` when the origin fails."""

    def one(name: str) -> dict | None:
        try:
            return origin.info(name)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(max(1, min(HEAD_CONCURRENCY, len(names)))) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def check_shards(origin: Origin, index: DatasetIndex) -> None:
    """Raise :class:`DatasetChangedError` if a shard is missing, has another size, or
    (where the index recorded one and the origin is an object store) another ETag.

    One listing request per shard directory, made now (fsspec's cached listings are never
    trusted: a long-lived process sees another process's re-pack). Shards the listing leaves
    out or gives no size for (an HTTP origin lists links only) are asked for with a HEAD each;
    when the origin gives no size at all (no ``Content-Length``), the check is skipped with a
    note in the log, and the checksums still guard every sample read. ETags are compared only
    on object stores (an HTTP server's ETags are its own, not the store's that the pack wrote).
    """
    dirs = sorted({posixpath.dirname(s["name"]) or "." for s in index.shards})
    listing = _listing(origin, dirs)
    unsized = [s["name"] for s in index.shards if (listing.get(s["name"]) or {}).get("size") is None]
    if unsized:
        for name, info in _heads(origin, unsized).items():
            if info is None:
                listing.pop(name, None)
            else:
                listing[name] = info
    protocol = origin.fs.protocol if isinstance(origin.fs.protocol, str) else origin.fs.protocol[0]
    compare_tags = protocol not in ("http", "https")
    problems, unknown = [], 0
    for s in index.shards:
        info = listing.get(s["name"])
        if info is None:
            problems.append(f"{s['name']}: missing")
            continue
        if info.get("size") is None:
            unknown += 1
            continue
        size = int(info["size"])
        if size != int(s["bytes"]):
            problems.append(f"{s['name']}: {size} bytes at the origin, the index says {s['bytes']}")
            continue
        want, got = s.get("etag"), _stamp(info)
        if compare_tags and want and got and want != got:
            problems.append(f"{s['name']}: ETag {got} at the origin, the index says {want}")
    if problems:
        raise DatasetChangedError(
            f"{origin.url}: the shards changed under the index "
            f"(re-pack, or run `stoker verify`): "
            + "; ".join(problems[:20])
            + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    if unknown and origin.url not in _NOTED:
        _NOTED.add(origin.url)
        log.warning(
            "%s: the sizes of %d of %d shard(s) were not checked at open (the origin gives no size); "
            "every sample is still checked against its checksum when read",
            origin.url,
            unknown,
            len(index.shards),
        )


@dataclass
class VerifyReport:
    """Result of :func:`verify`: counts and every problem found (key, shard, reason)."""

    url: str
    samples: int = 0
    shards: int = 0
    bytes_read: int = 0
    bad_samples: list = field(default_factory=list)  # [{"key", "shard", "reason"}]
    bad_shards: list = field(default_factory=list)  # [{"shard", "reason"}]

    @property
    def ok(self) -> bool:
        return not self.bad_samples and not self.bad_shards

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "ok": self.ok,
            "samples": self.samples,
            "shards": self.shards,
            "bytes_read": self.bytes_read,
            "bad_samples": self.bad_samples,
            "bad_shards": self.bad_shards,
        }


def _tar_members(data: bytes) -> dict:
    """``{payload offset: (member name, size)}`` of the members a tar reader finds in ``data``
    (it stops at the first damaged header, as readers do)."""
    out = {}
    with contextlib.suppress(tarfile.TarError):
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            for m in tf:
                out[m.offset_data] = (m.name, m.size)
    return out


def _in_group(groups: list[tuple[int, int]], off: int, n: int) -> bool:
    """Whether bytes ``[off, off + n)`` lie inside one group member of small samples; ``groups``:
    sorted ``(payload offset, size)`` of the shard's group members (:func:`.shards.is_group`)."""
    j = bisect.bisect_right(groups, (off, float("inf"))) - 1
    return j >= 0 and off + n <= groups[j][0] + groups[j][1]


def _header_before(data, off: int) -> tuple[str, int] | None:
    """(member name, size) from the 512-byte tar header just before payload offset ``off``, read
    on its own (a reader that resyncs after a damaged header, as GNU tar does, finds it there);
    None when that block is not a valid header."""
    if off < 512:
        return None
    try:
        ti = tarfile.TarInfo.frombuf(bytes(data[off - 512 : off]), "utf-8", "surrogateescape")
    except tarfile.TarError:
        return None
    return ti.name, ti.size


def _verify_shard(origin: Origin, index: DatasetIndex, s: int, members: np.ndarray, bar) -> tuple[list, list, int]:
    name = index.shard_name(s)
    bad_samples, bad_shards = [], []
    try:
        data = origin.read(name)
    except FileNotFoundError:
        return [], [{"shard": name, "reason": "missing"}], 0
    except OriginError as exc:
        return [], [{"shard": name, "reason": str(exc)}], 0
    view = memoryview(data)
    headers = _tar_members(data)  # payload offset -> (member name, size), as a tar reader sees it
    groups = sorted((off, size) for off, (member, size) in headers.items() if is_group(member))
    want = int(index.shards[s]["bytes"])
    if len(data) != want:
        bad_shards.append({"shard": name, "reason": f"{len(data)} bytes, the index says {want}"})
    has_fields = index.members is not None
    for i in members:
        table = (
            index.member_table(int(i))
            if has_fields
            else [("", int(index.offset[i]), int(index.length[i]), int(index.checksum[i]))]
        )
        for field_name, off, n, ck in table:
            what = f" field {field_name!r}" if field_name and len(table) > 1 else ""
            expect = f"{index.key(i)}.{field_name}" if field_name else None
            # a small sample lies inside its group member, else its own member starts at ``off``
            seen = (expect, n) if _in_group(groups, off, n) else headers.get(off)
            if seen is None:  # the sequential scan stopped at an earlier damaged header: look here
                seen = _header_before(view, off)
                if seen is not None and expect is not None and len(expect.encode()) > 100:
                    seen = (expect, seen[1])  # a long name lives in a PAX record the block alone lacks
            if seen is None or seen[1] != n or (expect is not None and seen[0] != expect):
                got = "no tar header" if seen is None else f"tar header {seen[0]!r}, {seen[1]} bytes"
                bad_samples.append(
                    {
                        "key": index.key(i),
                        "shard": name,
                        "reason": f"tar framing{what}: {got} at payload offset {off} "
                        f"(tar and WebDataset readers would not find this member)",
                    }
                )
                break
            if off + n > len(data):
                bad_samples.append(
                    {
                        "key": index.key(i),
                        "shard": name,
                        "reason": f"{what.strip() + ': ' if what else ''}beyond the end of the shard",
                    }
                )
                break
            if xxhash.xxh3_64_intdigest(view[off : off + n]) != int(ck):
                bad_samples.append(
                    {"key": index.key(i), "shard": name, "reason": f"checksum mismatch{what} at bytes {off}-{off + n}"}
                )
                break
    bar.update(1)
    return bad_samples, bad_shards, len(data)


def verify(url: str, storage_options: dict | None = None, workers: int = 4, progress: bool = False) -> VerifyReport:
    """Check every shard and sample of the dataset at ``url`` against its index.

    Reads each shard once (``workers`` shards in parallel). ``progress``: a tqdm bar on stderr
    (shards done, rate, ETA); off by default, so a library call prints nothing. Returns a
    :class:`VerifyReport`; raises :class:`stoker.OriginNotFoundError` (a FileNotFoundError) when ``url`` holds no index.
    """
    origin = Origin(url, storage_options or {})
    try:
        raw = origin.read(INDEX_NAME)
    except FileNotFoundError:
        raise OriginNotFoundError(
            origin.full_url(INDEX_NAME), f"not found: {url} is not a packed stoker dataset"
        ) from None
    index = read_index(raw, origin.full_url(INDEX_NAME))
    report = VerifyReport(url=url, samples=len(index), shards=len(index.shards))
    order = np.argsort(index.shard, kind="stable")
    bounds = np.searchsorted(index.shard[order], np.arange(len(index.shards) + 1))
    with (
        tqdm(total=len(index.shards), unit="shard", desc="verify", disable=not progress) as bar,
        ThreadPoolExecutor(max(1, workers)) as pool,
    ):
        futs = [
            pool.submit(_verify_shard, origin, index, s, order[bounds[s] : bounds[s + 1]], bar)
            for s in range(len(index.shards))
        ]
        for f in futs:
            samples, shards, n = f.result()
            report.bad_samples.extend(samples)
            report.bad_shards.extend(shards)
            report.bytes_read += n
    return report
