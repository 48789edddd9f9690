"""Merged GETs (stoker.store.runs): a run of adjacent blocks read with one ranged GET leaves the
same verified bytes and cache state as block-by-block fills, for fewer requests; a failed merged
GET falls back to one GET per block without losing or duplicating a block."""

from __future__ import annotations

import threading

import pytest

from stoker.cache.staging import StagingArea
from stoker.errors import ChecksumError, OriginError
from stoker.store.blocks import BlockReader
from stoker.store.dataset import open_dataset
from stoker.store.runs import MAX_MERGE_BYTES, adjacent_run, fill_run, merge_cap_bytes

BLOCK = 64 << 10


def _open(url, tmp_path, name, **kw):
    """The dataset with its origin counters at zero (opening it read the index)."""
    kw.setdefault("cache_bytes", 1 << 30)
    ds = open_dataset(url, cache_dir=str(tmp_path / name), block_bytes=BLOCK, **kw)
    ds.origin.counters.requests = ds.origin.counters.bytes = 0
    return ds


def _run_of(ds, n: int) -> list[int]:
    """The first ``n`` consecutive blocks of shard 0."""
    blocks = [b for b in range(len(ds.blocks)) if int(ds.blocks.shard[b]) == 0][:n]
    assert len(blocks) == n and blocks == list(range(blocks[0], blocks[0] + n))
    return blocks


def _cached(ds, b):
    size = int(ds.blocks.end[b] - ds.blocks.start[b])
    return ds.cache.read(ds.version, ds.blocks.name(b), 0, size)


def test_merged_run_matches_block_by_block(packed_local, tmp_path):
    merged, single = _open(packed_local, tmp_path, "m"), _open(packed_local, tmp_path, "s")
    run = _run_of(merged, 5)
    assert fill_run(merged, run) == {b: "filled" for b in run}
    for b in run:
        assert single.reader.fill_block(b, blocking=True, want_data=False) == "filled"
    for b in run:
        assert bytes(_cached(merged, b)) == bytes(_cached(single, b))
    assert merged.origin.counters.requests == 1
    assert single.origin.counters.requests == len(run)
    assert merged.origin.counters.bytes == int(merged.blocks.end[run[-1]] - merged.blocks.start[run[0]])
    for i in range(len(merged)):  # every sample of the run reads back verified from the cache
        if int(merged.blocks.sample_block[i]) in run:
            assert merged.read(i) == single.read(i)
    assert merged.origin.counters.requests == 1  # (all of them cache hits)
    # filled again: nothing fetched, every block reported as cached
    assert fill_run(merged, run) == {b: "cached" for b in run}
    assert merged.origin.counters.requests == 1


def test_failed_merged_get_falls_back_block_by_block(packed_local, tmp_path, monkeypatch):
    ds = _open(packed_local, tmp_path, "c")
    run = _run_of(ds, 4)
    real, calls = ds.origin.read_range, []

    def flaky(rel, start, end):
        calls.append((start, end))
        if end - start > int(ds.blocks.end[run[0]] - ds.blocks.start[run[0]]) and len(calls) == 1:
            raise OriginError(ds.origin.full_url(rel), "connection reset (injected)", start, end)
        return real(rel, start, end)

    monkeypatch.setattr(ds.origin, "read_range", flaky)
    assert fill_run(ds, run) == {b: "filled" for b in run}
    per_block = [(int(ds.blocks.start[b]), int(ds.blocks.end[b])) for b in run]
    assert calls[1:] == per_block  # each block exactly once after the failed merged GET
    assert all(_cached(ds, b) is not None for b in run)


def test_corrupt_block_in_a_merged_get_fails_alone(packed_local, tmp_path, monkeypatch):
    ds = _open(packed_local, tmp_path, "c")
    run = _run_of(ds, 4)
    bad = run[2]
    real = ds.origin.read_range

    def corrupt(rel, start, end):  # the origin holds wrong bytes in block ``bad``
        data = bytearray(real(rel, start, end))
        at = int(ds.blocks.start[bad]) + 600  # inside its first sample's payload (past the tar header)
        if start <= at < end:
            data[at - start] ^= 0xFF
        return bytes(data)

    monkeypatch.setattr(ds.origin, "read_range", corrupt)
    status = fill_run(ds, run)
    assert isinstance(status[bad], ChecksumError)
    assert ds.key(int(ds.blocks.samples(bad)[0])) in str(status[bad])  # names the sample
    assert {b: s for b, s in status.items() if b != bad} == {b: "filled" for b in run if b != bad}
    assert _cached(ds, bad) is None and all(_cached(ds, b) is not None for b in run if b != bad)


def test_block_locked_elsewhere_splits_the_run(packed_local, tmp_path):
    ds = _open(packed_local, tmp_path, "c")
    run = _run_of(ds, 5)
    held, release = threading.Event(), threading.Event()

    def hold():  # another process is filling the middle block
        with ds.cache.fetch_lock(ds.version, ds.blocks.name(run[2]), blocking=True):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(5)
        status = fill_run(ds, run)
    finally:
        release.set()
        t.join()
    assert status[run[2]] == "busy"
    # (another block may share the held lock's stripe: it is busy too, never lost)
    assert all(status[b] in ("filled", "busy") for b in run)
    assert ds.origin.counters.requests <= 2  # the stretches before and after the held block
    assert _cached(ds, run[2]) is None


def test_blocks_the_cache_refuses_are_staged(packed_local, tmp_path):
    ds = _open(packed_local, tmp_path, "c", cache_bytes=1)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    run = _run_of(ds, 3)
    assert fill_run(ds, run) == {b: "staged" for b in run}
    assert ds.origin.counters.requests == 1
    for b in run:
        assert ds.reader.staging.contains(ds.version, ds.blocks.name(b))
    ds2 = _open(packed_local, tmp_path, "d", cache_bytes=1)  # its reader has no staging area:
    assert fill_run(ds2, run) == {b: "refused" for b in run}  # refused, and nothing is read
    assert ds2.origin.counters.requests == 0


def test_merge_cap_is_the_bandwidth_delay_product():
    assert merge_cap_bytes(float("inf"), 0.0, BLOCK) == BLOCK  # nothing measured yet: no merging
    assert merge_cap_bytes(0.02, 100e6, 1 << 20) == 2_000_000  # near: 20 ms x 100 MB/s
    assert merge_cap_bytes(0.1, 1e9, 1 << 20) == MAX_MERGE_BYTES  # far: 100 MB, capped
    assert merge_cap_bytes(0.001, 1e6, 1 << 20) == 1 << 20  # never below one block


def test_adjacent_run_stays_in_its_shard_and_cap(packed_local, tmp_path):
    ds = _open(packed_local, tmp_path, "c")
    shard0 = [b for b in range(len(ds.blocks)) if int(ds.blocks.shard[b]) == 0]
    last = shard0[-1]
    everything = set(range(len(ds.blocks)))
    run = adjacent_run(ds, last, everything.__contains__, 1 << 40)
    assert run == shard0  # downward to the shard's first block, never into shard 1
    b = shard0[3]
    assert adjacent_run(ds, b, set().__contains__, 1 << 40) == [b]
    assert adjacent_run(ds, b, {b + 1, b + 3}.__contains__, 1 << 40) == [b, b + 1]  # stops at the first gap
    two = int(ds.blocks.end[b + 1] - ds.blocks.start[b])
    assert adjacent_run(ds, b, everything.__contains__, two) == [b, b + 1]  # the cap holds (upward first)


def test_fill_run_needs_a_cache(packed_local):
    ds = open_dataset(packed_local, cache=False)
    with pytest.raises(ValueError, match="without"):
        fill_run(ds, [0, 1])
