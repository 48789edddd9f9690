"""Tar shards: uncompressed POSIX (pax) tar archives that GNU tar and WebDataset read.

A shard is built in memory (its target size, default 64 MiB, bounds the memory),
and each member's payload offset is recorded so the index can address it with one
ranged read. Members get fixed metadata (mtime 0, uid/gid 0, mode 0644) so the same
input always gives byte-identical shards.

Two layouts, chosen per sample by its size (:func:`is_small`):

- **one member per field** (``<key>.<field>``, WebDataset's convention): a sample whose fields
  total ``small_sample_bytes`` or more. A member costs a 512-byte header and up to 511 bytes of
  padding, about 1 KiB on average with the header blocks of long names.
- **grouped**: consecutive samples under ``small_sample_bytes`` (default
  :data:`DEFAULT_SMALL_SAMPLE_BYTES`) are concatenated, their fields back to back in the
  sample's order with no padding, into one group member ``__stoker_group_NNNNNN__.samples`` of
  up to :data:`GROUP_BYTES`. The index points inside it, so a reader reads the same one range
  per sample with the same per-field checksums; a group costs one header and its padding
  (under 1.1 KiB per 1 MiB group: a few bytes per sample). A WebDataset or tar reader sees one
  member (one "sample" keyed ``__stoker_group_NNNNNN__`` with the field ``samples``) per group.

``small_sample_bytes=0`` writes every sample as its own members (the WebDataset layout whatever
the size); a value above every sample's size groups them all.
"""

from __future__ import annotations

import io
import tarfile

import xxhash

TAR_BLOCK = 512
#: Tar header bytes per member plus worst-case padding; long names add pax records.
MEMBER_OVERHEAD = 2 * TAR_BLOCK
#: Samples whose fields total fewer bytes than this are grouped (bytes; below it a member's
#: header and padding would cost a sample more than 12% of its size).
DEFAULT_SMALL_SAMPLE_BYTES = 4096
#: Payload bytes of one group member: its header and padding amortised over many samples.
GROUP_BYTES = 1 << 20
#: What a grouped sample counts against a shard's size beyond its bytes (bytes): the Python
#: bookkeeping a writer holds per sample while its shard is built (its key, fields and offsets),
#: so that the memory of a shard in the making stays near ``shard_bytes`` however small its
#: samples: a 64 MiB shard holds at most 32k samples of a few bytes (measured: about 1.5 KiB of
#: Python objects per sample of three fields while a streamed shard is cut and built).
SMALL_SAMPLE_COST = 2048
#: Suffix of a group member's name (``__stoker_group_NNNNNN__.samples``), how readers tell it.
GROUP_SUFFIX = "__.samples"
GROUP_PREFIX = "__stoker_group_"


def group_name(g: int) -> str:
    """Tar member name of the ``g``-th group of small samples in a shard."""
    return f"{GROUP_PREFIX}{g:06d}{GROUP_SUFFIX}"


def is_group(name: str) -> bool:
    """Whether tar member ``name`` is a group of small samples (:func:`group_name`)."""
    return name.startswith(GROUP_PREFIX) and name.endswith(GROUP_SUFFIX)


def is_small(payload_bytes: int, small_sample_bytes: int) -> bool:
    """Whether a sample whose fields total ``payload_bytes`` is grouped (module docstring)."""
    return payload_bytes < small_sample_bytes


def estimate_sample_bytes(key: str, fields: list[tuple[str, int]], small_sample_bytes: int) -> int:
    """What one sample of ``fields`` = ``[(field, payload bytes)]`` counts against a shard's size:
    its members' bytes with their tar headers (an upper bound), or, when it is grouped, its payload
    plus :data:`SMALL_SAMPLE_COST` (a group's header is amortised; the cost bounds the samples
    per shard, hence a writer's memory)."""
    total = sum(n for _, n in fields)
    if is_small(total, small_sample_bytes):
        return total + SMALL_SAMPLE_COST
    return sum(estimate_member_bytes(key, f, n) for f, n in fields)


def member_name(key: str, field: str) -> str:
    """Tar member name of one field of a sample: ``<key>.<field>`` (WebDataset convention)."""
    return f"{key}.{field}"


def estimate_member_bytes(key: str, field: str, size: int) -> int:
    """Upper-bound estimate of the bytes a member takes in a shard (``size``: payload bytes)."""
    name = member_name(key, field)
    pax = 3 * TAR_BLOCK if len(name.encode()) > 100 else 0
    return MEMBER_OVERHEAD + pax + -(-size // TAR_BLOCK) * TAR_BLOCK


def build_shard(
    samples: list[tuple[str, list[tuple[str, bytes]]]], small_sample_bytes: int = DEFAULT_SMALL_SAMPLE_BYTES
) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Build one tar shard of ``samples`` = ``[(key, [(field, bytes), ...])]`` in memory, small
    samples grouped (module docstring). Returns ``(shard bytes, entries)`` with one ``(payload
    offset, length, xxh3-64)`` per field of each sample, in order; a sample's fields form one
    contiguous range, primary first."""
    members: list[tuple[str, bytes]] = []
    spans: list[tuple[int, int]] = []  # per field: (member index, offset inside the member)
    group: list[bytes] = []
    group_size = 0

    def close_group() -> None:
        nonlocal group, group_size
        if group:
            members.append((group_name(sum(is_group(m) for m, _ in members)), b"".join(group)))
            group, group_size = [], 0

    for key, fields in samples:
        total = sum(len(d) for _, d in fields)
        if not is_small(total, small_sample_bytes):
            close_group()
            for field, data in fields:
                spans.append((len(members), 0))
                members.append((member_name(key, field), data))
            continue
        if group and group_size + total > GROUP_BYTES:
            close_group()
        for _, data in fields:
            spans.append((len(members), group_size))
            group.append(data)
            group_size += len(data)
    close_group()
    data, starts = _build_tar(members)
    view = memoryview(data)
    entries = []
    payloads = (payload for _, fields in samples for _, payload in fields)
    for (m, inner), payload in zip(spans, payloads):
        off, n = starts[m] + inner, len(payload)
        if view[off : off + n] != payload:  # contract check: the offset must address the payload
            raise AssertionError(f"shard offset mismatch for a field at {off}")
        entries.append((off, n, xxhash.xxh3_64_intdigest(payload)))
    return data, entries


def _build_tar(members: list[tuple[str, bytes]]) -> tuple[bytes, list[int]]:
    """Build one tar archive in memory of ``members`` = ``[(member name, payload bytes)]``.
    Returns ``(archive bytes, payload offsets)``: one 64-bit byte offset per member, in order.
    """
    buf = io.BytesIO()
    entries = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(payload))
            # The payload is the last thing written, padded to a 512-byte block.
            offset = tar.offset - -(-len(payload) // TAR_BLOCK) * TAR_BLOCK
            entries.append(offset)
    return buf.getvalue(), entries
