"""The byte budget of a node cache: admission, the policies (:data:`POLICIES`, described in
:mod:`stoker.cache.disk`), eviction, and room on the filesystem (:mod:`.space`). Every fill
reserves its bytes under the budget lock before it writes, so the budget is never exceeded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import layout, space
from .blockfiles import BlockFiles
from .policy import share_budget
from .usage import UsageCounters

POLICIES = ("future", "noevict", "lru")


@dataclass
class CacheStats:
    """Per-process cache counters (samples or blocks, as named). A copy made by pickling (the
    cache sent to another process) starts at zero: each process counts its own."""

    hits: int = 0  # sample reads served from a committed block
    misses: int = 0  # sample reads that found no block
    fills: int = 0  # blocks written into the cache
    fill_bytes: int = 0
    refused: int = 0  # fills not admitted (budget full under noevict / block too big)
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0  # cached blocks whose sample checksum failed (dropped, refetched)

    def __reduce__(self):
        return type(self), ()

    def snapshot(self) -> dict:
        """The counters as a plain dict (``{name: count}``)."""
        return dict(self.__dict__)


def check(capacity_bytes: int, policy: str) -> None:
    """Raise ValueError for an unknown ``policy`` or a negative ``capacity_bytes``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; choose from {POLICIES}")
    if capacity_bytes < 0:
        raise ValueError("capacity_bytes must be >= 0")


class Budget:
    """Admission of blocks into the cache whose block files are ``files`` and whose usage
    counters are ``usage``, under ``capacity_bytes`` (bytes, >= 0) and ``policy`` (one of
    :data:`POLICIES`); counts fills, refusals and evictions into ``stats``. Picklable.

    ``keep_free_fraction`` (of the filesystem, left free for others; the memory tier sets it)
    and ``overflow`` (where refused fills go, for the warning) may be set after it is made.
    Raises ValueError for an unknown policy or a negative budget.
    """

    def __init__(self, files: BlockFiles, usage: UsageCounters, capacity_bytes: int, policy: str, stats: CacheStats):
        check(capacity_bytes, policy)
        self.files, self.usage, self.stats = files, usage, stats
        self.dir = files.dir
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        self.keep_free_fraction = 0.0
        self.overflow = space.STAGED_INSTEAD
        self._quota_memo: tuple[float, int, dict] | None = None  # (when, the directory's generation, quotas)

    def __getstate__(self):
        return {**self.__dict__, "_quota_memo": None}

    # -- the future policy's split ------------------------------------------------
    def register(self, namespace: str, dataset_bytes: int, epoch_s: float | None = None) -> None:
        """Announce this process's job on ``namespace`` (its size in bytes and, once known,
        its epoch time in seconds) to the ``future`` policy's budget split."""
        try:
            self.dir.announce(namespace, dataset_bytes, epoch_s)
        except FileNotFoundError:  # the directory was removed: make it again (which registers the job)
            self.dir.revive()
        self._quota_memo = None

    def forget_quotas(self) -> None:
        """Split the budget again at the next fill: drop the split :meth:`quotas` memoises (call it
        after changing the job records other than through :meth:`register`, e.g. a lease)."""
        self._quota_memo = None

    def quotas(self) -> dict[str, int]:
        """{namespace: bytes of the budget it should hold} for datasets of live jobs
        (:func:`stoker.cache.policy.share_budget`); memoised for a second (and until the
        directory is made again)."""
        now = time.monotonic()
        memo, generation = self._quota_memo, self.dir.generation
        if memo is None or now - memo[0] > 1.0 or memo[1] != generation:
            memo = self._quota_memo = (now, generation, share_budget(self.capacity_bytes, self.dir.jobs.live()))
        return memo[2]

    # -- room ------------------------------------------------------------------------
    def _cap(self, n: int, used: int) -> tuple[int, int | None]:
        """(effective budget in bytes for a fill of ``n`` bytes, bytes free on the filesystem
        or None): the budget, capped at ``used`` plus what the filesystem can still take
        (:func:`.space.headroom_bytes`)."""
        room = space.headroom_bytes(self.dir.root, n, self.keep_free_fraction)
        if room is None:
            return self.capacity_bytes, None
        return min(self.capacity_bytes, used + room[0]), room[1]

    def _room(self, namespace: str, n: int, used: int, evict: bool, cap: int | None = None) -> int | None:
        """Bytes in use once there is room for ``n`` more bytes of ``namespace`` under budget
        ``cap`` (default ``capacity_bytes``), or None if the policy refuses the fill. With
        ``evict=False`` nothing is deleted (a dry run). Caller holds the budget lock."""
        cap = self.capacity_bytes if cap is None else cap
        if n > cap:
            return None
        if used + n <= cap:
            return used
        if self.policy == "noevict":
            return None
        if self.policy == "lru":
            return self._evict(used, used + n - cap) if evict else used
        quotas = self.quotas()
        if namespace not in quotas or self.usage.of(namespace) + n > quotas[namespace]:
            return None  # an unannounced reader, or a dataset at its share: no-eviction
        over = {
            ns: u - quotas.get(ns, 0)
            for ns, u in self.usage.namespace_usage().items()
            if ns != namespace and u > quotas.get(ns, 0)
        }
        need = used + n - cap
        if sum(over.values()) < need:
            return None
        if evict:
            for ns in sorted(over, key=over.__getitem__, reverse=True):
                if need <= 0:
                    break
                freed = used - self._evict(used, min(over[ns], need), namespace=ns)
                used -= freed
                need -= freed
            if need > 0:
                return None
        return used

    def _evict(self, used: int, need: int, namespace: str | None = None) -> int:
        """Delete the oldest blocks (by mtime: least recently used under ``lru``, which
        touches on every hit; first filled otherwise), of ``namespace`` or of any, until
        ``need`` bytes are freed. Returns the bytes in use after. Caller holds the lock."""
        victims = sorted((e for e in self.files.entries(namespace) if not e[3]), key=lambda e: e[2])
        for path, size, _, _ in victims:
            if need <= 0:
                break
            if not self.files.delete(path):
                continue
            used = self.usage.charge(layout.namespace_of(path), -size, used)
            need -= size
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
        return used

    def would_admit(self, nbytes: int, namespace: str = "") -> bool:
        """Whether a fill of ``nbytes`` for ``namespace`` would be admitted now (a dry run:
        no reservation, nothing evicted)."""
        if nbytes > self.capacity_bytes:
            return False
        room = space.headroom_bytes(self.dir.root, nbytes, self.keep_free_fraction)
        if self.policy == "lru" and (room is None or nbytes <= room[0]):
            return True
        with self.usage.locked():
            used = self.usage.used()
            cap, free = self._cap(nbytes, used)
            ok = self._room(namespace, nbytes, used, evict=False, cap=cap) is not None
        if not ok and self._disk_limited(nbytes, used, cap):
            self._warn_full(free)
        return ok

    def _disk_limited(self, n: int, used: int, cap: int) -> bool:
        """Whether the filesystem, not the budget, keeps a fill of ``n`` bytes out."""
        return cap < self.capacity_bytes and used + n > cap

    def _warn_full(self, free: int | None) -> None:
        """The one warning of this job that the cache's disk holds less than its budget."""

        def claim() -> bool:
            with self.usage.locked():
                return space.claim_warning(self.usage.held_fd(), self.dir.owner_pid)

        space.warn_full(
            self.dir.root, free, self.capacity_bytes, self.dir.owner_pid, claim, self.keep_free_fraction, self.overflow
        )

    # -- fills and removals ----------------------------------------------------------
    def admit(self, namespace: str, name: str, data) -> bool:
        """Reserve the bytes of block ``name`` (evicting what the policy allows), write it whole,
        and return whether it is now cached (see :meth:`stoker.cache.disk.DiskCache.put`). A full
        disk or quota refuses the block (its reservation released, one warning per job); other
        OSErrors release the reservation and are raised."""
        n = len(data)
        with self.usage.locked():
            if self.files.committed(namespace, name):
                return True
            before = self.usage.used()
            cap, free = self._cap(n, before)
            used = self._room(namespace, n, before, evict=True, cap=cap)
            if used is not None:
                try:
                    self.usage.charge(namespace, n, used)
                except OSError as exc:
                    if not space.is_full(exc):
                        raise
                    used, cap = None, min(cap, before)
        if used is None:
            self.stats.refused += 1
            if self._disk_limited(n, before, cap):
                self._warn_full(free)
            return False
        try:
            written = self.files.write(namespace, name, data)
        except BaseException as exc:
            with self.usage.locked():
                self.usage.charge(namespace, -n)
            if not space.is_full(exc):
                raise
            self.stats.refused += 1
            info = space.free_bytes(self.dir.root)
            self._warn_full(info[0] if info else None)
            return False
        if not written:  # another process put the same block meanwhile: its bytes are counted once
            with self.usage.locked():
                self.usage.charge(namespace, -n)
            return True
        self.stats.fills += 1
        self.stats.fill_bytes += n
        return True

    def remove(self, namespace: str, name: str) -> None:
        """Drop block ``name`` and return its bytes to the budget."""
        with self.usage.locked():
            size = self.files.remove(namespace, name)
            if size is not None:
                self.usage.charge(namespace, -size)
