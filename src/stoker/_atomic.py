"""Whole-or-nothing file writes and symlink-safe opens: the one place stoker writes a file
through a temporary and a rename.

Every such write (cache blocks, staging, derived entries, job records, pack outputs, lease
files, the cluster state file) goes through :func:`write_atomic`:

* the temporary is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, so it is
  never a file or a link that someone else planted and nobody else can read it while it is
  written (the process umask plays no part);
* it gets its final mode (``fchmod``, exact, whatever the umask) before it is renamed, so a
  reader never sees it with another mode;
* it is renamed over the final name (``rename(2)`` replaces a link, never follows it) or,
  with ``replace=False``, hard-linked to it (fails if the name exists), and removed on any error.

:func:`open_file` opens (and creates) a file without following a symlink at its last
component (``O_NOFOLLOW``) and gives a file it created its exact mode.
"""

from __future__ import annotations

import contextlib
import os
import uuid

__all__ = ["PRIVATE_FILE_MODE", "open_file", "umask_mode", "write_atomic"]

#: Mode of every temporary file, and of cache files unless a cache mode says otherwise.
PRIVATE_FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def umask_mode(base: int = 0o666) -> int:
    """``base`` less the process umask: the mode a plain ``open(path, "w")`` would give
    (for files that are meant to be as readable as the user's other files, e.g. a packed
    dataset). Reads the umask from /proc (Linux) so no other thread sees it changed."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return base & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def open_file(path: str, flags: int, mode: int = PRIVATE_FILE_MODE) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``; a file this call may have
    created (``O_CREAT`` in ``flags``) and that this user owns gets exactly ``mode`` (the
    umask would otherwise take bits off). Returns the descriptor.

    Raises OSError as ``os.open`` does: ``ELOOP`` when ``path`` is a symlink.
    """
    fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode)
    if flags & os.O_CREAT:
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
    return fd


def write_fd(fd: int, data, path: str) -> None:
    """Write all of ``data`` (bytes-like) to descriptor ``fd`` of file ``path`` (named in
    errors; fault-injection tests replace this function). OSError (ENOSPC, ...) propagates."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(
    final: str,
    data,
    *,
    mode: int = PRIVATE_FILE_MODE,
    replace: bool = True,
    fsync: bool = False,
    tmp_prefix: str | None = None,
) -> bool:
    """Write ``data`` (bytes-like) to ``final`` so that readers see all of it or nothing.

    The temporary is ``<tmp_prefix><pid>-<8 hex>`` (default prefix ``<final>.tmp-``; the pid
    lets a cleaner tell fills of dead processes), created 0600 with ``O_EXCL | O_NOFOLLOW``,
    written, given ``mode`` (exact, whatever the umask), optionally fsync'ed, then renamed
    onto ``final``. With ``replace=False`` an existing ``final`` is kept (hard link, no
    clobber) and False is returned, so two writers of one name cannot both count it.
    Returns True when ``final`` was written. The temporary is removed on any error; OSErrors
    (ENOSPC, EACCES, ELOOP, ...) propagate.
    """
    prefix = f"{final}.tmp-" if tmp_prefix is None else tmp_prefix
    tmp = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, PRIVATE_FILE_MODE)
    try:
        try:
            write_fd(fd, data, tmp)
            if mode != PRIVATE_FILE_MODE or os.fstat(fd).st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, final)
            return True
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
