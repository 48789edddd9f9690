"""`stoker cache status DIR` and `stoker cache clear DIR`: a node cache on the command line."""
from __future__ import annotations

import json
import os
import shutil

from .disk import DiskCache
from .policy import share_budget


def _is_cache(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".lock"))


def nested_caches(root: str) -> list[str]:
    """Cache directories directly under ``root`` (e.g. the per-node caches ``node-<id>`` that
    ``stoker warm --cache-dir`` and the cluster services make)."""
    return sorted(e.path for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".") and _is_cache(e.path))


def _side_stores(root: str) -> dict[str, str]:
    """The stores that belong to the cache at ``root``: its shared-memory tier and its
    derived-sample store (:mod:`stoker.decode.derived`), where they exist."""
    from .tiered import default_memory_root
    out = {}
    for name, path in (("memory tier", default_memory_root(root)), ("derived samples", os.path.join(root, ".derived"))):
        if os.path.isdir(path):
            out[name] = path
    return out


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
    under ``root``]}. Recovers first (removes fills of dead processes, recounts usage).
    FileNotFoundError if ``root`` is not a directory."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such cache directory")
    nested = nested_caches(root)
    cache = DiskCache(root, budget_bytes or 0, "future")
    rec = cache.recover()
    live = cache.jobs.live()
    namespaces = {ns: b for ns, b in cache.namespace_usage().items()
                  if not _is_cache(os.path.join(cache.root, ns))}
    return {"root": cache.root, "used_bytes": sum(namespaces.values()), "removed_tmp": rec["removed_tmp"],
            "namespaces": namespaces, "jobs": cache.jobs.records(),
            "quotas": share_budget(budget_bytes, live) if budget_bytes else {},
            "stores": {k: {"path": v, "bytes": _tree_bytes(v)} for k, v in _side_stores(cache.root).items()},
            "nested": [status(n, budget_bytes) for n in nested]}


class CacheInUseError(RuntimeError):
    """A cache (or one dataset in it) is in use by a live job; the message names its pid."""


def clear(root: str, namespace: str | None = None) -> int:
    """Delete the cached blocks of ``namespace`` (every namespace if None) and return the
    bytes freed. Refuses (:class:`CacheInUseError`) while a live job is registered on what it would
    delete, naming the job's pid: clear a cache only when no job uses it."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such cache directory")
    nested = nested_caches(root)
    cache = DiskCache(root, 0, "future")
    for path in [root, *nested]:  # refuse before deleting anything
        busy = [r for r in DiskCache(path, 0, "future").jobs.records() if namespace in (None, r["namespace"])]
        if busy:
            raise CacheInUseError(f"{path}: in use by live job(s) " + ", ".join(
                f"pid {r['pid']} (dataset {r['namespace']})" for r in busy))
    freed = sum(clear(n, namespace) for n in nested)
    cache.recover()
    for entry in os.scandir(cache.root):
        if (entry.is_dir() and not entry.name.startswith(".") and namespace in (None, entry.name)
                and entry.path not in nested):
            freed += _tree_bytes(entry.path)
            shutil.rmtree(entry.path, ignore_errors=True)
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
    for sub in st["nested"]:
        _print_status(sub)


def _cmd_clear(a) -> int:
    freed = clear(a.dir, a.namespace)
    print(f"freed {freed:,} bytes")
    return 0
