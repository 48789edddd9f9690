"""A node cache smaller than the dataset: the cold epoch reads each block from the origin once,
the next epoch reads what the cache does not hold, staging is emptied at the epoch's end, and
``prefetch_staged`` counts only blocks fetched from the origin (a block staged for the previous
plan and used again is ``staged_reused``)."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from stoker import ImageOptions, Loader, ReadOptions, open_dataset
from stoker.cache.staging import StagingArea
from stoker.loader.prefetch import inflight as infl
from stoker.loader.prefetch.process import PrefetchShared, block_schedule, prefetch_main
from stoker.store.blocks import BlockReader

BLOCK = 256 << 10


def _block_bytes(ds, which=None) -> int:
    sizes = (ds.blocks.end - ds.blocks.start).astype(np.int64)
    return int(sizes.sum() if which is None else sizes[which].sum())


def _gap_bytes(ds, which=None) -> int:
    """Bytes between consecutive blocks of one shard (both in ``which``, a bool mask): what a
    merged GET of adjacent blocks (stoker.store.runs) reads beyond their own bytes (tar headers)."""
    which = np.ones(len(ds.blocks), bool) if which is None else which
    pair = (ds.blocks.shard[1:] == ds.blocks.shard[:-1]) & which[1:] & which[:-1]
    return int((ds.blocks.start[1:] - ds.blocks.end[:-1])[pair].sum())


def _once(nbytes: int, ds, which=None) -> bool:
    """Whether ``nbytes`` read from the origin is each block of ``which`` once (a block or a sample
    read twice is far more than the gaps a merged GET may add)."""
    own = _block_bytes(ds, which)
    return own <= nbytes <= own + _gap_bytes(ds, which)


def _staged_files(cache_dir) -> list[str]:
    """The blocks staged now in every staging area under ``cache_dir`` (the loaders' own: a
    loader's staging area is its run's, not the dataset's)."""
    return sorted(str(p) for p in (cache_dir / ".staging").glob("*/*/*") if not p.name.startswith("."))


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("where,fraction", [("local", 0.25), ("local", 0.6), ("s3", 0.4)])
def test_a_cold_epoch_reads_each_block_once_with_a_small_cache(where, fraction, packed_local, s3_packed, tmp_path):
    url, opts = (packed_local, None) if where == "local" else s3_packed
    probe = open_dataset(url, storage_options=opts, cache=False, block_bytes=BLOCK)
    budget = int(_block_bytes(probe) * fraction)
    ds = open_dataset(url, storage_options=opts, cache_dir=str(tmp_path), cache_bytes=budget, block_bytes=BLOCK)
    dataset_bytes = _block_bytes(ds)
    assert dataset_bytes > 1.5 * budget
    with Loader(
        ds,
        16,
        num_workers=2,
        transform="eval",
        read=ReadOptions(prefetch_next_epoch=False),
        image=ImageOptions(image_size=32),
    ) as loader:
        assert sum(len(y) for _, y in loader) == len(ds)
        cold = loader.stats
        assert _once(cold.origin_bytes, ds), (cold.origin_bytes, dataset_bytes)  # every block once, none twice
        assert cold.origin_requests <= len(ds.blocks) and cold.direct_reads == 0
        assert 0 < cold.prefetch_staged and cold.prefetch_fills + cold.prefetch_staged <= len(ds.blocks)
        assert cold.staged_reused == 0
        # staging is emptied once the epoch's last batch is delivered: no block serves the next epoch
        assert _until(lambda: _staged_files(tmp_path) == [])
        cached = ds.blocks.cached(ds.cache, ds.version)
        assert 0 < _block_bytes(ds, cached) <= budget
        assert sum(len(y) for _, y in loader) == len(ds)
        warm = loader.stats
        assert _once(warm.origin_bytes, ds, ~cached), warm.origin_bytes  # what the cache does not hold, once
        assert warm.staged_reused == 0 and warm.direct_reads == 0
        assert warm.prefetch_staged <= int((~cached).sum())
        assert warm.cache_hits == int(np.isin(ds.blocks.sample_block, np.flatnonzero(cached)).sum())


def _in_step(loaders) -> int:
    """Read one epoch of every loader, a batch of each in turn (as DDP keeps a node's ranks in
    step); returns the samples delivered."""
    its, n = [iter(ld) for ld in loaders], 0
    while its:
        for it in list(its):
            try:
                n += len(next(it)[1])
            except StopIteration:
                its.remove(it)
    return n


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_ranks_on_one_node_read_each_block_once_with_a_small_cache(where, packed_local, s3_packed, tmp_path):
    # Two ranks of a job on one node: two Loaders over one node cache that holds half the dataset.
    # A block that one rank staged is linked into the other's staging area, not fetched again, so
    # the node reads each block once. Each rank's staging area used to fetch every block the cache
    # did not admit: 38-40% more bytes than the dataset's blocks at this budget.
    url, opts = (packed_local, None) if where == "local" else s3_packed
    probe = open_dataset(url, storage_options=opts, cache=False, block_bytes=BLOCK)
    budget = int(_block_bytes(probe) * 0.5)
    loaders = [
        Loader(
            open_dataset(url, storage_options=opts, cache_dir=str(tmp_path), cache_bytes=budget, block_bytes=BLOCK),
            16,
            rank=r,
            world_size=2,
            num_workers=2,
            transform="eval",
            read=ReadOptions(prefetch_next_epoch=False),
            image=ImageOptions(image_size=32),
        )
        for r in range(2)
    ]
    try:
        assert _in_step(loaders) == len(probe)
        stats = [ld.stats for ld in loaders]
    finally:
        for ld in loaders:
            ld.close()
    node_bytes = sum(s.origin_bytes for s in stats)
    assert _once(node_bytes, probe), (node_bytes, _block_bytes(probe), [s.origin_bytes for s in stats])
    assert all(s.exactly_once and s.direct_reads == 0 and s.evictions == 0 for s in stats)
    assert sum(s.prefetch_fills for s in stats) + sum(s.prefetch_staged for s in stats) <= len(probe.blocks)


def _wait_plan(counters, run: int) -> None:
    assert _until(lambda: int(counters[infl.PLAN_DONE]) >= run), f"plan {run} not done"


def test_prefetch_staged_counts_origin_fetches_and_reuse_apart(packed_local, tmp_path):
    # A cache that admits nothing: every block of the plan is staged. Plan 1 fetches all of them.
    # Plan 2 comes while plan 1 drains (none of its batches delivered): its blocks are all still
    # staged for plan 1, so plan 2 reuses them and fetches nothing. Plan 3 comes without a drain
    # (the epoch was cut short): plan 2's staged blocks go, and plan 3 fetches every block again.
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1, block_bytes=BLOCK)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    plan = np.arange(len(ds))
    blocks, first, last = block_schedule(ds, plan)
    k = len(blocks)

    def fetched_all(row) -> bool:  # every block from the origin once (merged GETs: fewer requests)
        return _once(row["origin_bytes"], ds) and 0 < row["origin_requests"] <= k

    ctx = mp.get_context("fork")
    cmds = ctx.Queue()
    shared = PrefetchShared.create(ctx)
    pos, done, counters = shared.position, shared.done, shared.counters
    pos.value = len(plan)  # the whole plan is dispatched: prefetch all of it
    proc = ctx.Process(
        target=prefetch_main,
        args=(ds, cmds, shared, ReadOptions(fetch_concurrency=4, prefetch_bytes=1 << 30, staging_bytes=1 << 30)),
        daemon=True,
    )
    proc.start()
    try:
        cmds.put((1, blocks, first, last))
        _wait_plan(counters, 1)
        row = infl.ledger_row(counters, 1)
        assert fetched_all(row) and (row["prefetch_staged"], row["staged_reused"]) == (k, 0)
        cmds.put((2, blocks, first, last, True))  # draining: plan 1 has delivered nothing yet
        _wait_plan(counters, 2)
        assert infl.ledger_row(counters, 2) == {
            "origin_bytes": 0,
            "origin_requests": 0,
            "prefetch_fills": 0,
            "prefetch_staged": 0,
            "staged_reused": k,
        }
        cmds.put((3, blocks, first, last))  # not draining: plan 2 is over
        _wait_plan(counters, 3)
        row = infl.ledger_row(counters, 3)
        assert fetched_all(row) and (row["prefetch_staged"], row["staged_reused"]) == (k, 0)
        assert len(ds.reader.staging.names(ds.version)) == k
        done.value = len(plan)  # plan 3 delivered: its staged blocks go, with nothing left to fetch
        assert _until(lambda: ds.reader.staging.names(ds.version) == [])
    finally:
        cmds.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
