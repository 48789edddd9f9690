"""The future-aware cache policy: which datasets get how much of one node's budget.

Why there is little else to decide: when every sample is read exactly once per
epoch, every hit of an epoch is a block held across the previous epoch boundary, so a cache of
C bytes saves at most C origin bytes per epoch and no policy reads fewer than D - C. A cache
that never evicts a dataset's blocks for the same dataset's other blocks (CoorDL's MinIO,
Mohan et al., VLDB'21) sits on that floor; LRU evicts blocks just before their reuse and thrashes.
The future (NoPFS, Dryden et al., SC'21: the access stream is a pure function of the seed)
settles what the floor leaves open:

- **The split of one budget between datasets.** Every cached byte of dataset d saves one
  origin byte per epoch of every job reading d, i.e. ``rate_d`` bytes/s, where ``rate_d`` is
  the sum of those jobs' epochs per second. Maximising the bytes saved per second is a
  fractional knapsack: give budget to datasets in decreasing ``rate_d``, each up to its size.
  Datasets with equal rates (within 10 %) are equivalent for origin bytes; they share their
  part in proportion to size, so each sees the same hit ratio (and the same stall).
  A dataset with no live job has no future reads: its blocks make room for those that do.
- **When each miss must arrive**: the prefetcher fetches blocks in order of first need
  (:mod:`stoker.loader.prefetch.process`), so misses arrive just ahead of the consumer.

Jobs announce themselves in ``<cache root>/.jobs/<pid>-<namespace>.json`` ({"namespace",
"pid", "dataset_bytes", "epoch_s", and "expires" for a lease}); entries of dead processes and
expired leases are ignored and removed by :meth:`stoker.cache.DiskCache.recover`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from typing import Any

from .._atomic import PRIVATE_FILE_MODE, open_file, write_atomic
from .._procs import pid_alive
from .perms import ensure_dir
from .space import is_full

#: Relative difference under which two datasets' epoch rates count as equal.
RATE_TIE = 0.10


def share_budget(capacity_bytes: int, datasets: dict[str, tuple[int, float | None]]) -> dict[str, int]:
    """Split ``capacity_bytes`` between datasets to minimise origin bytes per second.

    ``datasets``: {namespace: (dataset bytes, epochs per second summed over its jobs, or
    None when no job has finished an epoch yet)}. Unknown rates count as the mean of the
    known ones (1.0 when none is known). Returns {namespace: quota bytes}; quotas sum to at
    most ``capacity_bytes`` and no quota exceeds its dataset's size. Fractional knapsack in
    decreasing rate; ties (within :data:`RATE_TIE`) split in proportion to dataset size.
    """
    known = [r for _, r in datasets.values() if r]
    fill = sum(known) / len(known) if known else 1.0
    items = sorted(((r or fill, ns, max(0, int(d))) for ns, (d, r) in datasets.items()), reverse=True)
    quotas: dict[str, int] = {}
    left = max(0, int(capacity_bytes))
    i = 0
    while i < len(items):
        j = i + 1
        while j < len(items) and items[j][0] >= items[i][0] * (1 - RATE_TIE):
            j += 1
        group = items[i:j]
        want = sum(d for _, _, d in group)
        if want <= left:
            for _, ns, d in group:
                quotas[ns] = d
            left -= want
        else:
            for _, ns, d in group:
                quotas[ns] = d * left // want if want else 0
            left = 0
        i = j
    return quotas


_AT_EXIT: set[tuple[str, str, int]] = set()


def _unregister_at_exit(directory: str, namespace: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the hook
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, f"{pid}-{namespace}.json"))


class JobRegistry:
    """The jobs reading through one node cache: ``<root>/.jobs/<pid>-<namespace>.json``.

    Each process that opens a dataset through the cache registers (namespace = the
    dataset's content version, ``dataset_bytes``) and reports its epoch time after each
    epoch; :meth:`live` gives {namespace: (dataset bytes, epochs per second or None)}
    over processes that are alive. ``mode``: file mode of the records (the cache's,
    :mod:`.perms`); the directory gets the matching directory mode.
    """

    def __init__(self, root: str, mode: int = PRIVATE_FILE_MODE):
        self.dir = os.path.join(root, ".jobs")
        self.mode = mode

    def _path(self, pid: int, namespace: str) -> str:
        return os.path.join(self.dir, f"{pid}-{namespace}.json")

    def register(
        self,
        namespace: str,
        dataset_bytes: int,
        epoch_s: float | None = None,
        pid: int | None = None,
        lease_s: float | None = None,
    ) -> None:
        """Announce (or update) this process's job on ``namespace``; ``epoch_s`` in seconds.
        ``lease_s``: the record counts for that many seconds unless registered again (for a
        long-lived process, e.g. a cluster cache service, that reads for jobs which may end
        without telling it); None: while the process lives.
        On a full disk (ENOSPC, EDQUOT) the record is left as it was (no temporary file stays):
        the job then reads as an unannounced reader, which the cache holds nothing new for.
        FileNotFoundError when the cache directory is gone."""
        ensure_dir(self.dir, self.mode, parents=False)  # never the cache root itself: the cache makes it
        pid = os.getpid() if pid is None else pid
        rec = {
            "namespace": namespace,
            "pid": pid,
            "dataset_bytes": int(dataset_bytes),
            "epoch_s": float(epoch_s) if epoch_s else None,
        }
        if lease_s is not None:
            rec["expires"] = time.time() + float(lease_s)
        try:
            write_atomic(self._path(pid, namespace), json.dumps(rec).encode(), mode=self.mode)
        except OSError as exc:
            if not is_full(exc):
                raise
            return
        if pid == os.getpid() and (self.dir, namespace, pid) not in _AT_EXIT:
            _AT_EXIT.add((self.dir, namespace, pid))
            atexit.register(_unregister_at_exit, self.dir, namespace, pid)

    def unregister(self, namespace: str, pid: int | None = None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(os.getpid() if pid is None else pid, namespace))

    def records(self) -> list[dict[str, Any]]:
        """Records of live processes whose lease, if any, has not expired (the others are
        skipped, not removed)."""
        out: list[dict[str, Any]] = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                rec = _load(os.path.join(self.dir, name))
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and pid_alive(int(rec.get("pid", -1))) and not _expired(rec):
                out.append(rec)
        return out

    def live(self) -> dict[str, tuple[int, float | None]]:
        """{namespace: (dataset bytes, summed epochs per second or None if none known)}."""
        out: dict[str, tuple[int, float | None]] = {}
        for rec in self.records():
            ns = rec["namespace"]
            d, rate = out.get(ns, (0, None))
            r = 1.0 / rec["epoch_s"] if rec.get("epoch_s") else None
            out[ns] = (max(d, int(rec["dataset_bytes"])), (rate or 0.0) + r if r is not None else rate)
        return out

    def remove_dead(self) -> int:
        """Delete records of dead processes and expired leases; returns how many."""
        removed = 0
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        for name in names:
            pid = name.split("-", 1)[0]
            if pid.isdigit() and (not pid_alive(int(pid)) or _expired_file(os.path.join(self.dir, name))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.dir, name))
                    removed += 1
        return removed


def _expired(rec: dict[str, Any]) -> bool:
    """Whether a job record carries a lease (``expires``, Unix seconds) that has run out."""
    t = rec.get("expires")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and t < time.time()


def _load(path: str) -> Any:
    """A job record's JSON, read without following a symlink (ELOOP: an OSError)."""
    fd = open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read())


def _expired_file(path: str) -> bool:
    try:
        rec = _load(path)
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and _expired(rec)
