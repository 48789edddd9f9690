"""Live figures of a running loader, for the metrics exporter (:mod:`stoker.metrics`) and for
``stoker top`` (:mod:`stoker.cli.top`).

:class:`LiveTotals` keeps counters summed over every epoch the loader served, and reads the
epoch in progress from the started pipeline: the batches yielded so far and the counters of
its processes. The counters of the decode workers and the prefetch process are the ones the
pipeline already sums (each worker's cumulative counters come back with every reply; the
prefetcher's live in a shared array): no counter is kept per process here, so nothing is
counted twice when a process is replaced.

Every second at most, while batches are delivered, the figures are written to
``<cache root>/.jobs/<pid>-<dataset version>.<n>.live`` (JSON, replaced atomically) beside the
job records of :class:`stoker.cache.policy.JobRegistry`, which ``stoker cache status`` and
``stoker top`` read; the file goes when the loader closes, and the registry deletes those of
dead processes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from typing import Any

from .._atomic import PRIVATE_FILE_MODE, write_atomic
from ..cache.layout import is_cache
from ..cache.perms import ensure_dir
from ..storage import absolute_url

log = logging.getLogger(__name__)

#: Counters of the pipeline's processes that are summed (keys of ``Run.totals()``).
COUNTER_KEYS = (
    "origin_bytes",
    "origin_requests",
    "origin_retries",
    "origin_errors",
    "cache_hits",
    "cache_memory_hits",
    "cache_misses",
    "read_staged_hits",
    "read_direct_reads",
    "prefetch_fills",
)
#: Fields of :class:`stoker.loader.epoch_stats.EpochStats` that are summed over epochs.
STAT_KEYS = ("samples", "batches", "skipped", "padded", "wait_s", "seconds", "worker_restarts", "prefetcher_restarts")
PUBLISH_EVERY_S = 1.0
_SEQ = itertools.count()


def live_path(cache_root: str, namespace: str, pid: int, seq: int) -> str:
    """The live-figures file of loader ``seq`` of process ``pid`` on dataset ``namespace``."""
    return os.path.join(cache_root, ".jobs", f"{pid}-{namespace}.{seq}.live")


class LiveTotals:
    """Counters of one loader over its life, readable from any thread.

    :meth:`begin` and :meth:`end` are called by the pipeline around each epoch, :meth:`tick`
    after each delivered batch; :meth:`snapshot` gives the figures (see there). It holds what it
    reports, not the loader (the metrics server's thread holds it: a loader dropped without
    ``close()`` must still be collected).

    Args:
        dataset: the loader's dataset (its cache, version and URL).
        cfg: the loader's :class:`~stoker.loader.options.WorkerConfig` (its ``batch_size``), or None.
        rank, world_size: the loader's; with ``cfg``, for the live-figures file.
    """

    def __init__(self, dataset, cfg=None, rank: int = 0, world_size: int = 1):
        self.dataset, self.cfg, self.rank, self.world_size = dataset, cfg, rank, world_size
        self._last: Any = None  # the stats of the last epoch ended
        self._lock = threading.Lock()
        self._base: dict[str, float] = dict.fromkeys(COUNTER_KEYS + STAT_KEYS, 0)
        self._high: dict[str, float] = dict.fromkeys(COUNTER_KEYS + STAT_KEYS, 0)  # totals never go down
        self._epochs = 0
        self._cur: tuple | None = None  # (run, stats, before, wait_box, t_start, plan) of the epoch in progress
        self._seq = next(_SEQ)
        self._next_publish = 0.0
        self._published: str | None = None
        self._publish_failed = False

    # -- the pipeline's calls ---------------------------------------------
    def begin(self, run, stats, before: dict, wait_box: list, t_start: float, plan: int | None = None) -> None:
        """An epoch starts: ``before`` the process counters at its start, ``wait_box[0]`` its
        seconds blocked in ``next()`` so far, ``t_start`` its ``time.perf_counter()`` start,
        ``plan`` the run id of its plan (the prefetcher's origin traffic for it is read from
        that plan's ledger row while the epoch runs, as the pipeline does when it ends)."""
        with self._lock:
            self._cur = (run, stats, dict(before), wait_box, t_start, plan)

    def end(self, stats, delta: dict) -> None:
        """The epoch of ``stats`` ended (finished or cut short); ``delta``: its change of the
        process counters."""
        with self._lock:
            for k in COUNTER_KEYS:
                self._base[k] += delta.get(k, 0)
            for k in STAT_KEYS:
                self._base[k] += getattr(stats, k, 0) or 0
            self._epochs += 1
            self._cur = None
            self._last = stats
        self.publish(force=True)

    def tick(self) -> None:
        """A batch was delivered: publish the figures if a second has passed since the last time."""
        if time.monotonic() >= self._next_publish:
            self.publish()

    # -- reading ------------------------------------------------------------
    def snapshot(self) -> dict:
        """The loader's figures now.

        Totals over its life (the epoch in progress included): the :data:`COUNTER_KEYS`
        (``origin_bytes`` in bytes, the rest counts) and :data:`STAT_KEYS` (``wait_s`` and
        ``seconds`` in seconds), ``epochs`` (ended). The epoch in progress (the last one ended
        when none runs), with :class:`~stoker.loader.epoch_stats.EpochStats`' definitions:
        ``epoch``, ``epoch_samples``, ``epoch_seconds``, ``samples_per_s``, ``stall_fraction``,
        ``origin_bytes_per_s``, ``cache_hit_ratio``, ``prefetch_depth_bytes`` (mean bytes
        fetched and ready ahead of the consumer), ``first_batch_s`` (None until known).
        """
        with self._lock:
            out: dict = dict(self._base)
            out["epochs"] = self._epochs
            cur = self._cur
            if cur is None:
                out.update(_epoch_figures(self._last, None))
                return self._monotonic(out)
            run, stats, before, wait_box, t_start, plan = cur
            delta = run.since(before, plan)[0]  # with the prefetcher's work for this plan so far
            seconds = time.perf_counter() - t_start
            for k in COUNTER_KEYS:
                out[k] += delta.get(k, 0)
            for k in ("samples", "batches", "skipped", "padded"):
                out[k] += getattr(stats, k, 0)
            out["wait_s"] += wait_box[0]
            out["seconds"] += seconds
            worker_restarts, prefetcher_restarts = run.restarts()
            out["worker_restarts"] += worker_restarts
            out["prefetcher_restarts"] += prefetcher_restarts
            n_depth = delta.get("prefetch_depth_n", 0)
            depth = delta.get("prefetch_depth_sum", 0) / n_depth if n_depth else 0.0
            out.update(_epoch_figures(stats, (delta, wait_box[0], seconds, depth)))
            return self._monotonic(out)

    def _monotonic(self, out: dict) -> dict:
        """Totals never below an earlier reading: the prefetcher's work for the next epoch counts
        in the running epoch's reading until the epoch ends and in the next one's after, so a
        reading between the two could be lower for a moment (a Prometheus counter must not drop)."""
        for k in self._high:
            self._high[k] = out[k] = max(out[k], self._high[k])
        return out

    # -- the file stoker top reads ------------------------------------------
    def publish(self, force: bool = False) -> None:
        """Write :meth:`snapshot` (with ``pid``, ``dataset``, ``time``, the cache's budgets) to
        the live-figures file of this loader, at most once a second unless ``force``. A loader
        without a node cache, or with a read-only one, writes nothing; a write that fails is
        logged once and never stops the loader (a cache directory removed under the job is
        tried again at the next publish: the cache makes it again)."""
        self._next_publish = time.monotonic() + PUBLISH_EVERY_S
        ds = self.dataset
        cache = getattr(ds, "cache", None)
        root = getattr(cache, "root", None)
        if root is None or self._publish_failed or getattr(cache, "read_only", False):
            return
        if not is_cache(root):  # removed (or being removed): the cache makes it again, then we publish
            return
        path = live_path(root, ds.version, os.getpid(), self._seq)
        rec = self.snapshot()
        rec.update(
            pid=os.getpid(),
            dataset=ds.version,
            url=absolute_url(ds.url) if getattr(ds, "url", None) else None,
            time=time.time(),
            cache_capacity_bytes=getattr(getattr(cache, "disk", cache), "capacity_bytes", None),
            memory_capacity_bytes=getattr(getattr(cache, "memory", None), "capacity_bytes", None),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.cfg.batch_size if self.cfg is not None else 0,
        )
        if not force and rec["samples"] == 0 and self._published is None:
            return
        mode = getattr(getattr(cache, "disk", cache), "mode", PRIVATE_FILE_MODE)  # the cache's file mode
        try:
            ensure_dir(os.path.dirname(path), mode, parents=False)
            write_atomic(path, json.dumps(rec).encode(), mode=mode)
            self._published = path
        except FileNotFoundError:  # the cache directory is gone for now
            return
        except OSError as exc:
            self._publish_failed = True
            log.warning(
                "could not write the loader's live figures to %s (stoker top will not show this job): %s", path, exc
            )

    def unpublish(self) -> None:
        """Remove the live-figures file (the loader closes)."""
        path, self._published = self._published, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _epoch_figures(stats, live) -> dict:
    """The epoch figures of :meth:`LiveTotals.snapshot` from a finished ``stats`` (``live``
    None) or a running one (``live`` = (counter delta, wait seconds, seconds, mean depth bytes))."""
    if stats is None:
        return {
            "epoch": None,
            "epoch_samples": 0,
            "epoch_seconds": 0.0,
            "samples_per_s": 0.0,
            "stall_fraction": 0.0,
            "origin_bytes_per_s": 0.0,
            "cache_hit_ratio": 0.0,
            "prefetch_depth_bytes": 0.0,
            "first_batch_s": None,
        }
    if live is None:
        origin, hits, misses = stats.origin_bytes, stats.cache_hits, stats.cache_misses
        wait_s, seconds, depth = stats.wait_s, stats.seconds, stats.prefetch_depth_bytes
    else:
        d, wait_s, seconds, depth = live
        origin, hits, misses = d.get("origin_bytes", 0), d.get("cache_hits", 0), d.get("cache_misses", 0)
    return {
        "epoch": stats.epoch,
        "epoch_samples": stats.samples,
        "epoch_seconds": seconds,
        "samples_per_s": stats.samples / seconds if seconds else 0.0,
        "stall_fraction": wait_s / seconds if seconds else 0.0,
        "origin_bytes_per_s": origin / seconds if seconds else 0.0,
        "cache_hit_ratio": hits / (hits + misses) if hits + misses else 0.0,
        "prefetch_depth_bytes": float(depth),
        "first_batch_s": getattr(stats, "first_batch_s", None),
    }
