"""The prefetcher's event-driven loop (stoker.loader.prefetch.process.prefetch_main): it sleeps on one queue
(commands, fill outcomes) and looks at the consumer's position only on a timer while it waits on
it. These check that nothing it sleeps on can keep it asleep: a stop command, a dead parent, a
fill that ends while the consumer stalls, the consumer moving on, and that its ledger holds the
same figures as the polling loop's on the same plans."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from stoker.loader.options import ReadOptions
from stoker.loader.prefetch import fills
from stoker.loader.prefetch import inflight as infl
from stoker.loader.prefetch.process import PrefetchShared, block_schedule, prefetch_main
from stoker.store.dataset import open_dataset

BLOCK = 64 << 10


def _until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def _sizes(ds) -> np.ndarray:
    return (ds.blocks.end - ds.blocks.start).astype(np.int64)


class _Prefetch:
    """A forked prefetch process with its queue and shared positions."""

    def __init__(self, ds, prefetch_bytes: int = 1 << 30, concurrency: int = 2):
        ctx = mp.get_context("fork")
        self.cmds = ctx.Queue()
        shared = PrefetchShared.create(ctx)
        self.pos, self.done, self.prev_done, self.counters = (
            shared.position,
            shared.done,
            shared.prev_done,
            shared.counters,
        )
        self.proc = ctx.Process(
            target=prefetch_main,
            args=(
                ds,
                self.cmds,
                shared,
                ReadOptions(fetch_concurrency=concurrency, prefetch_bytes=prefetch_bytes, staging_bytes=1 << 30),
            ),
            daemon=True,
        )
        self.proc.start()

    def stop_within(self, seconds: float) -> float:
        t0 = time.monotonic()
        self.cmds.put(None)
        self.proc.join(seconds)
        return time.monotonic() - t0

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.mark.parametrize("state", ["idle", "waiting on the consumer"])
def test_a_stop_command_wakes_the_loop_at_once(packed_local, tmp_path, state):
    """Idle (no plan: it sleeps on the queue with no timer) or held at ``prefetch_bytes`` (it sleeps
    on the queue with the consumer timer): a stop ends the process within a fraction of a second."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=BLOCK)
    p = _Prefetch(ds, prefetch_bytes=1)  # one block ahead of a consumer that never moves
    try:
        if state != "idle":
            blocks, first, last = block_schedule(ds, np.arange(len(ds)))
            p.cmds.put((1, blocks, first, last))
            assert _until(lambda: p.counters[2] >= 1)  # the first block, then it waits on the consumer
            time.sleep(0.2)
            assert p.counters[2] == 1 and p.proc.is_alive()
        else:
            time.sleep(0.3)
        took = p.stop_within(5)
        assert p.proc.exitcode == 0 and took < 1.0, took
    finally:
        p.close()


def test_the_prefetcher_ends_when_its_parent_dies_without_pdeathsig(packed_local, tmp_path, monkeypatch):
    """The kernel's parent-death signal is the first way out; without it (monkeypatched off) the
    command thread notices the new parent within PARENT_POLL_S and the loop ends: no prefetcher
    sleeps forever on its queue after its parent died."""
    import stoker._procs as procs

    monkeypatch.setattr(procs, "exit_with_parent", lambda: None)
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=BLOCK)
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the "training process": starts the prefetcher, reports its pid, then waits to be killed
        try:
            os.close(r)
            p = _Prefetch(ds)
            os.write(w, f"{p.proc.pid}\n".encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = int(f.readline())
    os.kill(middle, signal.SIGKILL)
    os.waitpid(middle, 0)

    def gone() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    try:
        assert _until(gone, 5.0)
    finally:
        if not gone():
            os.kill(child, signal.SIGKILL)


def test_a_fill_that_ends_while_the_consumer_stalls_is_not_lost(packed_local, tmp_path):
    """prefetch_bytes of 1: the prefetcher fills the first block and waits on the consumer. The fill
    that ends meanwhile is counted; as the consumer reaches each block's first use, that block
    follows (the timer that looks at the position), each block once."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=BLOCK)
    plan = np.arange(len(ds))
    blocks, first, last = block_schedule(ds, plan)
    p = _Prefetch(ds, prefetch_bytes=1, concurrency=1)
    try:
        p.cmds.put((1, blocks, first, last))
        assert _until(lambda: p.counters[2] >= 1)
        time.sleep(0.3)  # the consumer stalls: nothing more is fetched, nothing is lost
        assert int(p.counters[2]) == 1 and int(p.counters[infl.PLAN_DONE]) == 0
        for k in range(1, len(blocks) + 1):  # the consumer reaches each block's first use in turn
            p.pos.value = int(first[k]) if k < len(blocks) else len(plan)
            assert _until(lambda k=k: p.counters[2] + p.counters[3] >= min(len(blocks), k + 1), 5.0), k
        assert _until(lambda: int(p.counters[infl.PLAN_DONE]) == 1)
        row = infl.ledger_row(p.counters, 1)
        assert row["prefetch_fills"] == len(blocks) and int(p.counters[4]) == 0
        assert row["origin_requests"] == len(blocks)  # one block at a time: nothing to merge
        assert ds.blocks.cached(ds.cache, ds.version).all()
    finally:
        p.stop_within(5)
        p.close()


def test_the_ledger_of_a_cold_then_a_cached_plan(packed_local, tmp_path):
    """The figures the polling loop gave on the same plans: a cold plan fills every block (its
    bytes once, at most one request a block, a depth sample when the position moves); the same
    plan again finds every block cached: no fill, no request, every block counted as cached."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, block_bytes=BLOCK)
    plan = np.random.default_rng(0).permutation(len(ds))
    blocks, first, last = block_schedule(ds, plan)
    k = len(blocks)
    own = int(_sizes(ds).sum())
    same_shard = ds.blocks.shard[1:] == ds.blocks.shard[:-1]
    gaps = int((ds.blocks.start[1:] - ds.blocks.end[:-1])[same_shard].sum())
    p = _Prefetch(ds, concurrency=4)
    try:
        p.pos.value = len(plan)
        p.cmds.put((1, blocks, first, last))
        assert _until(lambda: int(p.counters[infl.PLAN_DONE]) == 1)
        row = infl.ledger_row(p.counters, 1)
        assert row["prefetch_fills"] == k and (row["prefetch_staged"], row["staged_reused"]) == (0, 0)
        assert own <= row["origin_bytes"] <= own + gaps and 0 < row["origin_requests"] <= k
        assert (int(p.counters[2]), int(p.counters[3]), int(p.counters[4])) == (k, 0, 0)
        assert int(p.counters[0]) == row["origin_bytes"] and int(p.counters[1]) == row["origin_requests"]
        assert int(p.counters[7]) >= 1  # a depth sample at the first look at the position
        p.cmds.put((2, blocks, first, last))
        assert _until(lambda: int(p.counters[infl.PLAN_DONE]) == 2)
        assert infl.ledger_row(p.counters, 2) == {
            "origin_bytes": 0,
            "origin_requests": 0,
            "prefetch_fills": 0,
            "prefetch_staged": 0,
            "staged_reused": 0,
        }
        assert (int(p.counters[2]), int(p.counters[3])) == (k, k)
    finally:
        p.stop_within(5)
        p.close()


def test_fill_threads_follow_the_fills_in_flight():
    """One thread per fill in flight at most, started when needed; every outcome (a result or an
    exception) comes back on the event queue; shutdown lets the fills in flight finish."""
    import queue

    events: queue.SimpleQueue = queue.SimpleQueue()
    pool = fills.FillThreads(events)
    gate = threading.Event()

    def fill(x):
        gate.wait(5)
        if x == 2:
            raise ValueError("boom")
        return {x: "filled"}

    for token in range(3):
        pool.submit(token, fill, token)
    assert threading.active_count() >= 3
    gate.set()
    got = {}
    for _ in range(3):
        kind, token, status, exc = events.get(timeout=5)
        assert kind == fills.FILL
        got[token] = status if exc is None else repr(exc)
        pool.reported()
    assert got == {0: {0: "filled"}, 1: {1: "filled"}, 2: "ValueError('boom')"}
    for token in range(3, 6):  # one at a time: the threads there are serve them, no new ones
        pool.submit(token, fill, token)
        events.get(timeout=5)
        pool.reported()
    assert pool.started == 3
    pool.shutdown()
    assert pool.alive == 0


def test_a_full_staging_budget_waits_for_delivery_and_then_goes_on(packed_local, tmp_path):
    """A cache that admits nothing and a staging budget of two of its largest blocks: the prefetcher
    stages what fits and waits (nothing wakes it but the timer that looks at the delivered position); as the
    consumer delivers each staged block's last use, the next ones are staged, never more than the
    budget, until every block of the plan was staged once."""
    from stoker.cache.staging import StagingArea
    from stoker.store.blocks import BlockReader

    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1, block_bytes=BLOCK)
    ds = ds.with_reader(BlockReader(ds, staging=StagingArea(str(tmp_path / "staging"))))
    plan = np.argsort(ds.blocks.sample_block, kind="stable")  # block by block: k's last use before k+1's first
    blocks, first, last = block_schedule(ds, plan)
    sizes = _sizes(ds)
    budget = 2 * int(sizes.max())
    ctx = mp.get_context("fork")
    cmds = ctx.Queue()
    shared = PrefetchShared.create(ctx)
    pos, done, counters = shared.position, shared.done, shared.counters
    pos.value = len(plan)  # all dispatched: only the staging budget holds it back
    proc = ctx.Process(
        target=prefetch_main,
        args=(ds, cmds, shared, ReadOptions(fetch_concurrency=4, prefetch_bytes=1 << 30, staging_bytes=budget)),
        daemon=True,
    )
    proc.start()

    def staged_bytes() -> int:
        return sum(int(sizes[ds.blocks.of_name(n)]) for n in ds.reader.staging.names(ds.version))

    try:
        cmds.put((1, blocks, first, last))
        assert _until(lambda: counters[5] >= 2)
        time.sleep(0.2)
        held = int(counters[5])
        assert held < len(blocks) and staged_bytes() <= budget  # held at the budget (2 or more small blocks)
        time.sleep(0.2)
        assert int(counters[5]) == held
        for k in range(len(blocks)):
            done.value = int(last[k]) + 1  # block k's last use delivered: it goes, the next is staged
            assert _until(
                lambda k=k: counters[5] >= min(len(blocks), k + 3) or int(counters[infl.PLAN_DONE]) == 1, 5.0
            ), k
            assert staged_bytes() <= budget
        assert _until(lambda: int(counters[infl.PLAN_DONE]) == 1)
        row = infl.ledger_row(counters, 1)
        assert row["prefetch_staged"] == len(blocks) and row["prefetch_fills"] == 0 and int(counters[4]) == 0
        assert _until(lambda: ds.reader.staging.names(ds.version) == [])  # all delivered: all gone
    finally:
        cmds.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
