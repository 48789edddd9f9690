"""How a writer of a packed dataset starts and finishes at its destination: the check for a
dataset already there, the index built from the written shards and installed last (this folder's
README.md, "Invariants"), and the tidying of the directories a failed first write made.

Shared by :func:`stoker.pack` (:mod:`.pack`) and :class:`stoker.Writer` (:mod:`.writer`), so that
both give the same index for the same shards.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import DatasetExistsError, SourceError
from ..storage import Origin
from .index import INDEX_NAME, MEMBER_TYPE, assemble_table, table_to_bytes
from .lease import PackLease
from .manifests import remove_manifests, remove_stale_shards
from .rows import Rows

__all__ = ["clear_destination", "first_missing_dir", "install_index", "remove_if_empty"]


def clear_destination(dest: Origin, overwrite: bool) -> None:
    """Make way for a new dataset at ``dest``: an index there is removed with ``overwrite`` (the
    old dataset is gone from then on), else :class:`stoker.DatasetExistsError` naming it."""
    if not dest.exists(INDEX_NAME):
        return
    if not overwrite:
        raise DatasetExistsError(
            f"the destination {dest.url} already holds a dataset "
            f"({dest.full_url(INDEX_NAME)} exists; pass --overwrite to replace it)"
        )
    with contextlib.suppress(FileNotFoundError):  # another writer of the same destination removed it
        dest.retry(dest.full_url(INDEX_NAME), lambda: dest.fs.rm(dest.path(INDEX_NAME)))


def install_index(
    dest: Origin,
    lease: PackLease,
    rows: Rows,
    labels: list[int],
    class_names: list[str],
    class_list: list[str],
    shard_table: list[dict],
) -> str:
    """Build the index of the written shards and install it at ``dest``; returns its content version.

    ``rows``: the samples written (:class:`.rows.Rows`: key, shard number, members, primary first);
    ``labels`` and ``class_names`` parallel to ``rows``; ``shard_table`` the shards' entries (name,
    bytes, samples, optional etag) in shard-number order. Samples get ids in sorted key order. The
    lease is renewed first (:class:`stoker.PackLeaseLostError` if it was lost: then no index is
    written); after the index, shards at ``dest`` that it does not use are removed
    (:func:`.manifests.remove_stale_shards`), and the manifests of those it uses
    (:func:`.manifests.remove_manifests`: only an interrupted pack's rerun needs them).

    Raises :class:`stoker.SourceError` (a ValueError) for a key written twice, naming it and its
    two shards (nothing is installed).
    """
    table, version = _table(dest, rows, labels, class_names, class_list, shard_table)
    lease.renew()  # still ours, with a full lease length ahead for the index write
    dest.write_atomic(INDEX_NAME, table_to_bytes(table))
    del table
    keep = {s["name"] for s in shard_table}
    remove_stale_shards(dest, keep)
    remove_manifests(dest, keep)
    return version


def _table(dest: Origin, rows: Rows, labels, class_names, class_list, shard_table) -> tuple:
    """(index table, version) of ``rows`` in sorted key order, built column by column (a few
    arrays of N at a time: a pack's memory at this step is its largest)."""
    keys = rows.keys_array()
    order_arr = pc.sort_indices(keys)
    keys = keys.take(order_arr)
    order = order_arr.to_numpy()
    if len(keys) > 1:
        same = pc.equal(keys.slice(0, len(keys) - 1), keys.slice(1))
        if pc.any(same).as_py():
            j = int(pc.index(same, True).as_py())
            a, b = (shard_table[rows.shard[int(order[x])]]["name"] for x in (j, j + 1))
            raise SourceError(
                f"{dest.url}: duplicate key {keys[j].as_py()!r} (in {a} and {b}): every sample needs its own key"
            )
        del same
    cols = rows.columns()
    ends = cols["member_start"][1:]
    count = np.diff(cols["member_start"])
    first = (ends - count)[order]
    extra = count[order] - 1
    del count, ends
    names = pa.array(rows.names, type=pa.string())
    if extra.any():
        list_offsets = np.zeros(len(extra) + 1, dtype=np.int32)
        np.cumsum(extra, out=list_offsets[1:])
        pick = np.repeat(first + 1 - list_offsets[:-1], extra) + np.arange(int(list_offsets[-1]))
        members = pa.StructArray.from_arrays(
            [
                names.take(pa.array(cols["name"][pick])),
                cols["offset"][pick],
                cols["length"][pick],
                cols["checksum"][pick],
            ],
            fields=list(MEMBER_TYPE),
        )
        fields = pa.ListArray.from_arrays(pa.array(list_offsets), members, mask=pa.array(extra == 0))
    else:  # no sample has more than its primary: all null, nothing gathered
        fields = pa.nulls(len(extra), pa.list_(MEMBER_TYPE))
    del extra
    label_arr = np.fromiter(labels, dtype=np.int64, count=len(labels))[order]
    return assemble_table(
        keys,
        label_arr,
        pa.array(class_names, type=pa.string()).take(order_arr),
        cols["shard"][order],
        cols["offset"][first],
        cols["length"][first],
        cols["checksum"][first],
        shard_table,
        class_list,
        names.take(pa.array(cols["name"][first])),
        fields,
    )


def first_missing_dir(dest: Origin) -> str | None:
    """The highest directory of the destination's path that does not exist yet (the root itself
    or one of its parents), which a writer would create; None when the root exists, and where the
    filesystem is not a local one (object stores have no directories to leave behind, and a
    listing there would fill fsspec's listing cache)."""
    protocol = dest.fs.protocol
    if "file" not in (protocol if isinstance(protocol, (tuple, list)) else (protocol,)):
        return None
    try:
        path, missing = os.path.abspath(dest.root), None
        while not os.path.isdir(path):
            if os.path.lexists(path):  # a file in the way: the write fails, nothing of ours to remove
                return None
            missing, parent = path, os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        return missing
    except OSError:  # unknown: treated as existing, so nothing is removed
        return None


def remove_if_empty(dest: Origin, top: str) -> None:
    """Remove ``top`` (the highest directory a failed write created) if it holds no file; one with
    any file, such as a finished shard the next pack reuses, is kept."""
    with contextlib.suppress(Exception):  # tidying must not hide the writer's own error
        if not dest.fs.find(top):
            dest.fs.rm(top, recursive=True)
