"""The parts of a dataset written by parallel :class:`stoker.Writer`\\ s, and their merge.

A part writer (``Writer(dst, part=i)``, one per rank or process) writes its shards beside the
dataset's, as ``<dst>/shards/part-<i:06d>-shard-<n:06d>.tar``, holds a lease of its own at
``<dst>/_parts/part-<i:06d>/`` (:mod:`.lease`: two writers of one part refuse each other) and, when
it closes, writes its record ``<dst>/_parts/part-<i:06d>/part.json`` (atomically, last): the shard
table, each sample's members and raw label, and the fields' kinds. A part is finished once its
record exists. :func:`merge_parts` builds one index of every part's shards (no shard is copied)
and installs it, as ``pack`` does; until then ``<dst>`` holds no index, so nothing there opens.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

from ..errors import SourceError, SourceNotFoundError
from ..storage import Origin
from .lease import PackLease
from .pack import PackResult
from .publish import clear_destination, install_index
from .rows import Rows
from .samplecodec import schema_mismatch
from .sources import resolve_labels

__all__ = ["PARTS_DIR", "PartRecord", "merge_parts", "part_origin", "part_shard_name", "write_record", "writer_result"]

PARTS_DIR = "_parts"
RECORD_NAME = "part.json"
RECORD_FORMAT = 1


def writer_result(url: str, rows: Rows, table: list[dict], classes: int, version: str, t0: float) -> PackResult:
    """The :class:`~stoker.store.pack.PackResult` of a Writer or a merge of its parts: ``rows`` the
    index rows written, ``table`` the shard table, ``t0`` the ``time.perf_counter()`` of its start."""
    return PackResult(
        url=url,
        samples=len(rows),
        classes=classes,
        shards=len(table),
        payload_bytes=rows.payload_bytes,
        shard_bytes=sum(int(s["bytes"]) for s in table),
        reused_shards=0,
        skipped_files=0,
        seconds=time.perf_counter() - t0,
        version=version,
        source="writer",
    )


def part_origin(dest: Origin, part: int) -> Origin:
    """The origin rooted at part ``part``'s own folder under ``dest`` (its lease and record)."""
    return Origin(dest.full_url(f"{PARTS_DIR}/part-{part:06d}"), dest.storage_options)


def part_shard_name(part: int, n: int) -> str:
    """Shard ``n`` of part ``part``, relative to the dataset root."""
    return f"shards/part-{part:06d}-shard-{n:06d}.tar"


@dataclass
class PartRecord:
    """What one finished part wrote: ``shards`` (the index's shard entries, in order), ``rows``
    (``[key, shard number in this part, [[field, offset, length, checksum], ...]]`` per sample),
    ``labels`` (raw: int, class-name str or None per sample), ``kinds`` ({field: kind})."""

    part: int
    shards: list[dict] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    labels: list = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)


def write_record(origin: Origin, record: PartRecord) -> None:
    """Install ``record`` at ``origin`` (a :func:`part_origin`), atomically: the part is finished."""
    body = {"format": RECORD_FORMAT, **record.__dict__}
    origin.write_atomic(RECORD_NAME, json.dumps(body).encode())


def _read_record(dest: Origin, part: int) -> PartRecord:
    origin = part_origin(dest, part)
    try:
        body = json.loads(origin.read(RECORD_NAME))
    except FileNotFoundError:
        state = "unfinished (its writer is still writing, failed or was killed)" if origin.exists("") else "missing"
        raise SourceNotFoundError(
            f"{dest.url}: part {part} is {state}: {origin.full_url(RECORD_NAME)} does not exist; "
            f"write it with stoker.Writer({dest.url!r}, part={part}) and merge again"
        ) from None
    except ValueError as exc:
        raise SourceError(f"{origin.full_url(RECORD_NAME)}: not a part record ({exc})") from None
    if body.pop("format", None) != RECORD_FORMAT or body.get("part") != part:
        raise SourceError(f"{origin.full_url(RECORD_NAME)}: not a record of part {part} in format {RECORD_FORMAT}")
    return PartRecord(**body)


def _extra_parts(dest: Origin, parts: int) -> list[str]:
    """Part folders at ``dest`` beyond ``0..parts-1`` (their shards would be removed by the merge)."""
    try:
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in dest.ls(PARTS_DIR)]
    except FileNotFoundError:
        return []
    want = {f"part-{i:06d}" for i in range(parts)}
    return sorted(n for n in names if n.startswith("part-") and n not in want)


def _combine(dest: Origin, records: list[PartRecord]) -> tuple[Rows, list, list, dict]:
    """(rows with dataset-wide shard numbers, raw labels, shard table, kinds) of all parts.
    :class:`stoker.SourceError` for a key in two parts or parts with different fields."""
    rows = Rows()
    labels: list = []
    table: list = []
    kinds: dict[str, str] | None = None
    first_part = -1
    seen: dict[str, int] = {}
    for rec in records:
        if rec.rows and kinds is None:
            kinds, first_part = rec.kinds, rec.part
        elif rec.rows and kinds is not None and (why := schema_mismatch(rec.kinds, kinds)):
            raise SourceError(f"{dest.url}: part {rec.part}'s samples {why} of part {first_part}")
        for key, n, members in rec.rows:
            if key in seen:
                raise SourceError(f"{dest.url}: duplicate key {key!r} in parts {seen[key]} and {rec.part}")
            seen[key] = rec.part
            rows.append(key, len(table) + n, members)
        labels += rec.labels
        table += rec.shards
    return rows, labels, table, kinds or {}


def merge_parts(dst: str, parts: int, *, overwrite: bool = False, storage_options: dict | None = None) -> PackResult:
    """Publish the finished parts ``0..parts-1`` at ``dst`` as one dataset (see the module docstring).

    Returns the :class:`stoker.store.pack.PackResult` of the dataset (``source`` "writer"). Holds the destination's pack
    lease while it merges; removes the parts' folders after the index is installed.

    Raises:
        stoker.SourceNotFoundError: (a FileNotFoundError) a part is missing or unfinished, naming it.
        stoker.SourceError: (a ValueError) a part folder beyond ``parts``, a key in two parts,
            parts whose fields differ, no sample in any part.
        stoker.DatasetExistsError: ``dst`` holds an index and ``overwrite`` is false.
        stoker.PackLeaseError: another pack or merge holds ``dst``.
        ValueError: ``parts`` is not a positive int.
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be the number of parts (an int >= 1), got {parts!r}")
    t0 = time.perf_counter()
    dest = Origin(dst, storage_options or {})
    with PackLease(dest) as lease:
        extra = _extra_parts(dest, parts)
        if extra:
            raise SourceError(
                f"{dest.url}: {dest.full_url(PARTS_DIR)} holds {', '.join(extra)} beyond the {parts} parts "
                "to merge: merge them all (a larger parts=), or remove those folders and their shards"
            )
        records = [_read_record(dest, i) for i in range(parts)]
        rows, raw, table, _ = _combine(dest, records)
        if not len(rows):
            raise SourceError(f"{dest.url}: the {parts} parts hold no sample")
        clear_destination(dest, overwrite)
        labels, class_names, class_list = resolve_labels(raw, None, rows)
        version = install_index(dest, lease, rows, labels, class_names, class_list, table)
    with contextlib.suppress(Exception):  # leftovers of finished parts do no harm; the index is in
        dest.fs.rm(dest.path(PARTS_DIR), recursive=True)
    return writer_result(dest.url, rows, table, len(class_list), version, t0)
