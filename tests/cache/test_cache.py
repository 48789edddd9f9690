"""Node cache: budget never exceeded, left-over fills and corrupt blocks found, single flight."""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from stoker import CacheOptions
from stoker.cache import DiskCache
from stoker.store.dataset import open_dataset


def _usage_on_disk(root, with_tmp=True):
    """Bytes of block files (and in-progress fills) under a cache root, bookkeeping files excluded."""
    total = 0
    for entry in os.scandir(root):
        if entry.is_dir() and not entry.name.startswith("."):
            for f in os.scandir(entry.path):
                if with_tmp or not f.name.startswith(".tmp-"):
                    total += f.stat().st_size
    return total


@pytest.mark.parametrize("policy", ["future", "noevict", "lru"])
def test_budget_never_exceeded(tmp_path, policy):
    cap = 10_000
    c = DiskCache(str(tmp_path), cap, policy)
    c.register("v1", 10 * cap)
    rng = np.random.default_rng(0)
    admitted = 0
    for i in range(200):
        ok = c.put("v1", f"b{i}", bytes(int(rng.integers(1, 3000))))
        admitted += ok
        assert _usage_on_disk(tmp_path) <= cap
        assert c.used_bytes() <= cap
        assert c.used_bytes() == _usage_on_disk(tmp_path)
    if policy in ("noevict", "future"):  # one dataset: the future policy never evicts its own blocks
        assert c.stats.refused > 0 and c.stats.evictions == 0
    else:
        assert c.stats.evictions > 0 and c.stats.refused == 0
    assert not c.put("v1", "huge", bytes(cap + 1))  # larger than the whole budget: refused


def _hammer(root, cap, seed):
    c = DiskCache(root, cap, "lru")
    rng = np.random.default_rng(seed)
    for i in range(150):
        c.put("v", f"s{seed}-{i}", bytes(int(rng.integers(100, 2500))))
        assert c.used_bytes() <= cap


def test_budget_holds_with_concurrent_processes(tmp_path):
    cap = 20_000
    procs = [mp.get_context("fork").Process(target=_hammer, args=(str(tmp_path), cap, s)) for s in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    c = DiskCache(str(tmp_path), cap, "lru")
    assert _usage_on_disk(tmp_path) <= cap
    assert c.recover()["used"] == _usage_on_disk(tmp_path)


def test_leftover_temporary_fill_is_cleaned(tmp_path, packed_local):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    ds.read(0)
    ns = tmp_path / os.path.dirname(ds.cache.path(ds.version, "x"))
    # A fill left by a process that died (pid that cannot exist) plus one by a live process.
    dead = ns / ".tmp-999999999-deadbeef"
    dead.write_bytes(b"x" * 5000)
    live = ns / f".tmp-{os.getpid()}-cafe0000"
    live.write_bytes(b"y" * 100)
    ds2 = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)  # open runs recover()
    assert not dead.exists() and live.exists()
    assert ds2.cache.used_bytes() == _usage_on_disk(tmp_path)
    live.unlink()


def test_corrupt_cached_block_is_detected_and_refetched(tmp_path, packed_local):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20, block_bytes=128 << 10)
    good = ds.read(5)
    b = int(ds.blocks.sample_block[5])
    path = ds.cache.path(ds.version, ds.blocks.name(b))
    raw = bytearray(open(path, "rb").read())
    off = int(ds.index.offset[5] - ds.blocks.start[b])
    raw[off + 100] ^= 0xFF  # flip one byte inside sample 5
    open(path, "wb").write(bytes(raw))
    before = ds.origin.counters.requests
    assert ds.read(5) == good
    assert ds.cache.stats.corrupt == 1
    assert ds.origin.counters.requests == before + 1  # refetched once
    assert ds.read(5) == good and ds.origin.counters.requests == before + 1  # then a clean hit


def test_truncated_cached_block_is_refetched(tmp_path, packed_local):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    good = ds.read(3)
    path = ds.cache.path(ds.version, ds.blocks.name(int(ds.blocks.sample_block[3])))
    with open(path, "r+b") as f:
        f.truncate(10)
    assert ds.read(3) == good


def _read_all(url, cache_dir, out):
    ds = open_dataset(url, cache_dir=cache_dir, cache_bytes=64 << 20, block_bytes=256 << 10)
    start = ds.origin.counters.requests  # the index read
    for i in range(len(ds)):
        ds.read(i)
    out.put(ds.origin.counters.requests - start)


def test_single_flight_across_processes(tmp_path, packed_local):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    probe = open_dataset(packed_local, cache=False, block_bytes=256 << 10)
    procs = [ctx.Process(target=_read_all, args=(packed_local, str(tmp_path), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    total = sum(q.get(timeout=5) for _ in procs)
    # Each block is fetched from the origin exactly once across the three readers.
    probe2 = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20, block_bytes=256 << 10)
    assert total == len(probe2.blocks) == len(probe.blocks)


def test_stale_version_never_served(tmp_path, sample_tree):
    """A dataset re-packed at the same URL gets a new version, so old cache entries are not used."""
    from stoker.store.pack import pack

    src = tmp_path / "src"
    os.system(f"cp -r {sample_tree / 'train'} {src}")
    dst = tmp_path / "d"
    pack(str(src), str(dst), progress=False)
    ds1 = open_dataset(str(dst), cache_dir=str(tmp_path / "c"), cache_bytes=64 << 20)
    first_key = ds1.key(0)
    ds1.read(0)
    victim = src / f"{first_key}.JPEG"
    victim.write_bytes(victim.read_bytes()[:-10] + b"0123456789")
    pack(str(src), str(dst), progress=False, overwrite=True)
    ds2 = open_dataset(str(dst), cache_dir=str(tmp_path / "c"), cache_bytes=64 << 20)
    assert ds2.version != ds1.version
    assert ds2.read(0) == victim.read_bytes()


def test_memory_tier_over_disk_tier(tmp_path, packed_local):
    from stoker import Loader, ReadOptions

    mem_dir, disk_dir = tmp_path / "shm", tmp_path / "disk"
    probe = open_dataset(packed_local, cache=False, block_bytes=128 << 10)
    D = int((probe.blocks.end - probe.blocks.start).sum())
    mem, disk = D // 3, D // 3
    ds = open_dataset(
        packed_local,
        cache_dir=str(disk_dir),
        cache_bytes=disk,
        block_bytes=128 << 10,
        cache=CacheOptions(memory_bytes=mem, memory_dir=str(mem_dir)),
    )
    with Loader(ds, 16, num_workers=2, transform="eval", read=ReadOptions(staging_bytes=128 << 10)) as loader:
        for _ in range(3):
            assert sum(len(y) for _, y in loader) == len(ds) and loader.stats.exactly_once
            assert _usage_on_disk(mem_dir) <= mem and _usage_on_disk(disk_dir) <= disk  # each budget holds
        st = loader.stats
    assert _usage_on_disk(mem_dir) > mem // 2 and _usage_on_disk(disk_dir) > disk // 2  # memory first, then disk
    assert st.memory_hits > 0 and 0 < st.cache_hits - st.memory_hits  # hits from both tiers
    for e in loader.history:  # tier hits are sample hits: a reader of a block filled while it waited is a miss
        assert e.memory_hits <= e.cache_hits, (e.epoch, e.memory_hits, e.cache_hits)
    assert st.origin_bytes > 0  # about D - (mem + disk) per epoch from the origin
    # a re-open finds both tiers' contents and budgets
    again = open_dataset(
        packed_local,
        cache_dir=str(disk_dir),
        cache_bytes=disk,
        block_bytes=128 << 10,
        cache=CacheOptions(memory_bytes=mem, memory_dir=str(mem_dir)),
    )
    assert again.cache.used_bytes() == _usage_on_disk(mem_dir) + _usage_on_disk(disk_dir)


def test_two_writers_of_one_block_count_it_once(tmp_path):
    """Puts of the same name racing outside the fetch lock: the block is counted once and the
    first copy linked in is never taken for a planted link and removed (a race that showed in
    about one trial in thirty, hence the repetitions)."""
    import threading

    for trial in range(100):
        root = tmp_path / str(trial)
        c = DiskCache(str(root), 1 << 20, "noevict")
        barrier = threading.Barrier(4)
        results = []

        def put(barrier=barrier, root=root, results=results):
            barrier.wait()
            d = DiskCache(str(root), 1 << 20, "noevict")
            results.append((d.put("v", "same", bytes(5000)), d.stats.fills))

        ts = [threading.Thread(target=put) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert [r for r, _ in results] == [True] * 4
        assert sum(f for _, f in results) == 1, f"trial {trial}: {results}"  # one writer's copy stands
        assert c.used_bytes() == 5000 == _usage_on_disk(root)
        assert c.usage.namespace_usage() == {"v": 5000}


def test_fetch_lock_released_although_a_child_forked_while_it_was_held(tmp_path):
    """A process forked while a thread held a fetch lock has a copy of its descriptor; the
    lock must still be free as soon as the holder leaves it, not when the child exits."""
    import threading

    cache = DiskCache(str(tmp_path), 1 << 20)
    held, release = threading.Event(), threading.Event()

    def hold():
        with cache.fetch_lock("ns", "blk", blocking=True):
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(5)
    child = mp.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    try:
        release.set()
        t.join(5)
        with cache.fetch_lock("ns", "blk", blocking=False) as got:
            assert got
    finally:
        child.kill()
        child.join(5)


def test_a_failed_fill_is_noted_in_its_fetch_lock_for_that_block_only(tmp_path):
    """The note a failed fill leaves for the processes that waited on it: read back for its own
    block, not for another block on the same lock stripe; a shorter note replaces a longer one
    whole; the lock itself still works with a note in its file."""
    cache = DiskCache(str(tmp_path), 1 << 20)
    assert cache.fill_failure("ns", "blk") is None
    note = {"pid": 7, "t0": 1.0, "t1": 3.0, "tried": [["the prefetcher (pid 7)", 4, 2.0]]}
    cache.note_fill_failure("ns", "blk", note)
    assert cache.fill_failure("ns", "blk") == {"block": "ns/blk", **note}
    stripe = cache.locks.stripe("ns", "blk")
    same = next(n for n in (f"other-{k}" for k in range(1 << 20)) if cache.locks.stripe("ns", n) == stripe)
    assert cache.fill_failure("ns", same) is None  # the stripe's note is another block's
    cache.note_fill_failure("ns", same, {"pid": 9})
    assert cache.fill_failure("ns", same) == {"block": f"ns/{same}", "pid": 9}
    assert cache.fill_failure("ns", "blk") is None
    with cache.fetch_lock("ns", "blk", blocking=False) as got:
        assert got
        with cache.fetch_lock("ns", same, blocking=False) as other:
            assert not other  # one stripe: single flight as before


def test_a_block_filled_while_its_reader_waited_is_no_tier_hit(tmp_path, packed_local):
    ds = open_dataset(
        packed_local,
        cache_dir=str(tmp_path / "disk"),
        cache_bytes=64 << 20,
        block_bytes=128 << 10,
        cache=CacheOptions(memory_bytes=64 << 20, memory_dir=str(tmp_path / "shm")),
    )
    assert ds.reader.fill_block(0, blocking=True, want_data=False) == "filled"  # another process's fill, say
    before = ds.cache.stats.memory_hits
    status, data = ds.reader.fill_block(0, blocking=True, want_data=True)  # the waiter reads the whole block
    assert status == "cached" and len(data) == int(ds.blocks.end[0] - ds.blocks.start[0])  # nothing fetched
    assert ds.cache.stats.memory_hits == before  # its sample is a miss, not a memory-tier hit
    ds.read(int(np.flatnonzero(ds.blocks.sample_block == 0)[0]))
    assert ds.cache.stats.memory_hits == before + 1  # a sample read from the tier is
