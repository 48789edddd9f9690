"""Status and clearing of a node cache directory (`stoker cache status|clear`, in :mod:`stoker.cli.cache`).

Both act only on what the cache recognises as its own (:mod:`.layout`): a directory with
the cache's marker, its marked namespaces, and marked caches directly below it (the
per-node caches of ``stoker warm``). A directory that is neither a cache nor holds one is
refused (:class:`NotACacheError`, exit 2) before anything is read or written there.
"""
from __future__ import annotations

import os
import shutil

from ..errors import CacheInUseError, NotACacheError  # noqa: F401 - re-exported
from .disk import DiskCache
from .layout import ROOT_MARKER, foreign_entries, is_cache, namespace_dirs, nested_caches
from .policy import share_budget


def _side_stores(root: str) -> dict[str, str]:
    """The stores that belong to the cache at ``root``: its shared-memory tier and its
    derived-sample store (:mod:`stoker.loader.derived`), where they exist and carry the
    cache marker."""
    from .tiered import default_memory_root
    out = {}
    for name, path in (("memory tier", default_memory_root(root)), ("derived samples", os.path.join(root, ".derived"))):
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
            "recognised either; delete its folders by hand if nothing uses them")
    return own, nested


def _tree_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def status(root: str, budget_bytes: int | None = None) -> dict:
    """What a node cache holds: {"root", "used_bytes", "namespaces": {ns: bytes},
    "jobs": [records of live jobs], "quotas": {ns: bytes} (the ``future`` policy's split of
    ``budget_bytes``; empty without a budget), "removed_tmp", "stores": {name: {"path",
    "bytes"}} (memory tier, derived samples), "nested": [status of each cache directory
    under ``root``], "ignored": [names of entries under ``root`` that are not the cache's
    and are left alone]}. Recovers first (removes fills of dead processes, recounts usage).
    A directory without the marker that holds caches shows only those (nothing is written
    to it). FileNotFoundError if ``root`` is not a directory, :class:`NotACacheError` if it
    neither is nor holds a cache."""
    own, nested = _check_cache(root)
    sub = [status(n, budget_bytes) for n in nested]
    if not own:
        return {"root": os.path.abspath(root), "used_bytes": 0, "removed_tmp": 0, "namespaces": {}, "jobs": [],
                "quotas": {}, "stores": {}, "nested": sub, "ignored": []}
    cache = DiskCache(root, budget_bytes or 0, "future")
    rec = cache.recover()
    live = cache.jobs.live()
    namespaces = cache.namespace_usage()
    return {"root": cache.root, "used_bytes": sum(namespaces.values()), "removed_tmp": rec["removed_tmp"],
            "namespaces": namespaces, "jobs": cache.jobs.records(),
            "quotas": share_budget(budget_bytes, live) if budget_bytes else {},
            "stores": {k: {"path": v, "bytes": _tree_bytes(v)} for k, v in _side_stores(cache.root).items()},
            "nested": sub, "ignored": [n for n in foreign_entries(cache.root) if os.path.join(cache.root, n) not in nested]}


def clear(root: str, namespace: str | None = None, *, _nested: bool = False) -> int:
    """Delete the cached blocks of ``namespace`` (every namespace if None) and return the
    bytes freed. Only the cache's own namespaces and side stores go (and those of the caches
    directly below ``root``); every other file stays. Refuses (:class:`CacheInUseError`) while
    a live job is registered on what it would delete, naming the job's pid: clear a cache
    only when no job uses it. FileNotFoundError if ``root`` is not a directory,
    :class:`NotACacheError` (nothing deleted) if it neither is nor holds a cache; ValueError
    (nothing deleted) if ``namespace`` is given and no cache there holds it."""
    own, nested = _check_cache(root)
    for path in [root, *nested] if own else nested:  # refuse before deleting anything
        busy = [r for r in DiskCache(path, 0, "future").jobs.records() if namespace in (None, r["namespace"])]
        if busy:
            raise CacheInUseError(f"cache {os.path.abspath(path)} is in use by live job(s) " + ", ".join(
                f"pid {r['pid']} (dataset {r['namespace']})" for r in busy))
    if namespace is not None and not _nested:  # a namespace that is nowhere is a typo: say so
        held = {ns for path in ([root, *nested] if own else nested) for ns, _ in namespace_dirs(path)}
        if namespace not in held:
            raise ValueError(f"no dataset version {namespace!r} in the cache {os.path.abspath(root)} "
                             f"(it holds: {', '.join(sorted(held)) or 'none'}); nothing deleted")
    freed = sum(clear(n, namespace, _nested=True) for n in nested)
    if not own:
        return freed
    cache = DiskCache(root, 0, "future")
    cache.recover()
    for ns, path in namespace_dirs(cache.root):
        if namespace in (None, ns):
            freed += _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
    if namespace is None:
        for path in _side_stores(cache.root).values():
            freed += _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
    cache.recover()
    return freed
