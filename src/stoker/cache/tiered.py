"""Two cache tiers on one node: shared memory over local disk, each with its own byte budget.

The memory tier is a :class:`DiskCache` rooted in ``/dev/shm`` (RAM, shared by every process
of the node, gone at reboot); the disk tier is a :class:`DiskCache` on local disk. Fills from the
origin go to the memory tier while it admits them, then to the disk tier (Alluxio's MEM over SSD;
with the no-eviction policy the first blocks of the first epoch take the memory). Reads look in
memory, then on disk; hits are counted per tier. A block read from the disk tier is copied into
the memory tier when its budget admits it (:mod:`.promote`: a disk tier warm from earlier jobs
fills the memory tier as it is read), and then lives in both. Both budgets are enforced on
every write by the tiers themselves, and neither tier writes past what its filesystem holds
(:mod:`.space`): a memory budget above the size of /dev/shm fills what fits and the rest goes
to the disk tier. A memory tier on a RAM-backed filesystem (tmpfs, as /dev/shm is) leaves
:data:`SHM_KEEP_FREE` of it free for the other users of shared memory (the loader's batch slots,
the training framework's own tensors; Docker's default /dev/shm is only 64 MiB). A memory tier
placed on a disk directory keeps no such reserve: a quarter of a large disk is not RAM to spare.
Single-flight locks live in the disk tier, so there is one lock per block for both tiers.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import xxhash

from .catalog import record_memory_root
from .disk import CacheStats, DiskCache
from .paths import ram_backed
from .promote import Promoter

#: Fraction of the memory tier's filesystem (/dev/shm) that it leaves free for others.
SHM_KEEP_FREE = 0.25


def default_memory_root(disk_root: str) -> str:
    """``/dev/shm/stoker-cache-<hash of the disk root>``: one memory tier per disk cache."""
    tag = xxhash.xxh3_64_hexdigest(os.path.abspath(disk_root).encode())[:12]
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"stoker-cache-{tag}")


@dataclass
class TieredStats(CacheStats):
    """Cache counters plus hits per tier (samples) and promotions (blocks copied from the disk
    tier into the memory tier, and their bytes: :mod:`.promote`)."""

    memory_hits: int = 0
    disk_hits: int = 0
    promotions: int = 0
    promoted_bytes: int = 0
    tiers: tuple[DiskCache, ...] = field(default=(), repr=False, compare=False)  # not a counter

    def snapshot(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "tiers"}
        for tier in self.tiers:  # evictions and damage happen inside the tiers
            for k in ("evictions", "evicted_bytes", "corrupt"):
                out[k] += getattr(tier.stats, k)
        return out


class TieredCache:
    """The cache interface of :class:`DiskCache` over a memory tier and a disk tier.

    ``memory``/``disk``: the two :class:`DiskCache` tiers (same policy); the memory tier is
    set to leave :data:`SHM_KEEP_FREE` of its filesystem free when that filesystem is RAM-backed
    (:func:`stoker.cache.paths.ram_backed`). Picklable. ValueError when
    the two tiers have different cache modes (:mod:`.perms`).
    """

    read_only = False  # a memory tier is written; a read-only cache has none

    def __init__(self, memory: DiskCache, disk: DiskCache):
        if memory.mode != disk.mode:
            raise ValueError(
                f"the memory tier {memory.root} (mode {memory.mode:04o}) and the disk tier "
                f"{disk.root} (mode {disk.mode:04o}) must have one cache mode"
            )
        self.memory, self.disk = memory, disk
        self.promoter = Promoter(memory, disk)
        memory.budget.overflow = "go to the disk tier instead"
        if ram_backed(memory.root):
            memory.budget.keep_free_fraction = max(memory.budget.keep_free_fraction, SHM_KEEP_FREE)
        self.stats = self._new_stats()

    def _new_stats(self) -> TieredStats:
        return TieredStats(tiers=(self.memory, self.disk))

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["stats"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.stats = self._new_stats()

    @property
    def root(self) -> str:
        return self.disk.root

    @property
    def capacity_bytes(self) -> int:
        return self.memory.capacity_bytes + self.disk.capacity_bytes

    @property
    def mode(self) -> int:
        """File mode of the cache's files (the disk tier's; both tiers have the same)."""
        return self.disk.mode

    @property
    def policy(self) -> str:
        return self.disk.policy

    def fetch_lock(self, namespace: str, name: str, blocking: bool = True):
        return self.disk.fetch_lock(namespace, name, blocking)

    def note_fill_failure(self, namespace: str, name: str, note: dict) -> None:
        self.disk.note_fill_failure(namespace, name, note)

    def fill_failure(self, namespace: str, name: str) -> dict | None:
        return self.disk.fill_failure(namespace, name)

    def read(self, namespace: str, name: str, offset: int, length: int, count: bool = True) -> bytes | None:
        """Bytes of a cached block from the tier that holds it, or None. ``count``: a sample read
        (a hit of its tier); False for the reader of a whole block another process filled while
        it waited, whose sample is counted as a miss.

        A block this process holds open in the disk tier is read there first (no ``open`` tried
        in the memory tier for every sample of a disk-tier block, :mod:`.handles`). A sample read
        of a block found only on disk promotes it (:meth:`promote`): the range comes out of the
        block's bytes read for that, and is a disk hit."""
        data = self.disk.read_if_open(namespace, name, offset, length)
        if data is None:
            data = self.memory.read(namespace, name, offset, length)
            if data is not None:
                self.stats.memory_hits += count
                return data
            block = self.promote(namespace, name) if count else None
            if block is not None and offset + length <= len(block):
                self.stats.disk_hits += count
                return block[offset : offset + length]
            data = self.disk.read(namespace, name, offset, length)
        if data is not None:
            self.stats.disk_hits += count
        return data

    def with_fd(self, namespace: str, name: str, use, count: bool = True):
        """As :meth:`stoker.cache.disk.DiskCache.with_fd`, on the tier that holds the block (the
        memory tier's blocks are files too), counted as :meth:`read` counts a hit. A block found
        only on disk is promoted first (:meth:`promote`) and ``use`` given the memory tier's
        copy (a disk hit: its bytes were read from the disk tier, once, whole)."""
        out = self.memory.with_fd(namespace, name, use)
        if out is not None:
            self.stats.memory_hits += count
            return out
        if count and self.promote(namespace, name) is not None:
            out = self.memory.with_fd(namespace, name, use)
        if out is None:
            out = self.disk.with_fd(namespace, name, use)
        if out is not None:
            self.stats.disk_hits += count
        return out

    def promote(self, namespace: str, name: str) -> bytes | None:
        """Copy block ``name`` from the disk tier into the memory tier if the memory tier's
        policy admits it (:meth:`stoker.cache.promote.Promoter.promote`); the block's bytes, or
        None when it was not promoted. Counted in ``stats.promotions`` and ``promoted_bytes``."""
        data = self.promoter.promote(namespace, name)
        if data is not None:
            self.stats.promotions += 1
            self.stats.promoted_bytes += len(data)
        return data

    def contains(self, namespace: str, name: str) -> bool:
        return self.memory.contains(namespace, name) or self.disk.contains(namespace, name)

    def would_admit(self, nbytes: int, namespace: str = "") -> bool:
        return self.memory.would_admit(nbytes, namespace) or self.disk.would_admit(nbytes, namespace)

    def register(self, namespace: str, dataset_bytes: int, epoch_s: float | None = None) -> None:
        """Announce this job to both tiers' budget split (see :meth:`DiskCache.register`)."""
        self.memory.register(namespace, dataset_bytes, epoch_s)
        self.disk.register(namespace, dataset_bytes, epoch_s)

    def forget_quotas(self) -> None:
        """Both tiers split their budgets again at the next fill (:meth:`DiskCache.forget_quotas`)."""
        self.memory.forget_quotas()
        self.disk.forget_quotas()

    def describe(self, namespace: str, url: str) -> None:
        """Record the dataset's URL and the disk tier's budget (see :meth:`DiskCache.describe`),
        and where the memory tier is, so that ``stoker cache status`` and ``clear`` find it."""
        self.disk.describe(namespace, url)
        with contextlib.suppress(OSError):  # best effort, as the rest of the catalog
            record_memory_root(self.disk.root, self.memory.root, self.disk.mode)

    def put(self, namespace: str, name: str, data) -> bool:
        """Admit into the memory tier if it has room, else into the disk tier."""
        ok = self.memory.put(namespace, name, data) or self.disk.put(namespace, name, data)
        if ok:
            self.stats.fills += 1
            self.stats.fill_bytes += len(data)
        else:
            self.stats.refused += 1
        return ok

    def remove(self, namespace: str, name: str) -> None:
        self.memory.remove(namespace, name)
        self.disk.remove(namespace, name)

    def close(self) -> None:
        """Close the descriptors this process keeps open in both tiers (:meth:`DiskCache.close`)."""
        self.memory.close()
        self.disk.close()

    def used_bytes(self) -> int:
        return self.memory.used_bytes() + self.disk.used_bytes()

    def recover(self) -> dict:
        m, d = self.memory.recover(), self.disk.recover()
        return {
            "removed_tmp": m["removed_tmp"] + d["removed_tmp"],
            "used": m["used"] + d["used"],
            "memory_used": m["used"],
            "disk_used": d["used"],
        }
