"""Descriptors a cache keeps open in one process: its budget lock file, its fetch-lock stripes and
the block files it reads, so that a block fill or a sample read does not open and close files.

One :class:`Handles` per cache directory (:class:`stoker.cache.cachedir.CacheDir`) and process. It belongs to the
process that made it: :meth:`Handles.for_pid` gives a fresh one after a fork (or in an unpickled
copy), and the descriptors inherited from the parent are closed, never unlocked, in the child
(an ``flock`` belongs to the open file description that parent and child share after a fork;
unlocking it in the child would release the parent's lock, closing it does not). A descriptor
is closed only after ``fstat`` shows it is still the file this process opened (so a number
that the child reused for something else is left alone).

Locks: ``flock`` excludes other *open file descriptions*, not other threads using the same one.
So every shared descriptor here is paired with a ``threading.Lock`` that threads of the process
take first: the budget lock file has one; each fetch-lock stripe has its own, and a stripe's
descriptor is used by one thread at a time (taken out of the idle pool while held). A
blocking wait for a stripe that another process holds is one blocking ``flock`` in a helper
thread, waited on with a timeout (:func:`wait_flock`): no polling, and the caller's timeout holds.

A lock file unlinked or moved away under the process (the cache directory removed while a job
runs) is noticed (:meth:`Handles.take_stripe`, :meth:`Handles.current`; what the cache does then:
this folder's README.md).

Block files are read through a bounded LRU of descriptors (:data:`BLOCK_FDS` per process), each
used only while its file is still linked (committed blocks are linked into place, never renamed
over, so a block evicted, removed or replaced is opened again by name, never read through a stale
descriptor; :meth:`Handles.block_ref`, :meth:`Handles.sweep`), and reference-counted while a read
uses it, so a thread's read never races another thread's close.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections import OrderedDict

from .._atomic import open_file

#: Block files kept open per process and cache tier.
BLOCK_FDS = 64
#: Fetch-lock stripe files kept open per process and cache (idle ones; held ones are extra).
STRIPE_FDS = 64


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _linked(fd: int) -> bool:
    """Whether the file open as ``fd`` still has a name (not unlinked since it was opened)."""
    try:
        return os.fstat(fd).st_nlink > 0
    except OSError:
        return False


def _close_if_same(fd: int, ident: tuple[int, int]) -> None:
    """Close inherited ``fd`` if it is still the file ``ident`` (dev, inode); never unlock it."""
    with contextlib.suppress(OSError):
        if _identity(fd) == ident:
            os.close(fd)


class _BlockFd:
    __slots__ = ("fd", "refs", "dead", "ident")

    def __init__(self, fd: int, ident: tuple[int, int]):
        self.fd, self.refs, self.dead, self.ident = fd, 0, False, ident


class Handles:
    """The open descriptors of one cache in one process (see the module docstring)."""

    def __init__(self, root: str, mode: int):
        self.pid = os.getpid()
        self.root, self.mode = root, mode
        self.budget_mutex = threading.Lock()
        self._budget: tuple[int, tuple[int, int]] | None = None
        self._mutex = threading.Lock()
        self._stripe_locks: dict[int, threading.Lock] = {}
        self._stripe_idle: OrderedDict[int, tuple[int, tuple[int, int]]] = OrderedDict()
        self._blocks: OrderedDict[object, _BlockFd] = OrderedDict()
        self._opens = 0  # block files opened: every BLOCK_FDS-th open sweeps out unlinked ones
        self._stripe_ident: dict[int, tuple[int, int]] = {}

    @classmethod
    def for_pid(cls, current: Handles | None, root: str, mode: int) -> Handles:
        """``current`` when it belongs to this process, else a new one (``current``'s inherited
        descriptors closed, not unlocked)."""
        if current is not None and current.pid == os.getpid():
            return current
        if current is not None:
            current._forget_inherited()
        return cls(root, mode)

    def _forget_inherited(self) -> None:
        # no locks taken: in a forked child another (vanished) thread may have held them
        fds = list(self._stripe_idle.values()) + [(e.fd, e.ident) for e in self._blocks.values()]
        if self._budget is not None:
            fds.append(self._budget)
        self._stripe_idle, self._blocks, self._budget = OrderedDict(), OrderedDict(), None
        for fd, ident in fds:
            _close_if_same(fd, ident)

    @staticmethod
    def current(fd: int, path: str) -> bool:
        """Whether the file open as ``fd`` is still the one at ``path`` (False once it was unlinked
        or moved away, e.g. with the cache directory): a lock on such a file excludes no other
        process, which opens a new file under the same name. One ``fstat`` and one ``stat``."""
        try:
            st = os.fstat(fd)
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return st.st_nlink > 0 and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)

    def budget_path(self) -> str:
        """The budget lock file's path."""
        return os.path.join(self.root, ".lock")

    # -- the budget lock file ------------------------------------------------
    def budget_fd(self) -> int:
        """The budget lock file ``<root>/.lock``, open for this process (caller holds
        :attr:`budget_mutex`). Raises FileNotFoundError when it is gone (the cache directory
        removed: the caller makes it again, :meth:`stoker.cache.cachedir.CacheDir.revive`; it never
        makes a lock file in a directory that an ``rm -rf`` is walking); the caller checks
        :meth:`current` once it holds the lock."""
        if self._budget is None:  # not created here: the cache makes it with its directory
            fd = open_file(self.budget_path(), os.O_RDWR, self.mode)
            self._budget = (fd, _identity(fd))
        return self._budget[0]

    # -- fetch-lock stripes ----------------------------------------------------
    def stripe_lock(self, k: int) -> threading.Lock:
        """The in-process lock of stripe ``k``, taken before its descriptor is used."""
        with self._mutex:
            lock = self._stripe_locks.get(k)
            if lock is None:
                lock = self._stripe_locks[k] = threading.Lock()
            return lock

    def take_stripe(self, k: int, path: str) -> int:
        """Stripe ``k``'s descriptor (file ``path``), out of the idle pool; the caller holds
        :meth:`stripe_lock` and gives it back with :meth:`give_stripe` (or owns it if it never does)."""
        with self._mutex:
            got = self._stripe_idle.pop(k, None)
        if got is not None:
            if self.current(got[0], path):
                return got[0]
            with self._mutex:  # its file was unlinked or moved (the directory removed): open the name again
                self._stripe_ident.pop(got[0], None)
            os.close(got[0])
        fd = open_file(path, os.O_CREAT | os.O_RDWR, self.mode)
        with self._mutex:
            self._stripe_ident[fd] = _identity(fd)
        return fd

    def give_stripe(self, k: int, fd: int) -> None:
        """Put stripe ``k``'s descriptor back (unlocked) into the idle pool; the least recently
        used idle one is closed past :data:`STRIPE_FDS`."""
        with self._mutex:
            ident = self._stripe_ident.get(fd) or _identity(fd)
            self._stripe_idle[k] = (fd, ident)
            self._stripe_idle.move_to_end(k)
            extra = [self._stripe_idle.popitem(last=False)[1][0] for _ in range(len(self._stripe_idle) - STRIPE_FDS)]
            for old in extra:
                self._stripe_ident.pop(old, None)
        for old in extra:
            os.close(old)

    # -- block files -------------------------------------------------------------
    def block_ref(self, key, path, open_only: bool = False) -> _BlockFd | None:
        """A referenced descriptor of the block file ``key`` names (hashable, e.g. ``(namespace,
        name)``; release it with :meth:`release`), or None: the file does not exist (or is a
        symlink), or ``open_only`` and none is open. ``path()`` gives the file's path (called only
        to open it). A cached descriptor whose file is no longer linked is dropped and the file
        opened again."""
        with self._mutex:
            ent = self._blocks.get(key)
            if ent is not None:
                ent.refs += 1
                self._blocks.move_to_end(key)
        if ent is not None:
            if _linked(ent.fd):
                return ent
            self.release(ent)
            self.drop(key, ent)
        if open_only:
            return None
        try:
            fd = open_file(path(), os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise
        new = _BlockFd(fd, _identity(fd))
        new.refs = 1
        evicted = []
        self._opens += 1
        if self._opens % BLOCK_FDS == 0:
            self.sweep()
        with self._mutex:
            old = self._blocks.pop(key, None)
            if old is not None:
                old.dead = True
                evicted.append(old)
            self._blocks[key] = new
            while len(self._blocks) > BLOCK_FDS:
                _, e = self._blocks.popitem(last=False)
                e.dead = True
                evicted.append(e)
            closing = [e for e in evicted if e.refs == 0]
        for e in closing:
            os.close(e.fd)
        return new

    def sweep(self) -> None:
        """Close the descriptors of block files unlinked since (evicted or removed by any
        process), so they do not keep those files' space: run every :data:`BLOCK_FDS`-th open,
        so a process that keeps reading holds at most that many unlinked files' bytes."""
        with self._mutex:
            items = list(self._blocks.items())
        for key, ent in items:
            if not _linked(ent.fd):
                self.drop(key, ent)

    def release(self, ent: _BlockFd) -> None:
        """End a read through ``ent`` (closes it if it was dropped meanwhile and this was the last use)."""
        with self._mutex:
            ent.refs -= 1
            close = ent.dead and ent.refs == 0
            if close:
                ent.dead = False  # closed once
                ent.refs = -1
        if close:
            os.close(ent.fd)

    def drop(self, key, ent: _BlockFd | None = None) -> None:
        """Forget the descriptor of the block file ``key`` names (only ``ent`` if given): closed
        now, or by the last read still using it."""
        with self._mutex:
            cur = self._blocks.get(key)
            if cur is None or (ent is not None and cur is not ent):
                return
            del self._blocks[key]
            cur.dead = True
            close = cur.refs == 0
            if close:
                cur.refs = -1
        if close:
            os.close(cur.fd)

    def close(self) -> None:
        """Close every idle descriptor of this process (block files, idle stripes, the budget
        lock file when not held); used ones close when their use ends."""
        with self._mutex:
            blocks = list(self._blocks.items())
            stripes = list(self._stripe_idle.values())
            self._stripe_idle = OrderedDict()
            self._stripe_ident.clear()
        for key, ent in blocks:
            self.drop(key, ent)
        for fd, _ in stripes:
            os.close(fd)
        if self.budget_mutex.acquire(blocking=False):
            try:
                if self._budget is not None:
                    os.close(self._budget[0])
                    self._budget = None
            finally:
                self.budget_mutex.release()

    def __del__(self) -> None:
        # A dropped cache (its Dataset dropped) gives its descriptors back at once rather than at
        # exit; a forked child's copy is left alone (the parent's descriptors; for_pid replaced it).
        try:
            if self.pid == os.getpid():
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: os or the locks may be gone
            pass

    def open_block_fds(self) -> int:
        """How many block files this process holds open (tests)."""
        with self._mutex:
            return len(self._blocks)


def wait_flock(fd: int, timeout_s: float) -> bool:
    """Take an exclusive ``flock`` on ``fd`` (a descriptor the caller owns alone), waiting at most
    ``timeout_s`` seconds. True when held. On a timeout the descriptor passes to the helper thread
    that waits in ``flock``: once it gets the lock it unlocks and closes it, so the caller must
    neither use nor close ``fd`` after False. Raises what ``flock`` raises (the caller then still
    owns ``fd``)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
    if timeout_s <= 0:
        return False
    done = threading.Event()
    guard = threading.Lock()
    state: dict = {"got": False, "abandoned": False, "error": None}

    def run() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks without holding the GIL
        except OSError as exc:
            with guard:
                if state["abandoned"]:
                    os.close(fd)
                    return
                state["error"] = exc
            done.set()
            return
        with guard:
            if state["abandoned"]:  # the caller gave up meanwhile: let go of it
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return
            state["got"] = True
        done.set()

    threading.Thread(target=run, name="stoker-fetch-lock-wait", daemon=True).start()
    done.wait(timeout_s)
    with guard:
        if state["error"] is not None:
            raise state["error"]
        if state["got"]:
            return True
        state["abandoned"] = True
        return False


__all__ = ["BLOCK_FDS", "STRIPE_FDS", "Handles", "wait_flock"]
