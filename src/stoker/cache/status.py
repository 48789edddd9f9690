"""Status and clearing of a node cache directory (`stoker cache status|clear`, in :mod:`stoker.cli.cache`).

Both act only on what the cache recognises as its own (:mod:`.layout`): a directory with
the cache's marker, its marked namespaces, and marked caches directly below it (the
per-node caches of ``stoker warm``). A directory that is neither a cache nor holds one is
refused (:class:`NotACacheError`, exit 2) before anything is read or written there.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from ..errors import CacheInUseError, NotACacheError  # noqa: F401 - re-exported
from . import catalog
from .disk import DiskCache
from .layout import ROOT_MARKER, foreign_entries, is_cache, namespace_dirs, nested_caches, recorded_mode
from .perms import dir_mode, fmt, owner_name
from .policy import share_budget
from .tiered import default_memory_root


def _open(root: str, budget_bytes: int = 0) -> DiskCache:
    """The cache at ``root`` opened with the mode it was made with (status and clear work on
    a cache of any mode)."""
    return DiskCache(root, budget_bytes, "future", mode=recorded_mode(root))


def access(root: str) -> dict:
    """Who may read the cache at ``root``: {"mode": its file mode as ``"0600"``, "dir_mode":
    its directories' mode, "owner": user name, "owner_uid": int, "group": group id}."""
    st = os.stat(root)
    mode = recorded_mode(root)
    return {
        "mode": fmt(mode) if mode is not None else None,
        "dir_mode": fmt(dir_mode(mode)) if mode is not None else None,
        "owner": owner_name(st.st_uid),
        "owner_uid": st.st_uid,
        "group": st.st_gid,
    }


def _side_stores(root: str) -> dict[str, str]:
    """The stores that belong to the cache at ``root``: its shared-memory tier and its
    derived-sample store (:mod:`stoker.loader.derived`), where they exist and carry the
    cache marker."""
    out = {}
    memory = catalog.recorded_memory_root(root) or default_memory_root(root)  # a memory_dir= is recorded
    for name, path in (("memory tier", memory), ("derived samples", os.path.join(root, ".derived"))):
        if os.path.isdir(path) and is_cache(path):
            out[name] = path
    return out


def _check_cache(root: str) -> tuple[bool, list[str]]:
    """(whether ``root`` is a cache, its nested caches); raises FileNotFoundError or
    :class:`NotACacheError` when it is neither a cache nor holds one."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such cache directory")
    own, nested = is_cache(root), nested_caches(root)
    if not own and not nested:
        raise NotACacheError(
            f"{root} is not a stoker cache directory (no {ROOT_MARKER} marker in it or in a directory "
            "below it): nothing read or deleted. A cache made by an older stoker version is not "
            "recognised either; delete its folders by hand if nothing uses them"
        )
    return own, nested


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (files that vanish meanwhile count 0)."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, f))
    return total


def status(root: str, budget_bytes: int | None = None) -> dict:
    """What a node cache holds: {"root", "used_bytes", "namespaces": {ns: bytes},
    "datasets": {ns: {"url": the dataset URL it was opened from (None if not recorded),
    "version": ns}}, "budget_bytes": ``budget_bytes`` if given, else the budget of the last job
    that opened the cache (:mod:`.catalog`; None if unknown), "budget_source": "given",
    "recorded" or None, "jobs": [records of live jobs], "quotas": {ns: bytes} (the ``future``
    policy's split of the budget; empty without one), "removed_tmp", "stores": {name: {"path",
    "bytes"}} (memory tier, derived samples), "access": :func:`access` (mode and owner;
    None for a directory that only holds caches), "nested": [status of each cache directory
    under ``root``], "ignored": [names of entries under ``root`` that are not the cache's
    and are left alone]}. Recovers first (removes fills of dead processes, recounts usage).
    A directory without the marker that holds caches shows only those (nothing is written
    to it). FileNotFoundError if ``root`` is not a directory, :class:`NotACacheError` if it
    neither is nor holds a cache."""
    own, nested = _check_cache(root)
    sub = [status(n, budget_bytes) for n in nested]
    if not own:
        return {
            "root": os.path.abspath(root),
            "used_bytes": 0,
            "removed_tmp": 0,
            "namespaces": {},
            "jobs": [],
            "datasets": {},
            "budget_bytes": budget_bytes,
            "budget_source": "given" if budget_bytes else None,
            "quotas": {},
            "stores": {},
            "access": None,
            "nested": sub,
            "ignored": [],
        }
    recorded = catalog.recorded_budget(os.path.abspath(root))
    budget_bytes = budget_bytes or recorded
    cache = _open(root, budget_bytes or 0)
    rec = cache.recover()
    live = cache.jobs.live()
    namespaces = cache.usage.namespace_usage()
    urls = catalog.dataset_urls(cache.root)
    return {
        "root": cache.root,
        "used_bytes": sum(namespaces.values()),
        "removed_tmp": rec["removed_tmp"],
        "namespaces": namespaces,
        "jobs": cache.jobs.records(),
        "datasets": {ns: {"url": urls.get(ns), "version": ns} for ns in sorted(set(namespaces) | set(urls))},
        "budget_bytes": budget_bytes,
        "budget_source": ("given" if budget_bytes != recorded else "recorded") if budget_bytes else None,
        "quotas": share_budget(budget_bytes, live) if budget_bytes else {},
        "stores": {k: {"path": v, "bytes": tree_bytes(v)} for k, v in _side_stores(cache.root).items()},
        "access": access(cache.root),
        "nested": sub,
        "ignored": [n for n in foreign_entries(cache.root) if os.path.join(cache.root, n) not in nested],
    }


def clear(root: str, namespace: str | None = None, *, _nested: bool = False) -> int:
    """Delete the cached blocks of ``namespace`` (every namespace if None) and return the
    bytes freed. Only the cache's own namespaces and side stores go (and those of the caches
    directly below ``root``); every other file stays. Refuses (:class:`CacheInUseError`) while
    a live job is registered on what it would delete, naming the job's pid: clear a cache
    only when no job uses it. FileNotFoundError if ``root`` is not a directory,
    :class:`NotACacheError` (nothing deleted) if it neither is nor holds a cache. ``namespace``:
    a dataset's content version as ``stoker cache status`` prints it, in full or a prefix of it
    (status prints 12 characters) that names one version the cache holds; ValueError (nothing
    deleted) if no cache there holds it, or if the prefix names several (they are listed)."""
    own, nested = _check_cache(root)
    if namespace is not None and not _nested:  # a namespace that is nowhere is a typo: say so
        held = {ns for path in ([root, *nested] if own else nested) for ns, _ in namespace_dirs(path)}
        namespace = _resolve_version(namespace, held, root)
    for path in [root, *nested] if own else nested:  # refuse before deleting anything
        busy = [r for r in _open(path).jobs.records() if namespace in (None, r["namespace"])]
        if busy:
            raise CacheInUseError(
                f"cache {os.path.abspath(path)} is in use by live job(s) "
                + ", ".join(f"pid {r['pid']} (dataset {r['namespace']})" for r in busy)
            )
    freed = sum(clear(n, namespace, _nested=True) for n in nested)
    if not own:
        return freed
    cache = _open(root)
    cache.recover()
    for ns, path in namespace_dirs(cache.root):
        if namespace in (None, ns):
            freed += tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
    if namespace is None:
        for path in _side_stores(cache.root).values():
            freed += tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
    cache.recover()
    return freed


def _resolve_version(version: str, held: set[str], root: str) -> str:
    """The one version of ``held`` (the cache's namespaces) that ``version`` names: itself, or the
    only one it is a prefix of. ValueError naming the cache ``root`` and listing the versions when
    it names none or several (nothing is deleted then)."""
    if version in held:
        return version
    matches = sorted(ns for ns in held if version and ns.startswith(version))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(
            f"dataset version prefix {version!r} names {len(matches)} versions in the cache "
            f"{os.path.abspath(root)} ({', '.join(matches)}); give more characters; nothing deleted"
        )
    raise ValueError(
        f"no dataset version {version!r} in the cache {os.path.abspath(root)} "
        f"(it holds: {', '.join(sorted(held)) or 'none'}); nothing deleted"
    )
