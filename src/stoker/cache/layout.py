"""What a node cache owns inside its directory, and how it recognises it.

A cache directory is often a node's scratch disk that also holds other people's data
(source tars, packed datasets, notes). The cache therefore never takes "any folder here"
for its own. It recognises exactly:

- the cache root: a directory holding the marker file ``.stoker-cache`` (written when a
  :class:`stoker.cache.DiskCache` is first opened on it; JSON ``{"layout": 2, "mode":
  "0600"}``, the file mode the cache was made with, :mod:`.perms`);
- its namespaces (one per dataset content version): subdirectories named
  ``stoker-ns-<namespace>`` whose usage counter ``.usage/<namespace>`` the cache wrote
  (the counter is the namespace's marker: it is written before the directory is made,
  when the first block's bytes are reserved, and it keeps the directory's listing to
  block files only);
- its bookkeeping, all under names starting with ``.`` that it creates itself:
  ``.lock``, ``.locks/``, ``.usage/``, ``.jobs/``, ``.staging/``, ``.derived/``, and the labels
  of :mod:`.catalog` (``.datasets/``, ``.budget``).

Usage accounting, eviction, ``recover`` and ``stoker cache clear`` touch only these.
Everything else in the directory is left byte-identical and is listed by
``stoker cache status`` as not the cache's.

Caches made by older stoker versions (layout 1: every non-hidden subdirectory a
namespace, no markers) are not adopted: the old block folders cannot be told apart from
a user's folders for certain, so they are left alone, uncounted and never deleted. A new
cache opened on such a directory starts empty beside them; ``stoker cache status`` lists
them, and they can be deleted by hand once no older stoker uses them.
"""

from __future__ import annotations

import json
import os
import time

from .._atomic import open_file, write_atomic
from .space import is_full

ROOT_MARKER = ".stoker-cache"
NS_PREFIX = "stoker-ns-"
USAGE_DIR = ".usage"
LAYOUT = 2


def is_cache(root: str) -> bool:
    """Whether ``root`` is a stoker cache directory (it holds the root marker)."""
    return os.path.isfile(os.path.join(root, ROOT_MARKER))


#: Seconds a process that found the cache's files gone waits for a removal in progress (an
#: ``rm -rf`` still walking the directory) to finish before it makes the directory again.
SETTLE_S = 5.0


#: What every cache root holds from its first open on: the marker, the budget lock file, the
#: fetch-lock and usage directories (:class:`stoker.cache.DiskCache` makes them).
SKELETON = (ROOT_MARKER, ".lock", ".locks", USAGE_DIR)


def is_whole(root: str) -> bool:
    """Whether ``root`` holds the whole :data:`SKELETON` of a cache (four ``lstat``)."""
    return all(os.path.lexists(os.path.join(root, name)) for name in SKELETON)


def wait_removed(root: str, timeout_s: float = SETTLE_S) -> bool:
    """Wait while ``root`` exists but lacks part of its :data:`SKELETON` (an ``rm -rf`` of it in
    progress, which making it again under its feet would make fail with "Directory not empty"),
    at most ``timeout_s`` seconds. Returns True when ``root`` is gone or whole again (another
    process made it), False when it is still there, partly removed, at the end."""
    deadline = time.monotonic() + timeout_s
    while os.path.lexists(root) and not is_whole(root):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def mark_root(root: str, file_mode: int) -> None:
    """Write the root marker, recording ``file_mode``, if it is missing. A full disk leaves
    an empty marker (its presence is what makes the directory a cache; the mode is then
    taken as unrecorded, see :func:`recorded_mode`)."""
    path = os.path.join(root, ROOT_MARKER)
    try:
        fd = open_file(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, file_mode)
    except FileExistsError:
        return
    try:
        os.write(fd, json.dumps({"layout": LAYOUT, "mode": f"{file_mode:04o}"}).encode())
    except OSError as exc:
        if not is_full(exc):
            raise
    finally:
        os.close(fd)


def recorded_mode(root: str) -> int | None:
    """The file mode recorded in ``root``'s marker, or None when there is no marker or it
    records none (made by an older stoker, or left empty by a full disk).
    OSError (e.g. EACCES, ELOOP for a symlinked marker) propagates."""
    try:
        fd = open_file(os.path.join(root, ROOT_MARKER), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        rec = json.loads(raw)
        return int(rec["mode"], 8) if isinstance(rec, dict) and isinstance(rec.get("mode"), str) else None
    except ValueError:
        return None


def set_recorded_mode(root: str, file_mode: int) -> None:
    """Rewrite the marker to record ``file_mode`` (whole-or-nothing)."""
    write_atomic(
        os.path.join(root, ROOT_MARKER),
        json.dumps({"layout": LAYOUT, "mode": f"{file_mode:04o}"}).encode(),
        mode=file_mode,
        tmp_prefix=os.path.join(root, ".stoker-cache.tmp-"),
    )


def ns_dir(root: str, namespace: str) -> str:
    """Directory of one namespace's blocks."""
    return os.path.join(root, NS_PREFIX + namespace)


def usage_file(root: str, namespace: str) -> str:
    """The namespace's usage counter (8 bytes, little-endian int64), also its marker."""
    return os.path.join(root, USAGE_DIR, namespace)


def is_namespace_dir(path: str) -> bool:
    """Whether ``path`` is a namespace directory of a cache: the prefix, and the counter
    that the cache wrote for that namespace in the same root."""
    name = os.path.basename(path)
    return (
        name.startswith(NS_PREFIX)
        and len(name) > len(NS_PREFIX)
        and os.path.isfile(usage_file(os.path.dirname(path), name[len(NS_PREFIX) :]))
    )


def namespace_of(block_path: str) -> str:
    """The namespace of a block file path inside a namespace directory."""
    return os.path.basename(os.path.dirname(block_path))[len(NS_PREFIX) :]


def namespace_dirs(root: str) -> list[tuple[str, str]]:
    """[(namespace, directory)] of the cache's own namespaces under ``root``."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return sorted(
        (e.name[len(NS_PREFIX) :], e.path)
        for e in entries
        if e.name.startswith(NS_PREFIX) and e.is_dir(follow_symlinks=False) and is_namespace_dir(e.path)
    )


def nested_caches(root: str) -> list[str]:
    """Cache directories directly under ``root`` (e.g. the per-node caches ``node-<id>`` that
    ``stoker warm --cache-dir`` and the cluster services make), recognised by their marker."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    return sorted(
        e.path
        for e in entries
        if not e.name.startswith(".")
        and e.is_dir(follow_symlinks=False)
        and not e.name.startswith(NS_PREFIX)
        and is_cache(e.path)
    )


def foreign_entries(root: str) -> list[str]:
    """Names of the entries under ``root`` that are not the cache's (user files, caches of
    older stoker versions): left alone by every cache operation."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.is_dir(follow_symlinks=False) and (is_namespace_dir(e.path) or is_cache(e.path)):
            continue
        out.append(e.name)
    return sorted(out)
