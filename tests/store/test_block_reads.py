"""A block read from the origin is kept where the next reader finds it (stoker.store.dataset): a fill
that the cache refuses after fetching stays in staging, a worker that needs a block nobody fetched
yet brings the whole block into staging, and a reader that waited for another fill of its block
takes that fill's result. Each case once fetched the same block a second time."""

from __future__ import annotations

import threading

import numpy as np

from stoker.cache.staging import StagingArea
from stoker.loader.prefetch.fills import fill_status as _fill
from stoker.store.blocks import BlockReader
from stoker.store.dataset import open_dataset
from stoker.store.runs import fill_run

BLOCK = 256 << 10


def _open(url, tmp_path, name, cache_bytes):
    """The dataset with its origin counters at zero (opening it read the index)."""
    ds = open_dataset(url, cache_dir=str(tmp_path / name), cache_bytes=cache_bytes, block_bytes=BLOCK)
    ds.origin.counters.requests = ds.origin.counters.bytes = 0
    return ds


def _two_samples_of_one_block(ds) -> tuple[int, int, int]:
    """(block, sample, another sample of that block)."""
    for b in range(len(ds.blocks)):
        ids = np.flatnonzero(ds.blocks.sample_block == b)
        if len(ids) >= 2:
            return b, int(ids[0]), int(ids[1])
    raise AssertionError("no block holds two samples")


def test_a_fill_the_cache_refuses_after_fetching_stays_in_staging(packed_local, tmp_path, monkeypatch):
    # The admission check passed, then another fill took the room: the fetched bytes must be
    # staged, and the prefetcher's next look must find them there instead of fetching again.
    ds = _open(packed_local, tmp_path, "c", 64 << 20)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    monkeypatch.setattr(ds.cache, "put", lambda *a, **k: False)
    size = int(ds.blocks.end[0] - ds.blocks.start[0])
    assert ds.reader.fill_block(0, blocking=False, want_data=False) == "staged"
    assert ds.reader.staging.contains(ds.version, ds.blocks.name(0))
    assert (ds.origin.counters.requests, ds.origin.counters.bytes) == (1, size)
    assert ds.reader.stage_block(0) == "in_staging"
    assert _fill(ds, 0) == "in_staging"  # the prefetcher's path: admitted, refused, staged already
    assert (ds.origin.counters.requests, ds.origin.counters.bytes) == (1, size)


def test_a_read_of_a_block_nobody_fetched_stages_the_whole_block_once(packed_local, tmp_path):
    # The cache admits nothing; the prefetcher has not reached the block. The first sample's read
    # fetches the whole block into staging; its neighbour is then read from there.
    ds = _open(packed_local, tmp_path, "c", 1)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"), capacity_bytes=64 << 20)))
    b, i, j = _two_samples_of_one_block(ds)
    size = int(ds.blocks.end[b] - ds.blocks.start[b])
    first, second = ds.read(i), ds.read(j)
    assert (ds.origin.counters.requests, ds.origin.counters.bytes) == (1, size)
    assert ds.reader.staging.contains(ds.version, ds.blocks.name(b))
    assert (ds.read_stats.staged_hits, ds.read_stats.direct_reads) == (1, 0)
    fresh = open_dataset(packed_local, cache=False)
    assert (first, second) == (fresh.read(i), fresh.read(j))


def test_a_full_staging_area_leaves_the_sample_to_a_read_of_its_own(packed_local, tmp_path):
    # staging_bytes is a bound for the workers too: with no room, only the sample is read.
    ds = _open(packed_local, tmp_path, "c", 1)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"), capacity_bytes=1)))
    b, i, _ = _two_samples_of_one_block(ds)
    ds.read(i)
    assert (ds.origin.counters.requests, ds.origin.counters.bytes) == (1, int(ds.index.length[i]))
    assert ds.read_stats.direct_reads == 1
    assert ds.reader.staging.names(ds.version) == []


def test_a_reader_that_waited_for_another_fill_takes_its_staged_block(packed_local, tmp_path):
    # Another process (here a thread of its own dataset copy) holds the block's fetch lock and
    # stages the block; the reader waiting on that lock must read the staged copy, not fetch it.
    ds = _open(packed_local, tmp_path, "c", 64 << 20)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    other = _open(packed_local, tmp_path, "c", 64 << 20)
    b, i, _ = _two_samples_of_one_block(ds)
    name = ds.blocks.name(b)
    got = {}
    with ds.cache.fetch_lock(ds.version, name, blocking=True):
        reader = threading.Thread(target=lambda: got.setdefault("data", ds.read(i)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive()  # waiting for the lock held here
        ds.reader.staging.put(ds.version, name, other.reader.fetch_block(b))
    reader.join(10)
    assert got["data"] == open_dataset(packed_local, cache=False).read(i)
    assert ds.origin.counters.requests == 0
    assert ds.read_stats.staged_hits == 1


def _two_loaders(url, tmp_path):
    """Two readers of one dataset over one node cache that admits nothing, each with its own
    staging area under the cache's ``.staging`` (two Loaders on one node: a job's two ranks)."""
    out = []
    for _ in range(2):
        ds = _open(url, tmp_path, "c", 1)
        out.append(ds.with_reader(BlockReader(ds, staging=StagingArea.create(ds.cache.root, capacity_bytes=64 << 20))))
    return out


def test_a_block_another_loader_staged_is_linked_not_fetched(packed_local, tmp_path):
    # Rank 0 stages the block; rank 1's prefetcher, its merged fills and its workers' reads all
    # take rank 0's copy by a hard link: no origin request. Each used to fetch it once more.
    first, second = _two_loaders(packed_local, tmp_path)
    blk, i, j = _two_samples_of_one_block(first)
    name = first.blocks.name(blk)
    assert first.reader.stage_block(blk) == "staged"
    assert second.reader.stage_block(blk) == "in_staging"
    assert second.origin.counters.requests == 0
    second.reader.staging.remove(second.version, name)
    assert fill_run(second, [blk]) == {blk: "in_staging"}  # the merged-GET path
    second.reader.staging.remove(second.version, name)
    assert second.read(i) == open_dataset(packed_local, cache=False).read(i)  # a worker's read
    assert (second.origin.counters.requests, second.read_stats.direct_reads) == (0, 0)
    first.reader.staging.remove(first.version, name)  # rank 0 is past its last use: rank 1's copy stays
    assert second.reader.staging.contains(second.version, name)
    assert second.read(j) == open_dataset(packed_local, cache=False).read(j)
    assert second.origin.counters.requests == 0


def test_a_block_no_other_loader_holds_is_fetched(packed_local, tmp_path):
    first, second = _two_loaders(packed_local, tmp_path)
    assert second.reader.stage_block(0) == "staged"  # nothing staged elsewhere
    assert second.origin.counters.requests == 1
    first.reader.stage_block(1)
    first.reader.staging.remove(first.version, first.blocks.name(1))  # rank 0 deleted it before rank 1 came
    assert second.reader.stage_block(1) == "staged"
    assert second.origin.counters.requests == 2
