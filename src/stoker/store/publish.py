"""How a writer of a packed dataset starts and finishes at its destination: the check for a
dataset already there, the index built from the written shards and installed last (this folder's
README.md, "Invariants"), and the tidying of the directories a failed first write made.

Shared by :func:`stoker.pack` (:mod:`.pack`) and :class:`stoker.Writer` (:mod:`.writer`), so that
both give the same index for the same shards.
"""

from __future__ import annotations

import contextlib
import os

from ..errors import DatasetExistsError
from ..storage import Origin
from .index import INDEX_NAME
from .indexwrite import index_bytes
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
    bytes, samples, optional etag) in shard-number order. Samples get ids in sorted key order; the
    index is built a row group at a time (:func:`.indexwrite.index_bytes`). The
    lease is renewed first (:class:`stoker.PackLeaseLostError` if it was lost: then no index is
    written); after the index, shards at ``dest`` that it does not use are removed
    (:func:`.manifests.remove_stale_shards`), and the manifests of those it uses
    (:func:`.manifests.remove_manifests`: only an interrupted pack's rerun needs them).

    Raises :class:`stoker.SourceError` (a ValueError) for a key written twice, naming it and its
    two shards (nothing is installed).
    """
    data, version = index_bytes(dest.url, rows, labels, class_names, class_list, shard_table)
    lease.renew()  # still ours, with a full lease length ahead for the index write
    dest.write_atomic(INDEX_NAME, data)
    del data
    keep = {s["name"] for s in shard_table}
    remove_stale_shards(dest, keep)
    remove_manifests(dest, keep)
    return version


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
