"""Staging area: blocks fetched just in time that the cache did not admit.

When the budget C is smaller than the dataset D, the no-eviction policy keeps the blocks
it admitted and reads the other D - C bytes from the origin every epoch (the floor: no
policy can read less). The prefetcher still fetches those blocks ahead of the workers, in
the order the epoch needs them, into a staging directory owned by one loader; a staged
block is deleted once the consumer is past its last use in the epoch. Staging is bounded
by the loader's prefetch budget (``prefetch_bytes``), not by the cache budget.

Layout: ``<cache root>/.staging/<pid>-<id>/<namespace>/<block>``; directories of dead
processes are removed by :meth:`stoker.cache.DiskCache.recover`.
"""
from __future__ import annotations

import os
import shutil
import uuid

from .files import read_at, write_whole


class StagingArea:
    """One loader's staged blocks under ``root`` (a directory it owns). Picklable."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    @classmethod
    def create(cls, cache_root: str) -> "StagingArea":
        return cls(os.path.join(cache_root, ".staging", f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))

    def path(self, namespace: str, name: str) -> str:
        return os.path.join(self.root, namespace, name)

    def put(self, namespace: str, name: str, data) -> None:
        """Write a block (temporary file + rename: readers see all of it or nothing)."""
        final = self.path(namespace, name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        write_whole(final, data)

    def contains(self, namespace: str, name: str) -> bool:
        return os.path.exists(self.path(namespace, name))

    def read(self, namespace: str, name: str, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a staged block, or None."""
        data = read_at(self.path(namespace, name), offset, length)
        return data if data is not None and len(data) == length else None

    def remove(self, namespace: str, name: str) -> int:
        """Delete a staged block; returns the bytes freed (0 if it was not there)."""
        path = self.path(namespace, name)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
            return size
        except FileNotFoundError:
            return 0

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
