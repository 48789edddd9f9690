"""Room on the filesystem under a cache: a budget above what the disk holds must not fail a job.

A cache budget is a promise of at most so many bytes, not a guarantee that the disk has
them: ``cache_bytes`` may exceed the filesystem (a 1 GiB budget on a 3 MiB disk), the
memory tier's budget may exceed /dev/shm, and other programs may fill the disk during an
epoch. The cache and the staging area therefore

- check every write against what the filesystem can take now (``statvfs``: blocks
  available to unprivileged users, ``f_bavail * f_frsize``), so the effective budget is
  ``min(budget, bytes in use + bytes free - slack)``;
- treat ENOSPC / EDQUOT from any write as "this block does not fit": the temporary file is
  removed, the reservation released, and the block is served from staging or the origin;
- warn once per job and directory, naming the directory and the free bytes.

"Once per job" across the job's processes: the first process to warn writes the job's
pid (the process that opened the cache) into bytes 8-16 of the cache's ``.lock`` file,
inside the page that already holds the usage counter, so claiming never needs new space.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct

log = logging.getLogger("stoker.cache")

#: What happens to a block that does not fit a cache directory (the warning's end); a memory
#: tier says its own (:attr:`stoker.cache.budget.Budget.overflow`).
STAGED_INSTEAD = "are staged or read from the origin instead"
#: errno values that mean "the filesystem (or the user's quota) is full".
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_WARN_SLOT = 8
_warned: set[tuple[str, int]] = set()


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` is an OSError for a full filesystem or quota (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def free_bytes(path: str) -> tuple[int, int] | None:
    """(bytes available to new files, filesystem block size in bytes) under ``path``
    (``os.statvfs``), or None if the filesystem cannot tell."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_frsize <= 0 or st.f_blocks == 0:
        return None
    return st.f_bavail * st.f_frsize, st.f_frsize


def headroom_bytes(path: str, nbytes: int, keep_free_fraction: float = 0.0) -> tuple[int, int] | None:
    """(bytes a new file of ``nbytes`` may still take under ``path``, bytes free), or None
    if unknown. The headroom is the free bytes less a slack of the file's rounding up to
    whole filesystem blocks plus two blocks (directory entries, the usage counter), and
    less ``keep_free_fraction`` of the filesystem's size (left to other users)."""
    info = free_bytes(path)
    if info is None:
        return None
    free, frsize = info
    rounding = -nbytes % frsize
    keep = 0
    if keep_free_fraction > 0:
        with contextlib.suppress(OSError):
            st = os.statvfs(path)
            keep = int(st.f_blocks * st.f_frsize * keep_free_fraction)
    return max(0, free - rounding - 2 * frsize - keep), free


def claim_warning(lock_fd: int, owner_pid: int) -> bool:
    """Whether this job (``owner_pid``) has not yet warned about the directory whose
    ``.lock`` file is open as ``lock_fd``; records that it has. Caller holds the file's flock."""
    try:
        raw = os.pread(lock_fd, 8, _WARN_SLOT)
        if len(raw) == 8 and struct.unpack("<q", raw)[0] == owner_pid:
            return False
        os.pwrite(lock_fd, struct.pack("<q", owner_pid), _WARN_SLOT)
    except OSError as exc:
        if not is_full(exc):
            raise
    return True


def warn_full(
    directory: str,
    free: int | None,
    budget_bytes: int | None,
    owner_pid: int,
    claim=None,
    keep_free_fraction: float = 0.0,
    instead: str = STAGED_INSTEAD,
) -> None:
    """Log the one warning of this job about a full ``directory`` (``free`` bytes left).
    ``claim``: a callable returning whether no other process of the job warned yet
    (:func:`claim_warning` under the cache's lock); without it, once per process.
    ``keep_free_fraction``: the share of the filesystem left to others, named in the warning
    (the memory tier's reserve on tmpfs) so that "full" with free bytes reads as it is.
    ``instead``: what happens to the blocks that do not fit (the memory tier: the disk tier)."""
    key = (directory, owner_pid)
    if key in _warned:
        return
    _warned.add(key)
    if claim is not None and not claim():
        return
    free_s = f"{free:,} bytes free" if free is not None else "no space left"
    budget = f", less than the cache budget of {budget_bytes:,} bytes" if budget_bytes else ""
    if keep_free_fraction > 0:
        budget += f", after leaving {keep_free_fraction:.0%} of the filesystem free for other users"
    log.warning(
        "cache directory %s is full (%s%s): blocks that do not fit there %s", directory, free_s, budget, instead
    )
