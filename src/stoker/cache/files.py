"""Block files: whole-or-nothing writes and ranged reads, shared by the cache and the staging area.

Files are written through :func:`stoker._atomic.write_atomic` (a 0600 ``O_EXCL | O_NOFOLLOW``
temporary, given the cache's file mode, then renamed) and read with ``O_NOFOLLOW``: a symlink
planted at a block's name is never followed (:mod:`.perms`).
"""

from __future__ import annotations

import errno
import os
import stat

from .._atomic import PRIVATE_FILE_MODE, open_file, write_atomic

TMP_MARK = ".tmp-"


def write_whole(final: str, data, replace: bool = True, mode: int = PRIVATE_FILE_MODE) -> bool:
    """:func:`stoker._atomic.write_atomic` of ``data`` to ``final`` (same ``replace``, ``mode`` and
    result) through a temporary sibling ``<dir>/.tmp-<pid>-<rand>``, the name cleaners look for."""
    return write_atomic(
        final, data, mode=mode, replace=replace, tmp_prefix=os.path.join(os.path.dirname(final), TMP_MARK)
    )


def is_file(path: str) -> bool:
    """Whether ``path`` is a regular file itself (a symlink is not, whatever it points to)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def read_at(path: str, offset: int, length: int) -> bytes | None:
    """Bytes ``[offset, offset+length)`` of file ``path``: None if the file does not exist or
    is a symlink (never followed), short bytes if it is shorter than that."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
