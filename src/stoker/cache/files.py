"""Block files: whole-or-nothing writes and ranged reads, shared by the cache and the staging area."""
from __future__ import annotations

import os
import uuid

TMP_MARK = ".tmp-"


def write_whole(final: str, data, replace: bool = True) -> bool:
    """Write ``data`` to a temporary sibling ``<dir>/.tmp-<pid>-<rand>`` and rename it to ``final``,
    so readers see the whole block or nothing. The temporary file is removed on any error.
    With ``replace=False`` an existing ``final`` is kept (hard link, no clobber) and False is
    returned, so two writers of one name cannot both count it. True when ``final`` was written."""
    tmp = os.path.join(os.path.dirname(final), f"{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
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
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_at(path: str, offset: int, length: int, touch: bool = False) -> bytes | None:
    """Bytes ``[offset, offset+length)`` of file ``path``: None if the file does not exist,
    short bytes if it is shorter than that. ``touch`` updates its mtime (LRU recency)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        data = os.pread(fd, length, offset)
        if touch:
            os.utime(fd)
        return data
    finally:
        os.close(fd)
