"""`stoker cache status DIR` and `stoker cache clear DIR`: a node cache on the command line."""
from __future__ import annotations

import json
import os
import shutil

from .disk import DiskCache
from .policy import share_budget


def status(root: str, budget_bytes: int | None = None) -> dict:
    """What a node cache holds: {"root", "used_bytes", "namespaces": {ns: bytes},
    "jobs": [records of live jobs], "quotas": {ns: bytes} (the ``future`` policy's split of
    ``budget_bytes``; empty without a budget), "removed_tmp"}. Recovers first (removes fills
    of dead processes, recounts usage). FileNotFoundError if ``root`` is not a directory."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such cache directory")
    cache = DiskCache(root, budget_bytes or 0, "future")
    rec = cache.recover()
    live = cache.jobs.live()
    return {"root": cache.root, "used_bytes": rec["used"], "removed_tmp": rec["removed_tmp"],
            "namespaces": cache.namespace_usage(), "jobs": cache.jobs.records(),
            "quotas": share_budget(budget_bytes, live) if budget_bytes else {}}


class CacheInUseError(RuntimeError):
    """A cache (or one dataset in it) is in use by a live job; the message names its pid."""


def clear(root: str, namespace: str | None = None) -> int:
    """Delete the cached blocks of ``namespace`` (every namespace if None) and return the
    bytes freed. Refuses (:class:`CacheInUseError`) while a live job is registered on what it would
    delete, naming the job's pid: clear a cache only when no job uses it."""
    cache = DiskCache(root, 0, "future")
    busy = [r for r in cache.jobs.records() if namespace is None or r["namespace"] == namespace]
    if busy:
        raise CacheInUseError(f"{root}: in use by live job(s) " + ", ".join(
            f"pid {r['pid']} (dataset {r['namespace']})" for r in busy))
    before = cache.recover()["used"]
    for entry in os.scandir(cache.root):
        if entry.is_dir() and not entry.name.startswith(".") and namespace in (None, entry.name):
            shutil.rmtree(entry.path, ignore_errors=True)
    return before - cache.recover()["used"]


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
    print(f"{st['root']}: {st['used_bytes']:,} bytes in use")
    for ns, used in sorted(st["namespaces"].items()):
        q = st["quotas"].get(ns)
        print(f"  dataset {ns}: {used:,} bytes" + (f" (share {q:,})" if q is not None else ""))
    for r in st["jobs"]:
        rate = f"epoch {r['epoch_s']:.1f} s" if r.get("epoch_s") else "no epoch yet"
        print(f"  job pid {r['pid']}: dataset {r['namespace']} ({r['dataset_bytes']:,} bytes), {rate}")
    return 0


def _cmd_clear(a) -> int:
    freed = clear(a.dir, a.namespace)
    print(f"freed {freed:,} bytes")
    return 0
