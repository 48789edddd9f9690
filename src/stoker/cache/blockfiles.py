"""The block files of one cache directory: paths, ranged reads through descriptors kept open,
whole-or-nothing writes, removal, and the listing that counting and eviction walk.

Block ``name`` of namespace ``ns`` is the file ``<root>/stoker-ns-<ns>/<name>`` (:mod:`.layout`);
a fill in progress is a temporary file ``.tmp-<pid>-<rand>`` beside it, renamed into place
(:mod:`.files`), so a reader sees a whole block or none. Reads go through this process's open
descriptors (:mod:`.handles`): no open/close per sample, and a descriptor of a file since unlinked
(evicted, replaced) is never read. Nothing here knows the budget: the caller reserves a block's
bytes before :meth:`BlockFiles.write` and gives them back after :meth:`BlockFiles.remove`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

from .._procs import pid_alive
from . import layout
from .cachedir import CacheDir
from .files import TMP_MARK, is_file, write_whole

#: (path, size in bytes, mtime in seconds, whether it is a fill in progress) of a file in a namespace.
Entry = tuple[str, int, float, bool]


class BlockFiles:
    """The block files under ``cache_dir`` (a :class:`stoker.cache.cachedir.CacheDir`). Picklable."""

    def __init__(self, cache_dir: CacheDir):
        self.dir = cache_dir

    def path(self, namespace: str, name: str) -> str:
        """File of block ``name`` of ``namespace`` (whether or not it is cached)."""
        return os.path.join(layout.ns_dir(self.dir.root, namespace), name)

    def read(
        self, namespace: str, name: str, offset: int, length: int, open_only: bool = False, touch: bool = False
    ) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of block ``name`` (fewer when the file is shorter: a
        damaged block, for the caller to drop), or None when it is not cached, or with ``open_only``
        when this process does not hold it open already. ``touch`` sets its mtime (LRU recency)."""
        return self.with_fd(namespace, name, lambda fd: os.pread(fd, length, offset), open_only, touch)

    def with_fd(self, namespace: str, name: str, use, open_only: bool = False, touch: bool = False):
        """``use(fd)`` on an open descriptor of block ``name``'s file (held open, not closed by
        ``use``: the block's bytes stay readable through it even if it is evicted meanwhile), and
        its result; None when the block is not cached (``open_only``, ``touch``: as :meth:`read`)."""
        h = self.dir.local()
        ent = h.block_ref((namespace, name), lambda: self.path(namespace, name), open_only)
        if ent is None:
            return None
        try:
            out = use(ent.fd)
            if touch:
                os.utime(ent.fd)
        finally:
            h.release(ent)
        return out

    def forget(self, namespace: str, name: str) -> None:
        """Close this process's descriptor of block ``name`` (now, or when the reads using it end);
        the file stays. A copy of the block in another tier is then what the next read finds
        (:mod:`.promote`)."""
        self.dir.local().drop((namespace, name))

    def contains(self, namespace: str, name: str) -> bool:
        """Whether block ``name`` of ``namespace`` is committed (a regular file, not a link)."""
        return is_file(self.path(namespace, name))

    def committed(self, namespace: str, name: str) -> bool:
        """Whether block ``name`` is committed; anything else at its name (a planted link, a
        directory) is removed, never followed. One ``lstat``: another writer links its copy in
        without the budget lock, so a second look could take its fresh block for a planted link."""
        final = self.path(namespace, name)
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode):
            return True
        os.unlink(final)
        return False

    def write(self, namespace: str, name: str, data) -> bool:
        """Write block ``name`` whole or not at all (a temporary file linked into place). False
        when another process committed it meanwhile (nothing written). Raises OSError (ENOSPC,
        EDQUOT on a full disk; the temporary file is removed)."""
        self.dir.ensure_ns(namespace)
        return write_whole(self.path(namespace, name), data, replace=False, mode=self.dir.mode)

    def delete(self, path: str) -> bool:
        """Unlink the block file ``path`` and forget this process's descriptor of it; False when
        it was gone already."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        finally:
            self.dir.local().drop((layout.namespace_of(path), os.path.basename(path)))
        return True

    def remove(self, namespace: str, name: str) -> int | None:
        """Remove block ``name``; its size in bytes, or None when it was not there."""
        path = self.path(namespace, name)
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            self.dir.local().drop((namespace, name))
            return None
        return size if self.delete(path) else None

    def entries(self, namespace: str | None = None) -> Iterator[Entry]:
        """:data:`Entry` of every block file and fill in progress of ``namespace``, or of every
        namespace of the cache's own (:func:`.layout.namespace_dirs`; nothing else in the root,
        nor a directory without the namespace's marker)."""
        if namespace is None:
            for ns, _ in layout.namespace_dirs(self.dir.root):
                yield from self.entries(ns)
            return
        path = layout.ns_dir(self.dir.root, namespace)
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
            yield e.path, st.st_size, st.st_mtime, e.name.startswith(TMP_MARK)

    def remove_dead_fills(self) -> int:
        """Delete the temporary files of fills whose process is dead; how many."""
        removed = 0
        for path, _, _, is_tmp in list(self.entries()):
            if not is_tmp:
                continue
            try:
                pid = int(os.path.basename(path)[len(TMP_MARK) :].split("-")[0])
            except ValueError:
                pid = -1
            if not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed += 1
        return removed
