"""File modes and trusted directories of a node cache shared by several users.

A node is often shared by several users and jobs; a cache holds other people's training
data, so everything stoker creates for a cache is private by default, whatever the umask
(JuiceFS makes its cache files 0600 by default too):

* files (blocks, staging, derived entries, locks, usage counters, job records, the marker)
  are created with the cache's *file mode*, 0600 by default;
* directories get the same bits plus search (``x``) wherever read is set: 0700 by default.

A cache shared by a group on purpose takes ``cache_mode`` (``--cache-mode`` on the CLI,
``$STOKER_CACHE_MODE``), e.g. ``0640`` (the group reads) or ``0660`` (the group also fills),
with the directory's group set to that group. The mode is recorded in the cache's marker;
opening a cache with another mode raises :class:`~stoker.errors.CacheModeError` (never a mix
of modes in one directory). A mode that others may write (``0o002``), that lacks the owner's
read and write, or that has execute or special bits is a ValueError.

Paths are not trusted because of their names: a directory that stoker writes into must be a
real directory (not a symlink), not writable by others, and owned by this user, or, for a
group-shared cache, have the cache's group among this process's groups. Anything else raises
:class:`~stoker.errors.UnsafePathError` naming it: another user cannot redirect a fill by
planting a link in /dev/shm or in a cache directory in advance. Files are opened with
``O_NOFOLLOW`` (:mod:`stoker._atomic`).
"""

from __future__ import annotations

import os
import pwd
import stat

from .._atomic import PRIVATE_FILE_MODE
from ..errors import CacheModeError, UnsafePathError
from . import layout
from .space import is_full

#: Environment variable holding the default cache mode (octal, e.g. ``0640``).
MODE_ENV = "STOKER_CACHE_MODE"
DEFAULT_MODE = PRIVATE_FILE_MODE


def parse_mode(mode: int | str | None) -> int:
    """The cache file mode from ``mode`` (an int such as ``0o640`` or an octal string such as
    ``"0640"``/``"640"``); None: ``$STOKER_CACHE_MODE`` or 0600.

    Raises ValueError naming the value when it is not octal, lets others write (0o002), lacks
    the owner's read and write (0o600), or has execute or special bits."""
    if mode is None:
        mode = os.environ.get(MODE_ENV) or DEFAULT_MODE
    if isinstance(mode, str):
        try:
            value = int(mode.strip().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"cache mode {mode!r} is not an octal file mode such as 0600 or 0640") from None
    elif isinstance(mode, int) and not isinstance(mode, bool):
        value = mode
    else:
        raise ValueError(f"cache mode {mode!r} is not an octal file mode such as 0600 or 0640")
    if value & ~0o666 or value & 0o600 != 0o600 or value & 0o002:
        raise ValueError(
            f"cache mode {value:#o} ({mode!r}) is not allowed: it must give the owner read "
            "and write (0600), have no execute or special bits, and not let others write; "
            "e.g. 0600 (private) or 0640 / 0660 (shared with the directory's group)"
        )
    return value


def dir_mode(file_mode: int) -> int:
    """Directory mode for a cache file mode: the same bits plus ``x`` where ``r`` is set, and
    set-group-ID when the group has access, so that files made inside take the directory's
    group (0600 -> 0700, 0640 -> 2750, 0660 -> 2770)."""
    return file_mode | ((file_mode & 0o444) >> 2) | (stat.S_ISGID if file_mode & 0o060 else 0)


def fmt(mode: int) -> str:
    """``0640``-style text of a mode."""
    return f"{mode:04o}"


def owner_name(uid: int) -> str:
    """User name of ``uid`` (``uid 1234`` when the system does not know it)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group_shared(file_mode: int, st: os.stat_result) -> bool:
    return bool(file_mode & 0o060) and (st.st_gid == os.getegid() or st.st_gid in os.getgroups())


def check_dir(path: str, file_mode: int, st: os.stat_result | None = None) -> None:
    """Raise :class:`UnsafePathError` naming ``path`` unless it is a directory (not a symlink)
    that others cannot write and that this user owns (or, for a group-shared ``file_mode``,
    whose group is one of this process's). FileNotFoundError if it does not exist."""
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"cache path {path} is a symlink: refused (stoker does not write through "
            "links that someone else may have planted; give the real directory)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"cache path {path} is not a directory")
    if st.st_mode & 0o002:  # e.g. /tmp or /dev/shm themselves: anyone can plant names there
        raise UnsafePathError(
            f"cache directory {path} is writable by every user (mode "
            f"{fmt(stat.S_IMODE(st.st_mode))}): refused; use a directory of your own"
        )
    if st.st_uid != os.geteuid() and not _group_shared(file_mode, st):
        raise UnsafePathError(
            f"cache directory {path} is owned by {owner_name(st.st_uid)}, not by "
            f"{owner_name(os.geteuid())}: refused (another user's directory could "
            "redirect or expose the cache's writes)"
        )


def ensure_dir(path: str, file_mode: int, parents: bool = True) -> str:
    """Create directory ``path`` with :func:`dir_mode` of ``file_mode`` (exact, whatever the
    umask), and missing parents too (with ``parents``), or check that the existing one is
    trusted (:func:`check_dir`). Returns ``path``.

    Raises :class:`UnsafePathError` naming a symlink, a non-directory, another user's or an
    others-writable directory; OSError from ``mkdir``."""
    mode = dir_mode(file_mode)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        check_dir(path, file_mode)
        return path
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not parents or parent == path:
            raise
        ensure_parent(parent, file_mode)
        return ensure_dir(path, file_mode, parents=False)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


def ensure_parent(path: str, file_mode: int) -> None:
    """Create the missing directories of ``path`` (above a cache root, e.g. ``~/.cache``)
    with the cache's directory mode; existing ones are left as they are."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        ensure_parent(parent, file_mode)
    try:
        os.mkdir(path, dir_mode(file_mode))
    except FileExistsError:
        pass
    else:
        os.chmod(path, dir_mode(file_mode))


def check_root(root: str, file_mode: int) -> None:
    """Check a cache root before it is used: a symlink at ``root`` counts only when this
    user (or root) owns the link and its target passes :func:`check_dir`.

    Raises :class:`UnsafePathError` naming ``root`` or the link's target."""
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (os.geteuid(), 0):
            raise UnsafePathError(
                f"cache path {root} is a symlink owned by {owner_name(st.st_uid)}: refused "
                "(another user may have planted it to redirect the cache)"
            )
        target = os.path.realpath(root)
        check_dir(target, file_mode)
        return
    check_dir(root, file_mode, st)


def open_root(root: str, file_mode: int) -> None:
    """Make ``root`` ready for a cache of ``file_mode``, before anything is written there:
    create it (and missing parents) with the directory mode, or check the existing one
    (:func:`check_root`); refuse a cache made with another mode; bring a cache of an older
    stoker, whose marker records no mode, to ``file_mode`` (its own files only) and record it.

    Raises :class:`~stoker.errors.CacheModeError` naming ``root`` and both modes,
    :class:`UnsafePathError` naming the path that is not trusted."""
    if os.path.lexists(root):
        check_root(root, file_mode)
        st = os.stat(root)
        if file_mode & 0o060 and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISGID:
            os.chmod(root, stat.S_IMODE(st.st_mode) | stat.S_ISGID)  # what is made inside takes its group
    else:
        ensure_dir(root, file_mode)
    if not layout.is_cache(root):
        return
    recorded = layout.recorded_mode(root)
    if recorded == file_mode:
        return
    if recorded is not None:
        raise CacheModeError(
            f"cache directory {root} was made with cache mode {fmt(recorded)} and is opened with "
            f"{fmt(file_mode)}: refused, so that its files do not end up with mixed modes; open it with "
            f"CacheOptions(cache_mode={fmt(recorded)}) (--cache-mode {fmt(recorded)}), or use another directory"
        )
    st = os.stat(root)
    if st.st_uid != os.geteuid():
        raise CacheModeError(
            f"cache directory {root} (owned by {owner_name(st.st_uid)}) records no cache "
            "mode (made by an older stoker): only its owner can open it, which sets its mode"
        )
    _adopt(root, file_mode)
    try:
        layout.set_recorded_mode(root, file_mode)
    except OSError as exc:  # a full disk: the files have the mode; it is recorded on a later open
        if not is_full(exc):
            raise


def _adopt(root: str, file_mode: int) -> None:
    """Give the cache's own files and directories under ``root`` (bookkeeping and marked
    namespaces, :mod:`.layout`) ``file_mode`` / its directory mode; symlinks are skipped."""
    own = [os.path.join(root, n) for n in (".lock", ".locks", ".usage", ".jobs", ".staging", layout.ROOT_MARKER)]
    own += [p for _, p in layout.namespace_dirs(root)]
    for top in own:
        if not os.path.lexists(top):
            continue
        _chmod_nofollow(top, file_mode)
        if os.path.isdir(top) and not os.path.islink(top):
            for d, dirs, files in os.walk(top):
                for n in dirs + files:
                    _chmod_nofollow(os.path.join(d, n), file_mode)


def _chmod_nofollow(path: str, file_mode: int) -> None:
    st = os.lstat(path)
    if st.st_uid != os.geteuid():
        return
    if stat.S_ISDIR(st.st_mode):
        os.chmod(path, dir_mode(file_mode))
    elif stat.S_ISREG(st.st_mode):
        os.chmod(path, file_mode)
