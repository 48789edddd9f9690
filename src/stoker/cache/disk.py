"""Disk tier of the node cache: shard blocks as files, one byte budget for all processes.

Layout under ``root`` (what the cache owns and how it recognises it: :mod:`.layout`;
anything else in ``root`` is never counted, evicted or deleted)::

    .stoker-cache    marker: this directory is a stoker cache
    .lock            flock'd while the budget is read or changed; its first 8 bytes hold
                     the bytes in use (committed plus reserved), little-endian int64;
                     bytes 8-16 the pid of the last job that warned of a full disk
    .locks/NNNN      4096 striped fetch locks (single flight: one process fetches a block);
                     a file's bytes hold a note of the last fill under it that failed (JSON)
    .usage/<namespace>                        its bytes (8 bytes, int64); marks it as the cache's
    stoker-ns-<namespace>/<block name>        committed blocks (namespace = dataset content version)
    stoker-ns-<namespace>/.tmp-<pid>-<rand>   fills in progress

Every fill reserves its bytes under ``.lock`` before it writes (the budget is
enforced on every write, never exceeded; WebDataset checks its cache limit only every
30 s, docs/design.md "The node cache"), writes a temporary file and renames it into place,
so a reader sees a whole block or none. A process killed mid-fill leaves a
temporary file and a reservation; :meth:`DiskCache.recover` (run when a loader
opens the cache) deletes temporary files of dead processes and recounts usage
from the files on disk.

A disk smaller than the budget (or filled by other programs) caps the budget at what the
filesystem can take (:mod:`.space`): a fill that does not fit is refused like any other,
its temporary file removed, and the block is staged or read from the origin; one
warning per job names the directory and the free bytes.

Policies (selectable; ``stoker bench cache`` compares them):

- ``future`` (the default): never evicts a dataset's blocks for the same dataset's blocks
  (so one dataset sits on the D - C floor, like ``noevict``), and splits the budget between
  the datasets of the jobs alive on the node by what each cached byte saves per second
  (:mod:`stoker.cache.policy`): a fill that finds the budget full evicts blocks of datasets
  holding more than their share (oldest first), never of datasets within it.
- ``noevict``: admit until the budget is full, then admit nothing more (CoorDL's
  MinIO: with epoch-random access this reads the minimum D - C bytes per epoch).
- ``lru``: evict the least recently used blocks (mtime, touched on every hit) to
  make room; thrashes under epoch-random access, kept for comparison.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

from .._atomic import open_file
from .._procs import pid_alive
from ..errors import CacheDirError, CacheLockTimeout, StokerError  # noqa: F401 - CacheLockTimeout re-exported
from . import catalog, layout, paths, perms, space
from .files import TMP_MARK, is_file, write_whole
from .handles import Handles, wait_flock
from .policy import JobRegistry, share_budget
from .usage import UsageCounters

log = logging.getLogger(__name__)

POLICIES = ("future", "noevict", "lru")
# Fetch locks are striped over this many lock files.  Two blocks on one stripe serialise their
# fills, and a prefetch that finds a stripe taken must come back later: with 8 fills in flight
# and 256 stripes, about 3% of fills collided (bench cache, C = 0.1 D); 4096 makes that 0.2%.
_STRIPES = 4096
_TMP = TMP_MARK
_REVIVED: set[tuple[str, int]] = set()  # (cache root, pid) that logged a revival


@dataclass
class CacheStats:
    """Per-process cache counters (samples or blocks, as named)."""

    hits: int = 0  # sample reads served from a committed block
    misses: int = 0  # sample reads that found no block
    fills: int = 0  # blocks written into the cache
    fill_bytes: int = 0
    refused: int = 0  # fills not admitted (budget full under noevict / block too big)
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0  # cached blocks whose sample checksum failed (dropped, refetched)

    def snapshot(self) -> dict:
        return dict(self.__dict__)


class DiskCache(UsageCounters):
    """A byte-budgeted block cache in directory ``root``, safe to share between processes.

    ``capacity_bytes``: the budget (bytes); usage never exceeds it, nor what the
    filesystem under ``root`` can hold. ``policy``: one of :data:`POLICIES`.
    ``lock_timeout_s``: longest wait for another process's fill before
    :class:`CacheLockTimeout`. Picklable: each process reopens by path. Opening writes the
    cache's marker into ``root`` (:mod:`.layout`); only the cache's own namespaces are
    counted, evicted or cleared.
    ``mode``: file mode of all it creates (:mod:`.perms`: ``$STOKER_CACHE_MODE`` or 0600,
    directories 0700; ``"0640"`` shares it with the directory's group), kept in the marker.
    Raises ValueError for a bad policy, mode or budget; :class:`~stoker.errors.CacheModeError`
    (``root`` made with another mode), :class:`~stoker.errors.UnsafePathError` (see :mod:`.perms`)
    and :class:`~stoker.errors.CacheUnwritableError` (``root`` on a read-only filesystem, or not
    writable by this user: a cache filled earlier is read with :class:`stoker.cache.readonly.ReadOnlyCache`).

    A directory removed while a job runs is made again at the next fill (its blocks are then
    misses, read from the origin again; logged once): :meth:`_revive`.
    """

    read_only = False  # (see stoker.cache.readonly.ReadOnlyCache)

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        policy: str = "future",
        lock_timeout_s: float = 120.0,
        mode: int | str | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose from {POLICIES}")
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.capacity_bytes = int(capacity_bytes)
        self.mode = perms.parse_mode(mode)
        self.policy = policy
        self.lock_timeout_s = lock_timeout_s
        self.stats = CacheStats()
        self._lock_fd = None
        self._handles: Handles | None = None  # this process's open descriptors (see _local)
        self._made: set[str] = set()
        self._quota_memo: tuple[float, dict] | None = None
        self._owner_pid = os.getpid()  # the job that opened the cache (kept by pickling)
        self.keep_free_fraction = 0.0  # of the filesystem, left free for others (the memory tier sets it)
        self.overflow = space.STAGED_INSTEAD  # where refused fills go (warnings)
        self._registered: dict[str, tuple[int, float | None]] = {}  # jobs announced, made again on a revival
        self._revive_mutex = threading.Lock()
        paths.check_root_path(self.root)  # a clear error naming root when a file is in the way
        self.jobs = JobRegistry(self.root, self.mode)
        self._make_root()

    def _make_root(self) -> None:
        """Create (or check) ``root`` and the cache's own directories, mark it, and try one write
        (the budget lock file), so that a directory that cannot be written is reported now, once,
        by name. Raises :class:`~stoker.errors.CacheUnwritableError` (a read-only filesystem, no
        permission), :class:`~stoker.errors.UnsafePathError`, :class:`~stoker.errors.CacheModeError`."""
        try:
            perms.open_root(self.root, self.mode)
            perms.ensure_dir(os.path.join(self.root, ".locks"), self.mode, parents=False)
            perms.ensure_dir(os.path.join(self.root, ".usage"), self.mode, parents=False)
            layout.mark_root(self.root, self.mode)
            os.close(open_file(os.path.join(self.root, ".lock"), os.O_CREAT | os.O_RDWR, self.mode))
        except OSError as exc:
            if isinstance(exc, StokerError) or exc.errno not in paths.UNWRITABLE_ERRNOS:
                raise  # UnsafePathError, CacheModeError: already named
            raise paths.unwritable_root(self.root, exc) from exc

    def _revive(self) -> None:
        """Start again after the cache's files went away under this process (its directory removed
        by a tmp cleaner or a colleague's ``rm -rf`` while a job runs, or only its lock files):
        drop every descriptor this process keeps (they are of unlinked files, which no other
        process sees), make the directory and its bookkeeping again if they are gone, and announce
        this job again. The blocks that went with it are read from the origin again, counted as
        misses. Logged once per process and directory. Raises what :meth:`_make_root` raises."""
        with self._revive_mutex:
            old, self._handles = self._handles, None
            if old is not None and old.pid == os.getpid():
                old.close()
            self._made = set()
            self._quota_memo = None
            if not layout.is_whole(self.root):
                layout.wait_removed(self.root)  # an rm -rf still walking it: let it finish first
            if not layout.is_whole(self.root):
                if (self.root, os.getpid()) not in _REVIVED:
                    _REVIVED.add((self.root, os.getpid()))
                    log.warning(
                        "cache directory %s was removed while this job ran: made again (its blocks are read "
                        "from the origin again)",
                        self.root,
                    )
                self._make_root()
            # the job's record went with the directory: without it the policy admits nothing of the
            # job's dataset; whichever of the job's processes gets here first writes it again
            live = {(r.get("namespace"), r.get("pid")) for r in self.jobs.records()}
            for ns, (nbytes, epoch_s) in list(self._registered.items()):
                if (ns, self._owner_pid) not in live:
                    try:
                        self.jobs.register(ns, nbytes, epoch_s, pid=self._owner_pid)
                    except OSError as exc:
                        log.debug("could not announce the job on %s again: %s", self.root, exc)

    def _again(self, fn):
        """``fn()``, or, when a file of the cache's own went away under it (FileNotFoundError: the
        directory removed while it ran), ``fn()`` again once the cache is revived
        (:meth:`_revive`); a second such failure is :meth:`_gone`."""
        try:
            return fn()
        except FileNotFoundError as exc:
            if isinstance(exc, StokerError):
                raise
        self._revive()
        try:
            return fn()
        except FileNotFoundError as again:
            if isinstance(again, StokerError):
                raise
            raise self._gone(again) from again

    def _gone(self, exc: BaseException) -> CacheDirError:
        """The error of a cache directory that keeps going away under this job (made again, gone
        again before its next use)."""
        return CacheDirError(
            errno.ENOENT,
            f"cache directory {self.root} was removed while this job ran and is gone again after it was "
            f"made again ({exc}): give the job a directory that nothing else deletes (cache_dir, "
            "STOKER_CACHE_DIR)",
            self.root,
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        state["stats"] = CacheStats()
        state["_lock_fd"] = None
        state["_handles"] = None  # descriptors are per process
        state["_made"] = set()
        state["_quota_memo"] = None
        del state["_revive_mutex"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._revive_mutex = threading.Lock()

    # -- paths and locks -------------------------------------------------
    def path(self, namespace: str, name: str) -> str:
        """File of block ``name`` of ``namespace`` (whether or not it is cached)."""
        return os.path.join(layout.ns_dir(self.root, namespace), name)

    def _local(self) -> Handles:
        """This process's open descriptors of the cache (:mod:`.handles`; new after a fork)."""
        h = self._handles
        if h is None or h.pid != os.getpid():
            h = self._handles = Handles.for_pid(h, self.root, self.mode)
        return h

    def close(self) -> None:
        """Close the descriptors this process keeps open (lock files, block files). The cache
        stays usable: they are opened again when needed."""
        if self._handles is not None and self._handles.pid == os.getpid():
            self._handles.close()

    @contextmanager
    def _budget_lock(self):
        """The budget lock (``.lock``): a thread lock of this process, then ``flock`` on the
        process's open descriptor of the file; unlocked explicitly (a forked child's copy of
        the descriptor must not keep it held). A lock file that is no longer the one at its name
        (the cache directory was removed or moved) or cannot be opened (it is gone) revives the cache first
        (:meth:`_revive`): a lock only this process sees would exclude nobody."""
        for attempt in range(3):
            h = self._local()
            with h.budget_mutex:
                try:
                    fd = h.budget_fd()
                except FileNotFoundError as exc:
                    if attempt == 2:
                        raise self._gone(exc) from exc
                    fd = None
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    if h.current(fd, h.budget_path()):
                        self._lock_fd = fd
                        try:
                            yield
                        finally:
                            self._lock_fd = None
                            fcntl.flock(fd, fcntl.LOCK_UN)
                        return
                    fcntl.flock(fd, fcntl.LOCK_UN)
            self._revive()
        raise self._gone(FileNotFoundError(errno.ENOENT, "the budget lock file went away again"))

    def _stripe(self, namespace: str, name: str) -> str:
        """The fetch-lock file of block ``name`` (one of ``_STRIPES``, shared by many blocks)."""
        return self._stripe_path(self._stripe_of(namespace, name))

    @staticmethod
    def _stripe_of(namespace: str, name: str) -> int:
        return xxhash.xxh3_64_intdigest(f"{namespace}/{name}".encode()) % _STRIPES

    def _stripe_path(self, stripe: int) -> str:
        return os.path.join(self.root, ".locks", f"{stripe:04d}")

    def note_fill_failure(self, namespace: str, name: str, note: dict) -> None:
        """Record that a fill of block ``name`` failed: ``note`` (JSON-able; what was tried) is
        written into the block's fetch-lock file, for the processes that waited for that fill
        (:meth:`fill_failure`). Call it holding :meth:`fetch_lock` of the block. Best effort:
        an OSError is logged at debug level, never raised."""
        data = json.dumps({"block": f"{namespace}/{name}", **note}).encode()
        try:
            fd = open_file(self._stripe(namespace, name), os.O_CREAT | os.O_RDWR, self.mode)
            try:
                os.pwrite(fd, data, 0)  # then cut: a reader in between parses the first object only
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("could not note the failed fill of %s/%s: %s", namespace, name, exc)

    def fill_failure(self, namespace: str, name: str) -> dict | None:
        """The note of the last failed fill of block ``name`` (:meth:`note_fill_failure`, any
        process), or None: none noted, the lock's last note is of another block, or unreadable."""
        try:
            fd = open_file(self._stripe(namespace, name), os.O_RDONLY)
            try:
                raw = os.pread(fd, 1 << 16, 0)
            finally:
                os.close(fd)
            note, _ = json.JSONDecoder().raw_decode(raw.decode())
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) and note.get("block") == f"{namespace}/{name}" else None

    @contextmanager
    def fetch_lock(self, namespace: str, name: str, blocking: bool = True):
        """Single-flight lock for one block, across threads and processes.

        Yields True when held. With ``blocking=False`` yields False at once if another
        fill holds it. Blocking waits block (a thread lock within the process, one blocking
        ``flock`` in a helper thread across processes: :func:`.handles.wait_flock`) for up to
        ``lock_timeout_s`` and then raise :class:`CacheLockTimeout` (never a hang); the waiter
        wakes when the holder lets go, not on a polling tick. A holder killed with SIGKILL
        releases the lock (the kernel drops flocks of closed files). The stripe's file stays
        open in the process between uses (:mod:`.handles`).
        """
        h = self._local()
        k = self._stripe_of(namespace, name)
        deadline = time.monotonic() + self.lock_timeout_s
        tlock = h.stripe_lock(k)
        if not tlock.acquire(blocking, self.lock_timeout_s if blocking else -1):
            if not blocking:
                yield False
                return
            raise self._lock_timeout(namespace, name)
        fd: int | None = None
        locked = False
        try:
            try:
                fd = h.take_stripe(k, self._stripe_path(k))
            except FileNotFoundError:  # .locks/ went away with the directory: make it again
                self._revive()
                perms.ensure_dir(os.path.join(self.root, ".locks"), self.mode, parents=False)
                fd = h.take_stripe(k, self._stripe_path(k))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if not locked:
                if not blocking:
                    yield False
                    return
                if not wait_flock(fd, deadline - time.monotonic()):
                    fd = None  # the waiting helper thread owns it now (closes it)
                    raise self._lock_timeout(namespace, name)
                locked = True
            yield True
        finally:
            if fd is not None:
                if locked:
                    # Unlock explicitly: a process forked while this thread held the lock has a copy
                    # of the descriptor, and closing ours alone would leave the lock held until
                    # that child exits (seen as a block "busy" forever in the prefetcher).
                    fcntl.flock(fd, fcntl.LOCK_UN)
                h.give_stripe(k, fd)
            tlock.release()

    def _lock_timeout(self, namespace: str, name: str) -> CacheLockTimeout:
        return CacheLockTimeout(f"waited {self.lock_timeout_s:.0f} s for the fill of {namespace}/{name} in {self.root}")

    def _entries(self):
        """Yield (path, size, mtime, is_tmp) for every block file and temporary fill of the
        cache's own namespaces (:func:`.layout.namespace_dirs`; nothing else in ``root``)."""
        for ns, _ in layout.namespace_dirs(self.root):
            yield from self._entries_of(ns)

    def used_bytes(self) -> int:
        """Bytes committed or reserved in the cache (all processes)."""
        return self._again(self._used_bytes)

    def _used_bytes(self) -> int:
        with self._budget_lock():
            return self._read_used()

    def recover(self) -> dict:
        """Delete temporary fills of dead processes and recount usage from disk.

        Returns {"removed_tmp": n, "used": bytes}. Safe while other processes run:
        fills of live processes are kept and counted.
        """
        removed = 0
        with self._budget_lock():
            for path, _, _, is_tmp in list(self._entries()):
                if not is_tmp:
                    continue
                try:
                    pid = int(os.path.basename(path)[len(_TMP) :].split("-")[0])
                except ValueError:
                    pid = -1
                if not pid_alive(pid):
                    try:
                        os.unlink(path)
                        removed += 1
                    except FileNotFoundError:
                        pass
            used = self._scan_used()
            try:
                self._write_used(used)
            except OSError as exc:
                if not space.is_full(exc):
                    raise
        self.jobs.remove_dead()
        staging = os.path.join(self.root, ".staging")
        if os.path.isdir(staging):
            for d in os.listdir(staging):
                owner = d.split("-")[0]
                if owner.isdigit() and not pid_alive(int(owner)):
                    shutil.rmtree(os.path.join(staging, d), ignore_errors=True)
        return {"removed_tmp": removed, "used": used}

    # -- reads ------------------------------------------------------------
    def read(self, namespace: str, name: str, offset: int, length: int, count: bool = True) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a cached block, or None if it is not cached.
        ``count``: as :meth:`stoker.cache.tiered.TieredCache.read` (one tier counts no hits)."""
        return self._read(namespace, name, offset, length)

    def read_if_open(self, namespace: str, name: str, offset: int, length: int) -> bytes | None:
        """As :meth:`read`, but None unless this process holds the block file open already (no
        ``open`` tried: a tiered cache asks the tier that served the block last first)."""
        return self._read(namespace, name, offset, length, open_only=True)

    def _read(self, namespace: str, name: str, offset: int, length: int, open_only: bool = False) -> bytes | None:
        # through this process's open descriptor of the block file (:mod:`.handles`): no open/close
        # per sample; a descriptor of a file since unlinked (evicted, replaced) is never read
        h = self._local()
        ent = h.block_ref((namespace, name), lambda: self.path(namespace, name), open_only)
        if ent is None:
            return None
        try:
            data = os.pread(ent.fd, length, offset)
            if self.policy == "lru":
                os.utime(ent.fd)
        finally:
            h.release(ent)
        if len(data) != length:  # a short block file is damaged: treat as missing
            self.remove(namespace, name)
            self.stats.corrupt += 1
            return None
        return data

    def contains(self, namespace: str, name: str) -> bool:
        return is_file(self.path(namespace, name))

    # -- the policy --------------------------------------------------------
    def register(self, namespace: str, dataset_bytes: int, epoch_s: float | None = None) -> None:
        """Announce this process's job on ``namespace`` (its size in bytes and, once known,
        its epoch time in seconds) to the ``future`` policy's budget split."""
        self._registered[namespace] = (int(dataset_bytes), epoch_s)
        try:
            self.jobs.register(namespace, dataset_bytes, epoch_s)
        except FileNotFoundError:  # the directory was removed: make it again (which registers the job)
            self._revive()
        self._quota_memo = None

    def describe(self, namespace: str, url: str) -> None:
        """Record for ``stoker cache status`` that ``namespace`` holds the dataset at ``url`` and
        that this cache's budget is in force (:mod:`.catalog`; best effort)."""
        catalog.record_dataset(self.root, namespace, url, self.mode)
        if self.capacity_bytes > 0:
            catalog.record_budget(self.root, self.capacity_bytes, self.mode)

    def forget_quotas(self) -> None:
        """Split the budget again at the next fill: drop the split :meth:`quotas` memoises (call it
        after changing the job records other than through :meth:`register`, e.g. a lease)."""
        self._quota_memo = None

    def quotas(self) -> dict[str, int]:
        """{namespace: bytes of the budget it should hold} for datasets of live jobs
        (:func:`stoker.cache.policy.share_budget`); memoised for a second."""
        now = time.monotonic()
        if self._quota_memo is None or now - self._quota_memo[0] > 1.0:
            self._quota_memo = (now, share_budget(self.capacity_bytes, self.jobs.live()))
        return self._quota_memo[1]

    def _cap(self, n: int, used: int) -> tuple[int, int | None]:
        """(effective budget in bytes for a fill of ``n`` bytes, bytes free on the filesystem
        or None): the budget, capped at ``used`` plus what the filesystem can still take
        (:func:`.space.headroom_bytes`)."""
        room = space.headroom_bytes(self.root, n, self.keep_free_fraction)
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
        if namespace not in quotas or self._ns_read(namespace) + n > quotas[namespace]:
            return None  # an unannounced reader, or a dataset at its share: no-eviction
        over = {
            ns: u - quotas.get(ns, 0)
            for ns, u in self.namespace_usage().items()
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

    # -- writes -----------------------------------------------------------
    def would_admit(self, nbytes: int, namespace: str = "") -> bool:
        """Whether a fill of ``nbytes`` for ``namespace`` would be admitted now (a dry run:
        no reservation, nothing evicted)."""
        return self._again(lambda: self._would_admit(nbytes, namespace))

    def _would_admit(self, nbytes: int, namespace: str) -> bool:
        if nbytes > self.capacity_bytes:
            return False
        room = space.headroom_bytes(self.root, nbytes, self.keep_free_fraction)
        if self.policy == "lru" and (room is None or nbytes <= room[0]):
            return True
        with self._budget_lock():
            used = self._read_used()
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
            with self._budget_lock():
                return space.claim_warning(self._held_fd(), self._owner_pid)

        space.warn_full(
            self.root, free, self.capacity_bytes, self._owner_pid, claim, self.keep_free_fraction, self.overflow
        )

    def put(self, namespace: str, name: str, data: bytes) -> bool:
        """Admit a block: reserve its bytes, write a temporary file, rename it into place.

        A cache directory removed while the job runs is made again and the block admitted into
        it (:meth:`_revive`); one removed again at once raises :class:`~stoker.errors.CacheDirError`
        naming it.

        Returns True if the block is now cached, False if the policy refused it or it does
        not fit on the filesystem. Under ``lru`` older blocks are evicted to make room; under
        ``future`` blocks of datasets over their share. Usage never exceeds ``capacity_bytes``
        nor what the filesystem holds: a full disk or quota (ENOSPC, EDQUOT, on any write)
        removes the temporary file, releases the reservation, warns once per job naming the
        directory and the free bytes (:mod:`.space`) and refuses the block. Other OSErrors
        release the reservation and are re-raised.
        """
        return self._again(lambda: self._put(namespace, name, data))

    def _put(self, namespace: str, name: str, data: bytes) -> bool:
        n = len(data)
        final = self.path(namespace, name)
        with self._budget_lock():
            # one lstat: another writer links its copy in outside this lock, so a second look
            # (exists? then is it a file?) could take its fresh block for a planted link
            try:
                st = os.lstat(final)
            except FileNotFoundError:
                st = None
            if st is not None:
                if stat.S_ISREG(st.st_mode):
                    return True
                os.unlink(final)  # a planted link or non-file: removed, never followed
            before = self._read_used()
            cap, free = self._cap(n, before)
            used = self._room(namespace, n, before, evict=True, cap=cap)
            if used is not None:
                try:
                    self._charge(namespace, n, used)
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
            if namespace not in self._made:
                perms.ensure_dir(layout.ns_dir(self.root, namespace), self.mode, parents=False)
                self._made.add(namespace)
            written = write_whole(final, data, replace=False, mode=self.mode)
        except BaseException as exc:
            with self._budget_lock():
                self._charge(namespace, -n)
            if not space.is_full(exc):
                raise
            self.stats.refused += 1
            info = space.free_bytes(self.root)
            self._warn_full(info[0] if info else None)
            return False
        if not written:  # another process put the same block meanwhile: its bytes are counted once
            with self._budget_lock():
                self._charge(namespace, -n)
            return True
        self.stats.fills += 1
        self.stats.fill_bytes += n
        return True

    def _evict(self, used: int, need: int, namespace: str | None = None) -> int:
        """Delete the oldest blocks (by mtime: least recently used under ``lru``, which
        touches on every hit; first filled otherwise), of ``namespace`` or of any, until
        ``need`` bytes are freed. Returns the bytes in use after. Caller holds the lock."""
        entries = self._entries() if namespace is None else self._entries_of(namespace)
        victims = sorted((e for e in entries if not e[3]), key=lambda e: e[2])
        for path, size, _, _ in victims:
            if need <= 0:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            ns = layout.namespace_of(path)
            self._local().drop((ns, os.path.basename(path)))
            used = self._charge(ns, -size, used)
            need -= size
            self.stats.evictions += 1
            self.stats.evicted_bytes += size
        return used

    def _entries_of(self, namespace: str):
        """(path, size, mtime, is_tmp) of the block files of one of the cache's namespace
        directories (none if the directory lacks the namespace marker)."""
        path = layout.ns_dir(self.root, namespace)
        if not layout.is_namespace_dir(path):
            return
        try:
            it = list(os.scandir(path))
        except FileNotFoundError:
            return
        for e in it:
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            yield e.path, st.st_size, st.st_mtime, e.name.startswith(_TMP)

    def remove(self, namespace: str, name: str) -> None:
        """Drop one block (e.g. after a checksum failure) and return its bytes to the budget."""
        self._again(lambda: self._remove(namespace, name))

    def _remove(self, namespace: str, name: str) -> None:
        path = self.path(namespace, name)
        with self._budget_lock():
            self._local().drop((namespace, name))
            try:
                size = os.lstat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                return
            self._charge(namespace, -size)
