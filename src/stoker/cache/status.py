"""`stoker cache status DIR` and `stoker cache clear DIR`: a node cache on the command line.

Both act only on what the cache recognises as its own (:mod:`.layout`): a directory with
the cache's marker, its marked namespaces, and marked caches directly below it (the
per-node caches of ``stoker warm``). A directory that is neither a cache nor holds one is
refused (:class:`NotACacheError`, exit 2) before anything is read or written there.
"""
from __future__ import annotations

import json
import os
import shutil

from .disk import DiskCache
from .layout import ROOT_MARKER, foreign_entries, is_cache, namespace_dirs, nested_caches
from .policy import share_budget


class NotACacheError(ValueError):
    """The directory is not a stoker cache (no marker) and holds none; the message names it."""


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


class CacheInUseError(RuntimeError):
    """A cache (or one dataset in it) is in use by a live job; the message names its pid."""


def clear(root: str, namespace: str | None = None) -> int:
    """Delete the cached blocks of ``namespace`` (every namespace if None) and return the
    bytes freed. Only the cache's own namespaces and side stores go (and those of the caches
    directly below ``root``); every other file stays. Refuses (:class:`CacheInUseError`) while
    a live job is registered on what it would delete, naming the job's pid: clear a cache
    only when no job uses it. FileNotFoundError if ``root`` is not a directory,
    :class:`NotACacheError` (nothing deleted) if it neither is nor holds a cache."""
    own, nested = _check_cache(root)
    for path in [root, *nested] if own else nested:  # refuse before deleting anything
        busy = [r for r in DiskCache(path, 0, "future").jobs.records() if namespace in (None, r["namespace"])]
        if busy:
            raise CacheInUseError(f"{path}: in use by live job(s) " + ", ".join(
                f"pid {r['pid']} (dataset {r['namespace']})" for r in busy))
    freed = sum(clear(n, namespace) for n in nested)
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


def add_parsers(sub) -> None:
    """Register ``stoker cache status|clear`` on an argparse subparsers object."""
    from ..cli import _size
    p = sub.add_parser("cache", help="inspect or clear a node cache directory")
    csub = p.add_subparsers(dest="cache_cmd", required=True)
    s = csub.add_parser("status", help="usage per dataset, live jobs, the policy's budget split")
    s.add_argument("dir")
    s.add_argument("--budget", type=_size, help="show the future policy's split of this budget (e.g. 500GiB)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_cmd_status)
    c = csub.add_parser("clear", help="delete cached blocks (refused while a job uses them)")
    c.add_argument("dir")
    c.add_argument("--namespace", help="only this dataset version")
    c.set_defaults(fn=_cmd_clear)


def _cmd_status(a) -> int:
    st = status(a.dir, a.budget)
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    _print_status(st)
    return 0


def _print_status(st: dict) -> None:
    print(f"{st['root']}: {st['used_bytes']:,} bytes of blocks")
    for ns, used in sorted(st["namespaces"].items()):
        q = st["quotas"].get(ns)
        print(f"  dataset {ns}: {used:,} bytes" + (f" (share {q:,})" if q is not None else ""))
    for r in st["jobs"]:
        rate = f"epoch {r['epoch_s']:.1f} s" if r.get("epoch_s") else "no epoch yet"
        print(f"  job pid {r['pid']}: dataset {r['namespace']} ({r['dataset_bytes']:,} bytes), {rate}")
    if st["quotas"] == {} and not st["jobs"]:
        print("  no live job: no budget split to show")
    for name, info in st["stores"].items():
        print(f"  {name}: {info['bytes']:,} bytes in {info['path']}")
    if st["ignored"]:
        print("  not the cache's (never counted, evicted or cleared): " + ", ".join(st["ignored"]))
    for sub in st["nested"]:
        _print_status(sub)


def _cmd_clear(a) -> int:
    freed = clear(a.dir, a.namespace)
    print(f"freed {freed:,} bytes")
    return 0
