"""Origin bytes are charged to the epoch whose samples they serve; cold-start figures are reported.

The prefetcher starts on the next epoch's plan while one drains; on a dataset of one or a few
blocks that happens as the cold epoch starts, so a time boundary charged the cold epoch's blocks
to the warm epoch after it."""

import pytest

from stoker.loader import Loader
from stoker.store.dataset import open_dataset


@pytest.fixture(scope="module", params=[15, 60], ids=["1-block", "4-blocks"])
def tiny_packed(request, tmp_path_factory):
    from stoker.store.pack import pack
    from stoker_lab.sample_data import make_sample_data

    root = tmp_path_factory.mktemp(f"tiny{request.param}")
    make_sample_data(str(root), images=request.param, classes=4, seed=0)
    pack(str(root / "train"), str(root / "packed"), shard_bytes=64 << 20, progress=False)
    return str(root / "packed")


def test_warm_epochs_show_no_origin_bytes_and_the_cold_epoch_shows_them_all(tiny_packed, tmp_path):
    ds = open_dataset(tiny_packed, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=1 << 20)
    data_bytes = int(ds.index.total_bytes)  # the samples themselves; blocks may add tar headers
    with Loader(ds, 16, num_workers=2, seed=1) as loader:
        for _ in range(3):
            for _ in loader:
                pass
    cold, *warm = loader.history
    assert cold.origin_bytes >= data_bytes, [s.origin_bytes for s in loader.history]
    assert cold.origin_requests >= 1
    for st in warm:
        assert st.origin_bytes == 0 and st.origin_requests == 0 and st.prefetch_fills == 0, st
        assert st.cache_hit_ratio == 1.0 and st.exactly_once
    assert cold.pipeline_start_s > 0 and all(st.pipeline_start_s == 0 for st in warm)
    for st in loader.history:
        assert st.first_batch_s > 0
        assert 0.0 <= st.origin_busy_fraction <= 1.0
        assert st.overlap_efficiency >= 0.0
    assert cold.inflight_target >= loader.read.fetch_concurrency


def _slow_decode(fields, rng):
    """A user decode that burns CPU (a few milliseconds per sample), so its share of the workers' CPU shows."""
    import numpy as np

    x = np.frombuffer(fields["jpg"] if "jpg" in fields else next(iter(fields.values())), np.uint8)
    acc = 0
    for _ in range(5):
        acc += int(np.sort(np.concatenate([x] * 4)).sum())
    return np.array([acc])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("user", [False, True], ids=["built-in", "user-decode"])
def test_decode_cpu_is_the_cpu_inside_the_decode(tiny_packed, tmp_path, workers, user):
    """``decode_cpu_s``: CPU inside the decode, counted in the processes that decode, never more than
    they used; a decode that costs milliseconds is most of the workers' CPU; a loader without
    decode counts none."""
    ds = open_dataset(tiny_packed, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30)
    kw = {"decode": _slow_decode} if user else {}
    with Loader(ds, 8, num_workers=workers, seed=1, **kw) as loader:
        for _ in range(2):
            for _ in loader:
                pass
    assert all(st.decode_cpu_s > 0 for st in loader.history), loader.history
    # summed over the epochs: a decode done early for the next epoch counts in the next epoch's
    # counters but in this epoch's process CPU, so one epoch's two figures may differ either way
    decoded = sum(st.decode_cpu_s for st in loader.history)
    spents = [st.cpu_s.get("workers" if workers else "main") for st in loader.history]
    if None not in spents:  # Linux: the decode's CPU is part of what its processes used
        spent = sum(spents)
        assert decoded <= spent + 0.05, (decoded, spents)
        if user and spent >= 0.1:  # ms per sample of decode, enough 10 ms clock ticks: most of the CPU
            assert decoded >= 0.5 * spent, (decoded, spents)
    from stoker.collate import raw_bytes

    with Loader(ds, 8, num_workers=workers, seed=1, collate=raw_bytes) as raw:
        for _ in raw:
            pass
    assert raw.history[0].decode_cpu_s == 0
