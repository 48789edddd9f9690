"""The pipeline's start waits for its processes' own start (object store client, decoder): the
first epoch's clock starts with a prefetcher that fetches at once."""

from __future__ import annotations

from stoker.loader import Loader
from stoker.store.dataset import open_dataset


def test_start_waits_for_the_workers_and_the_prefetcher(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), block_bytes=64 << 10)
    with Loader(ds, 16, num_workers=2, transform="eval", seed=1) as loader:
        it = iter(loader)
        assert loader.processes.ready == 3  # both workers and the prefetcher set up before the epoch starts
        assert sum(len(labels) for _, labels in it) == len(ds)
        assert loader.stats.exactly_once and loader.stats.pipeline_start_s > 0


def test_a_process_dead_at_start_does_not_hold_the_start(packed_local, tmp_path, monkeypatch):
    import stoker.loader.prefetch.prefetcher as prefetcher

    def dies(*args, **kwargs):
        raise SystemExit(3)  # a prefetcher that dies before it is ready

    monkeypatch.setattr(prefetcher, "prefetch_main", dies)
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), block_bytes=64 << 10)
    with Loader(ds, 16, num_workers=1, transform="eval", seed=1) as loader:
        it = iter(loader)  # returns (no 30 s wait): the dead prefetcher is the epoch loop's to handle
        assert sum(len(labels) for _, labels in it) == len(ds)
        assert loader.stats.pipeline_start_s < 25
