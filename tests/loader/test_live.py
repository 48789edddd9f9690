"""The loader's live figures (:mod:`stoker.loader.live`): totals over epochs that never go down."""

from __future__ import annotations

import time
from types import SimpleNamespace

from stoker.loader.epoch_stats import EpochStats
from stoker.loader.live import LiveTotals


class _Run:
    """The part of :class:`stoker.loader.pipeline.run.Run` that LiveTotals reads."""

    def __init__(self):
        self.counters = {}

    def since(self, before, plan):
        return {k: v - before.get(k, 0) for k, v in self.counters.items()}, {}

    def restarts(self):
        return 0, 0


def test_totals_add_up_over_epochs_and_never_drop():
    live, run = LiveTotals(SimpleNamespace(cache=None), SimpleNamespace(batch_size=4), rank=0, world_size=1), _Run()
    assert live.snapshot()["samples"] == 0 and live.snapshot()["epoch"] is None
    s0 = EpochStats(epoch=0)
    live.begin(run, s0, {"origin_bytes": 0}, [0.0], time.perf_counter())
    s0.samples, run.counters = 8, {"origin_bytes": 100, "cache_hits": 6, "cache_misses": 2}
    snap = live.snapshot()
    assert (snap["samples"], snap["origin_bytes"], snap["epoch"]) == (8, 100, 0)
    assert snap["cache_hit_ratio"] == 0.75
    # the epoch ends; 20 of those bytes were the prefetcher's work for the next epoch
    s0.seconds = 1.0
    live.end(s0, {"origin_bytes": 80, "cache_hits": 6, "cache_misses": 2})
    assert live.snapshot()["origin_bytes"] == 100  # not 80 for a moment: a counter never drops
    s1 = EpochStats(epoch=1)
    live.begin(run, s1, {"origin_bytes": 80, "cache_hits": 6, "cache_misses": 2}, [0.0], time.perf_counter())
    s1.samples, run.counters = 4, {"origin_bytes": 130, "cache_hits": 10, "cache_misses": 2}
    snap = live.snapshot()
    assert (snap["samples"], snap["origin_bytes"], snap["cache_hits"], snap["epochs"]) == (12, 130, 10, 1)
