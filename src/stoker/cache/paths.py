"""Where the node cache lives by default, and the check that a cache directory can be one.

Home directories on clusters are often on NFS, the worst place for a block cache (every block
read crosses the network the cache is meant to spare, and NFS locking is slow or absent). So the
default is, in order:

1. ``$STOKER_CACHE_DIR`` when set;
2. ``<scratch>/stoker-<user>`` on the first of :data:`SCRATCH_CANDIDATES` (``/local``,
   ``/scratch``, ``/mnt/*nvme*``, ``/nvme*``, in that order; globs sorted) that exists, is a
   writable directory and is not on a network filesystem (:data:`NETWORK_FS`, read from
   ``/proc/mounts``);
3. ``~/.cache/stoker``.

The choice is logged once per process (INFO; a WARNING when it falls back to a home directory
on a network filesystem). A dataset opened with the default place or budget says so once per
process at WARNING (:func:`warn_defaults`): the default cache may take 8 GiB of a home
directory, and a user should hear that without turning logging up.
"""

from __future__ import annotations

import errno
import getpass
import glob
import logging
import os

from ..errors import CacheDirError, CacheUnwritableError

log = logging.getLogger(__name__)

__all__ = [
    "SCRATCH_CANDIDATES",
    "NETWORK_FS",
    "RAM_FS",
    "default_cache_dir",
    "check_root_path",
    "unwritable_root",
    "UNWRITABLE_ERRNOS",
    "ram_backed",
    "warn_defaults",
]

#: Node-local scratch locations tried, in order, for the default cache directory (globs allowed).
SCRATCH_CANDIDATES: tuple[str, ...] = ("/local", "/scratch", "/mnt/*nvme*", "/nvme*")
#: Filesystem types taken as network filesystems (never chosen as a default scratch location).
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "fuse.sshfs",
        "ceph",
        "fuse.ceph",
        "glusterfs",
        "fuse.glusterfs",
        "9p",
        "afs",
        "panfs",
        "wekafs",
    }
)
#: Filesystem types whose bytes are RAM (shared with every process's memory on the node).
RAM_FS = frozenset({"tmpfs", "ramfs"})
_LOGGED: set[str] = set()
_WARNED: set[str] = set()  # cache directories whose defaults were told, in this process


def _fs_type(path: str, mounts_file: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount that holds ``path`` (longest mount-point prefix), or None."""
    try:
        with open(mounts_file) as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for row in rows:
        if len(row) >= 3:
            mnt = row[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, row[2]
    return kind


def ram_backed(path: str, mounts_file: str = "/proc/mounts") -> bool:
    """Whether ``path`` (existing or not) lies on a RAM-backed filesystem (:data:`RAM_FS`).
    Where the mount table cannot be read, a path under ``/dev/shm`` counts as RAM-backed."""
    kind = _fs_type(path, mounts_file)
    if kind is None:
        real = os.path.realpath(path)
        return real == "/dev/shm" or real.startswith("/dev/shm/")
    return kind in RAM_FS


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _scratch(candidates: tuple[str, ...]) -> str | None:
    for pattern in candidates:
        for path in sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]:
            if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK) and _fs_type(path) not in NETWORK_FS:
                return path
    return None


def _log_once(level: int, message: str, *args) -> None:
    if message % args not in _LOGGED:
        _LOGGED.add(message % args)
        log.log(level, message, *args)


def default_cache_dir(candidates: tuple[str, ...] | None = None) -> str:
    """The default node cache directory (see the module docstring for the order); ``candidates``
    replaces :data:`SCRATCH_CANDIDATES`. Creates nothing. Logs the choice once per process."""
    env = os.environ.get("STOKER_CACHE_DIR")
    if env:
        _log_once(logging.INFO, "cache directory %s (from STOKER_CACHE_DIR)", env)
        return env
    scratch = _scratch(SCRATCH_CANDIDATES if candidates is None else candidates)
    if scratch is not None:
        path = os.path.join(scratch, f"stoker-{_user()}")
        _log_once(logging.INFO, "cache directory %s (node-local scratch; set STOKER_CACHE_DIR to choose)", path)
        return path
    path = os.path.join(os.path.expanduser("~"), ".cache", "stoker")
    kind = _fs_type(os.path.expanduser("~"))
    if kind in NETWORK_FS:
        _log_once(
            logging.WARNING,
            "cache directory %s is on a network filesystem (%s): reads from the cache "
            "cross the network; set STOKER_CACHE_DIR to a node-local disk",
            path,
            kind,
        )
    else:
        _log_once(
            logging.INFO, "cache directory %s (no node-local scratch found; set STOKER_CACHE_DIR to choose)", path
        )
    return path


def warn_defaults(root: str, budget_bytes: int, dir_given: bool, budget_given: bool) -> None:
    """Log at WARNING, the first time in this process a cache directory is used with a default
    place or budget, where the node cache is and how much it may take: ``root`` (the directory),
    ``budget_bytes`` (bytes); ``dir_given``: the directory came from ``cache_dir=`` or
    ``$STOKER_CACHE_DIR``; ``budget_given``: the budget from ``cache_bytes=``. Says nothing when
    both were chosen."""
    if (dir_given and budget_given) or root in _WARNED:
        return
    _WARNED.add(root)
    from .._units import format_size

    which = " and ".join(w for w, default in (("place", not dir_given), ("budget", not budget_given)) if default)
    log.warning(
        "node cache %s, up to %s: the default %s (choose with open_dataset(cache_dir=, cache_bytes=) "
        "or $STOKER_CACHE_DIR; `stoker cache status %s` shows it, `stoker cache clear %s` empties it)",
        root,
        format_size(budget_bytes),
        which,
        root,
        root,
    )


def check_root_path(root: str) -> None:
    """Check that the cache directory ``root`` is, or can be made, a directory (the caller creates
    it with the cache's mode: :func:`stoker.cache.perms.open_root`).

    Raises :class:`~stoker.errors.CacheDirError` (a NotADirectoryError) naming ``root`` and the
    file in the way when ``root`` or one of its parents is a file.
    """
    probe = os.path.abspath(root)
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):
        what = "is a file" if probe == os.path.abspath(root) else f"cannot be made: {probe} is a file"
        raise CacheDirError(
            f"cache directory {root} {what}, not a directory: pass a directory as cache_dir (or set STOKER_CACHE_DIR)"
        )


#: errnos of a directory that exists (or could) but cannot be written
UNWRITABLE_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def unwritable_root(root: str, exc: OSError) -> CacheUnwritableError:
    """The error to raise when the cache directory ``root`` cannot be created or written
    (``exc``: the OSError of the write that failed; its path is named as what failed)."""
    why = "a read-only filesystem" if exc.errno == errno.EROFS else (exc.strerror or "permission denied").lower()
    where = exc.filename if isinstance(exc.filename, str) else None
    return CacheUnwritableError(
        root, why + (f": {where}" if where and where != root else ""), exc.errno or errno.EACCES
    )
