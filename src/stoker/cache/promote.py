"""Promotion: a block read from the disk tier is copied into the memory tier, under its budget.

A block filled from the origin goes to the memory tier while it admits it, else to the disk tier
(:mod:`.tiered`). A cache that is warm on disk when a memory tier is added (a new job with
``memory_bytes``, a node rebooted: /dev/shm is empty again) would then never fill its memory
tier, every read hitting the disk. So the first sample read of a disk block also copies the
block into the memory tier (Alluxio's promotion of a block read from a lower tier to the top one):

- by the memory tier's own admission (:meth:`stoker.cache.budget.Budget.admit`, the policy that
  admits origin fills: the budget reserved before the write, never exceeded; ``lru`` evicts the
  least recently used, ``future`` only datasets over their share, ``noevict`` nothing);
- with the bytes of one read: the whole block is read once through the disk tier's open
  descriptor, written to the memory tier, and the sample served from that read (no second read
  of the disk file);
- once per block across processes: the block's fetch lock (one per block for both tiers) is
  taken without waiting, and a block another process is promoting or filling is left to it;
- the disk copy stays (the memory tier is a copy above it, gone at reboot; a block evicted from
  memory is still on disk), and this process's descriptor of it is closed, so that its next
  reads go to the memory copy;
- a refusal is remembered for :data:`RETRY_S` seconds per dataset in each process: a full memory
  tier costs no budget lock on every disk read.

Bytes are copied as they are on disk; a damaged block is caught where every cached sample is
checked against the index, and dropped from both tiers (:meth:`stoker.cache.tiered.TieredCache.remove`).
"""

from __future__ import annotations

import os
import time

from .disk import DiskCache

#: Seconds a dataset whose block the memory tier refused is not promoted again in a process.
RETRY_S = 1.0


class Promoter:
    """Copies blocks of ``disk`` into ``memory`` (two :class:`DiskCache` tiers) when read.
    Picklable: a copy in another process starts with no refusal remembered."""

    def __init__(self, memory: DiskCache, disk: DiskCache):
        self.memory, self.disk = memory, disk
        self._refused_until: dict[str, float] = {}  # {namespace: time.monotonic() until which not to try}

    def __getstate__(self):
        return {**self.__dict__, "_refused_until": {}}

    def promote(self, namespace: str, name: str) -> bytes | None:
        """Block ``name`` of ``namespace`` read whole from the disk tier and admitted into the
        memory tier: its bytes, or None when it was not promoted (not on disk, refused by the
        memory tier's budget, being filled or promoted by another process, or read short: a
        damaged block the caller's ordinary read drops). Raises OSError other than a full
        filesystem from the memory tier's write (:meth:`DiskCache.put`)."""
        if time.monotonic() < self._refused_until.get(namespace, 0.0):
            return None
        size = self.disk.with_fd(namespace, name, lambda fd: os.fstat(fd).st_size)
        if size is None:
            return None
        if not self.memory.would_admit(size, namespace):
            self._refused(namespace)
            return None
        with self.disk.fetch_lock(namespace, name, blocking=False) as held:
            if not held or self.memory.contains(namespace, name):  # another process promotes or promoted it
                return None
            data = self.disk.with_fd(namespace, name, lambda fd: os.pread(fd, size, 0))
            if data is None or len(data) != size:
                return None
            if not self.memory.put(namespace, name, data):
                self._refused(namespace)
                return None
        self.disk.files.forget(namespace, name)
        return data

    def _refused(self, namespace: str) -> None:
        """Try no promotion of ``namespace`` for :data:`RETRY_S` seconds."""
        self._refused_until[namespace] = time.monotonic() + RETRY_S
