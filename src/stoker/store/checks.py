"""Checks of a dataset's bytes against its index: every sample and every named field carries an
xxh3-64 checksum in the index, so bytes from the origin, the node cache, a staging area or a peer
are checked before they are served or kept, and a mismatch names the sample, field, shard and URL.

The functions take a :class:`stoker.store.dataset.Dataset` (``ds``: its ``index``, ``blocks``,
``url`` and ``key``); nothing here reads or changes anything else.
"""

from __future__ import annotations

import logging

import xxhash

from ..errors import ChecksumError

log = logging.getLogger(__name__)


def sample_ok(ds, i: int, data) -> bool:
    """Whether ``data`` (bytes-like) is the payload of sample ``i`` of ``ds`` (its xxh3-64 checksum)."""
    return xxhash.xxh3_64_intdigest(data) == int(ds.index.checksum[i])


def bad_field(table, data, base: int) -> str | None:
    """Name of the first member whose bytes in ``data`` (shard bytes from offset ``base``) are
    wrong or missing; None when all are right. ``table``: the members to check,
    ``[(name, offset, length, checksum)]`` (:meth:`stoker.store.index.DatasetIndex.member_table`)."""
    view = memoryview(data)
    for name, off, n, ck in table:
        if xxhash.xxh3_64_intdigest(view[off - base : off - base + n]) != ck or off - base + n > len(view):
            return name
    return None


def checksum_error(ds, i: int, what: str, data=None, start: int = 0) -> ChecksumError:
    """The :class:`ChecksumError` of sample ``i`` of ``ds`` for ``what`` went wrong, naming its key,
    shard and the dataset's URL; with ``data`` (its shard bytes from offset ``start``) and named
    fields in the index, also the first field that is wrong. Its ``key`` is the sample at fault,
    which may not be the one being read (a shared block)."""
    index = ds.index
    if data is not None and index.members is not None:
        bad = bad_field(index.member_table(i), data, start)
        what += f" in field {bad!r}" if bad else ""
    err = ChecksumError(
        f"sample {ds.key(i)!r} in shard {index.shard_name(index.shard[i])!r} of {ds.url}: {what} "
        "(the dataset changed under its index? open it again if it was re-packed, else run `stoker verify`)"
    )
    err.key = ds.key(i)
    return err


def verify_block(ds, b: int, data):
    """``data`` (the bytes of block ``b`` of ``ds``, shard range ``[start, end)`` of
    ``ds.blocks``) after checking every member of every sample against the index;
    :class:`ChecksumError` naming the first sample that fails."""
    index = ds.index
    start = int(ds.blocks.start[b])
    members = index.members
    view = memoryview(data)
    for i in ds.blocks.samples(b):
        off = int(index.offset[i]) - start
        if not sample_ok(ds, i, view[off : off + int(index.length[i])]):
            raise checksum_error(ds, int(i), "checksum mismatch in a block read from the origin")
        if members is not None and members.start[i + 1] > members.start[i]:
            bad = bad_field(index.member_table(int(i))[1:], data, start)
            if bad is not None:
                raise checksum_error(ds, int(i), f"checksum mismatch in field {bad!r} in a block read from the origin")
    return data


def checked_or_none(ds, b: int, data, source: str):
    """Block ``b``'s bytes ``data`` (None: the source had none) verified against ``ds``'s index
    (:func:`verify_block`), or None when they fail the check: logged as a warning naming the
    block, the dataset's URL and ``source`` (e.g. "its first source"), so the caller reads the
    block from its usual source instead."""
    if data is None:
        return None
    try:
        return verify_block(ds, b, data)
    except ChecksumError as exc:
        log.warning(
            "block %s of %s from %s failed the check (%s); reading it again", ds.blocks.name(b), ds.url, source, exc
        )
        return None


__all__ = ["bad_field", "checked_or_none", "checksum_error", "sample_ok", "verify_block"]
