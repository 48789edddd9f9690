"""The block prefetcher (stoker.loader.prefetch.process) on its own: a block whose fetch lock is held for a
while is staged once the lock is free, not given up."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np

from stoker.cache.staging import StagingArea
from stoker.loader.options import ReadOptions
from stoker.loader.prefetch.process import PrefetchShared, block_schedule, prefetch_main
from stoker.store.blocks import BlockReader
from stoker.store.dataset import open_dataset


def test_block_with_a_held_fetch_lock_is_staged_after_release(packed_local, tmp_path):
    # A cache too small to admit anything: every block the plan needs must be staged.
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1, block_bytes=64 << 10)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    plan = np.arange(len(ds))
    blocks, first, last = block_schedule(ds, plan)
    b0 = int(blocks[0])
    ctx = mp.get_context("fork")
    cmds = ctx.Queue()
    shared = PrefetchShared.create(ctx)
    pos, counters = shared.position, shared.counters
    pos.value = len(plan)  # the whole plan is dispatched: prefetch all of it
    held, release = threading.Event(), threading.Event()

    def hold():  # another process's fill of a block on b0's lock stripe, for 0.4 s
        with ds.cache.fetch_lock(ds.version, ds.blocks.name(b0), blocking=True):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    proc = ctx.Process(
        target=prefetch_main,
        args=(ds, cmds, shared, ReadOptions(fetch_concurrency=4, prefetch_bytes=1 << 30, staging_bytes=1 << 30)),
        daemon=True,
    )
    proc.start()
    try:
        cmds.put((1, blocks, first, last))
        deadline = time.monotonic() + 30
        while counters[5] < len(blocks) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counters[5] == len(blocks) - 1  # all but b0 staged while its lock is held
        assert not ds.reader.staging.contains(ds.version, ds.blocks.name(b0))
        time.sleep(0.4)  # the prefetcher keeps coming back to b0 meanwhile
        release.set()
        t.join()
        deadline = time.monotonic() + 10
        while counters[5] < len(blocks) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ds.reader.staging.contains(ds.version, ds.blocks.name(b0))
        assert counters[5] == len(blocks) and counters[4] == 0
    finally:
        release.set()
        cmds.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_a_block_the_full_staging_disk_refuses_is_not_reported_staged(packed_local, tmp_path, monkeypatch):
    # staging.put returns False when the disk has no room: the prefetcher must not count the
    # block as staged (the reader then takes its samples from the origin).
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1, block_bytes=64 << 10)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    monkeypatch.setattr(StagingArea, "put", lambda self, ns, name, data: False)
    assert ds.reader.stage_block(0) == "unstaged"
    assert not ds.reader.staging.contains(ds.version, ds.blocks.name(0))


def _prefetch_all(ds, plan, concurrency: int = 2) -> dict:
    """Run the prefetcher (forked) over ``plan`` until every block is filled; its ledger row."""
    from stoker.loader.prefetch import inflight as infl

    blocks, first, last = block_schedule(ds, plan)
    ctx = mp.get_context("fork")
    cmds = ctx.Queue()
    shared = PrefetchShared.create(ctx)
    pos, counters = shared.position, shared.counters
    pos.value = len(plan)
    proc = ctx.Process(
        target=prefetch_main,
        args=(
            ds,
            cmds,
            shared,
            ReadOptions(fetch_concurrency=concurrency, prefetch_bytes=1 << 30, staging_bytes=1 << 30),
        ),
        daemon=True,
    )
    proc.start()
    try:
        cmds.put((1, blocks, first, last))
        deadline = time.monotonic() + 30
        while int(counters[infl.PLAN_DONE]) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return infl.ledger_row(counters, 1) | {"errors": int(counters[4])}
    finally:
        cmds.put(None)
        proc.join(10)


def test_adjacent_blocks_are_fetched_with_merged_gets(packed_local, tmp_path, monkeypatch):
    """An order that wants adjacent blocks together costs fewer requests than blocks, and leaves
    every block cached and verified; with merging off (a cap of one block) one request a block."""
    import stoker.loader.prefetch.loop as pf

    rows = {}
    for name, cap in (("merged", 4 * (64 << 10)), ("single", 64 << 10)):
        monkeypatch.setattr(pf, "merge_cap_bytes", lambda *a, cap=cap, **k: cap)  # as if measured
        ds = open_dataset(packed_local, cache_dir=str(tmp_path / name), cache_bytes=1 << 30, block_bytes=64 << 10)
        plan = np.arange(len(ds))  # sequential: neighbours in a shard are wanted one after the other
        rows[name] = _prefetch_all(ds, plan)
        assert rows[name]["prefetch_fills"] == len(ds.blocks) and rows[name]["errors"] == 0
        assert ds.blocks.cached(ds.cache, ds.version).all()
        requests = ds.origin.counters.requests
        for i in plan:  # every sample verified from the cache, no origin read
            ds.read(int(i))
        assert ds.origin.counters.requests == requests
    shards = len({int(s) for s in ds.blocks.shard})
    assert rows["single"]["origin_requests"] == len(ds.blocks)
    assert shards <= rows["merged"]["origin_requests"] < len(ds.blocks)
    assert rows["merged"]["origin_bytes"] >= int((ds.blocks.end - ds.blocks.start).sum())
