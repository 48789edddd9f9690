"""What a node cache remembers for ``stoker cache status`` besides its blocks: which dataset
URL each namespace (a dataset content version) was opened from, and the budget in force.

Layout under the cache root (bookkeeping, hidden, written by the cache itself; :mod:`.layout`)::

    .datasets/<namespace>.json   {"url": dataset URL (a local path made absolute), "version":
                                  namespace, "seen": unix time}
    .budget                      {"capacity_bytes": budget of the last job that opened the cache,
                                  "pid": that job's pid, "seen": unix time}

Both are informational: written whole (temporary file, rename), best effort (a full disk or a
read-only cache loses only the label), and never used to decide what to cache or evict.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from ..storage import absolute_url
from .files import write_whole
from .perms import PRIVATE_FILE_MODE, ensure_dir

__all__ = ["record_dataset", "dataset_urls", "record_budget", "recorded_budget"]

DATASETS_DIR = ".datasets"
BUDGET_FILE = ".budget"
MEMORY_FILE = ".memory-tier"


def _write_json(path: str, value: dict, mode: int) -> None:
    with contextlib.suppress(OSError):  # only a label is lost
        ensure_dir(os.path.dirname(path), mode, parents=False)
        write_whole(path, json.dumps(value).encode(), mode=mode)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def record_dataset(root: str, namespace: str, url: str, mode: int = PRIVATE_FILE_MODE) -> None:
    """Remember that namespace ``namespace`` of the cache at ``root`` holds the dataset at ``url``
    (written with the cache's file ``mode``). The cache is shared by every process of the node,
    each with its own working directory: a relative local path is stored absolute
    (:func:`stoker.storage.absolute_url`)."""
    _write_json(
        os.path.join(root, DATASETS_DIR, f"{namespace}.json"),
        {"url": absolute_url(url), "version": namespace, "seen": time.time()},
        mode,
    )


def dataset_urls(root: str) -> dict[str, str]:
    """{namespace: dataset URL} for the namespaces whose URL the cache at ``root`` recorded."""
    try:
        names = os.listdir(os.path.join(root, DATASETS_DIR))
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.endswith(".json"):
            rec = _read_json(os.path.join(root, DATASETS_DIR, name))
            if rec and isinstance(rec.get("url"), str):
                out[name[:-5]] = rec["url"]
    return out


def record_budget(root: str, capacity_bytes: int, mode: int = PRIVATE_FILE_MODE) -> None:
    """Remember ``capacity_bytes`` (bytes) as the budget in force at ``root`` (the last job's)."""
    path = os.path.join(root, BUDGET_FILE)
    rec = _read_json(path)
    if rec and rec.get("capacity_bytes") == capacity_bytes and rec.get("pid") == os.getpid():
        return
    _write_json(path, {"capacity_bytes": int(capacity_bytes), "pid": os.getpid(), "seen": time.time()}, mode)


def recorded_budget(root: str) -> int | None:
    """The budget (bytes) of the last job that opened the cache at ``root``, or None if unknown."""
    rec = _read_json(os.path.join(root, BUDGET_FILE))
    value = rec.get("capacity_bytes") if rec else None
    return int(value) if isinstance(value, int) and value > 0 else None


def record_memory_root(root: str, memory_root: str, mode: int = PRIVATE_FILE_MODE) -> None:
    """Remember that the cache at ``root`` has its memory tier at ``memory_root`` (a
    ``memory_dir=`` of the user's, or the default under /dev/shm), for status and clear."""
    path = os.path.join(root, MEMORY_FILE)
    memory_root = os.path.abspath(memory_root)
    rec = _read_json(path)
    if rec and rec.get("path") == memory_root:
        return
    _write_json(path, {"path": memory_root}, mode)


def recorded_memory_root(root: str) -> str | None:
    """The memory tier recorded for the cache at ``root`` (:func:`record_memory_root`), or None."""
    rec = _read_json(os.path.join(root, MEMORY_FILE))
    value = rec.get("path") if rec else None
    return value if isinstance(value, str) and value else None
