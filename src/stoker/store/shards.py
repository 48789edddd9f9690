"""Tar shards: uncompressed POSIX (pax) tar archives that GNU tar and WebDataset read.

A shard is built in memory (its target size, default 64 MiB, bounds the memory),
and each member's payload offset is recorded so the index can address it with one
ranged read. Members get fixed metadata (mtime 0, uid/gid 0, mode 0644) so the same
input always gives byte-identical shards.
"""

from __future__ import annotations

import io
import tarfile

import xxhash

TAR_BLOCK = 512
#: Tar header bytes per member plus worst-case padding; long names add pax records.
MEMBER_OVERHEAD = 2 * TAR_BLOCK


def member_name(key: str, field: str) -> str:
    """Tar member name of one field of a sample: ``<key>.<field>`` (WebDataset convention)."""
    return f"{key}.{field}"


def estimate_member_bytes(key: str, field: str, size: int) -> int:
    """Upper-bound estimate of the bytes a member takes in a shard (``size``: payload bytes)."""
    name = member_name(key, field)
    pax = 3 * TAR_BLOCK if len(name.encode()) > 100 else 0
    return MEMBER_OVERHEAD + pax + -(-size // TAR_BLOCK) * TAR_BLOCK


def build_shard(members: list[tuple[str, bytes]]) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Build one tar shard in memory.

    ``members``: list of (member name, payload bytes); a sample's members are given
    consecutively (primary first), so its bytes form one contiguous range. Returns ``(shard bytes,
    entries)`` with one ``(payload offset, payload length, xxh3-64 checksum)`` per
    member, in order. Offsets are 64-bit byte offsets into the shard.
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
            entries.append((offset, len(payload), xxhash.xxh3_64_intdigest(payload)))
    data = buf.getvalue()
    view = memoryview(data)
    for (off, n, _), (_, payload) in zip(entries, members):
        if view[off : off + n] != payload:  # tarfile contract check: the offset must address the payload
            raise AssertionError(f"tar offset mismatch for member at {off}")
    return data, entries
