"""The descriptors a cache keeps open per process (stoker.cache.handles): block files read through
a bounded set of open descriptors never serve a block that was removed, evicted or replaced; the
budget and fetch locks, kept open, still exclude other threads and processes (a forked child too);
a blocking fetch-lock wait wakes when the holder lets go and honours its timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from stoker.cache import DiskCache
from stoker.cache import handles as handles_mod
from stoker.errors import CacheLockTimeout

NS = "v1"


def _block(k: int, n: int = 4096) -> bytes:
    return bytes((k * 7 + j) % 251 for j in range(n))


def test_a_replaced_block_is_never_read_through_a_stale_descriptor(tmp_path):
    reader = DiskCache(str(tmp_path / "c"), 1 << 20)
    writer = DiskCache(str(tmp_path / "c"), 1 << 20)  # another process's view: its own descriptors
    assert writer.put(NS, "b", _block(1))
    assert reader.read(NS, "b", 0, 4096) == _block(1)
    assert reader.dir.local().open_block_fds() == 1
    writer.remove(NS, "b")  # the reader's descriptor now points at an unlinked file
    assert reader.read(NS, "b", 0, 4096) is None
    assert writer.put(NS, "b", _block(2))  # same name, other bytes
    assert reader.read(NS, "b", 100, 50) == _block(2)[100:150]
    assert reader.used_bytes() == 4096


def test_an_evicted_block_is_not_served_by_a_reader_that_held_it_open(tmp_path):
    reader = DiskCache(str(tmp_path / "c"), 3 * 4096, policy="lru")
    writer = DiskCache(str(tmp_path / "c"), 3 * 4096, policy="lru")
    for k in range(3):
        assert writer.put(NS, f"b{k}", _block(k))
    assert reader.read(NS, "b0", 0, 10) == _block(0)[:10]
    time.sleep(0.01)
    os.utime(writer.path(NS, "b0"), (1, 1))  # b0 the least recently used: the next fill evicts it
    assert writer.put(NS, "b3", _block(3))
    assert writer.stats.evictions == 1 and writer.used_bytes() == 3 * 4096
    assert reader.read(NS, "b0", 0, 10) is None
    assert reader.read(NS, "b3", 0, 10) == _block(3)[:10]


def test_open_block_descriptors_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(handles_mod, "BLOCK_FDS", 8)
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    for k in range(20):
        assert cache.put(NS, f"b{k}", _block(k, 64))
    for _ in range(2):
        for k in range(20):
            assert cache.read(NS, f"b{k}", 3, 5) == _block(k, 64)[3:8]
    assert cache.dir.local().open_block_fds() == 8
    cache.close()
    assert cache.dir.local().open_block_fds() == 0
    assert cache.read(NS, "b0", 0, 64) == _block(0, 64)  # still usable


def test_a_short_block_file_is_dropped_with_its_descriptor(tmp_path):
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    assert cache.put(NS, "b", _block(1))
    assert cache.read(NS, "b", 0, 10) == _block(1)[:10]
    os.truncate(cache.path(NS, "b"), 100)  # damaged in place (same inode)
    assert cache.read(NS, "b", 0, 4096) is None
    assert cache.stats.corrupt == 1 and not cache.contains(NS, "b")
    assert cache.dir.local().open_block_fds() == 0


def test_threads_of_one_process_exclude_each_other_on_a_stripe(tmp_path):
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    got = []
    with cache.fetch_lock(NS, "b") as held:
        assert held

        def other():
            with cache.fetch_lock(NS, "b", blocking=False) as h:
                got.append(h)

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert got == [False]
    with cache.fetch_lock(NS, "b", blocking=False) as held:  # released: free again
        assert held


def _child_checks(cache, q):
    try:
        with cache.fetch_lock(NS, "b", blocking=False) as held:
            q.put(("fetch", held))
        fd = cache.dir.local().budget_fd()
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            q.put(("budget", True))
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            q.put(("budget", False))
    except BaseException as exc:  # noqa: BLE001
        q.put(("error", repr(exc)))


def test_a_forked_child_does_not_share_the_parents_locks(tmp_path):
    """The child inherits the parent's open lock descriptors (one open file description): it must
    open its own, or it would take locks the parent holds."""
    cache = DiskCache(str(tmp_path / "c"), 1 << 20)
    cache.used_bytes()  # the budget lock file is open in this process now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with cache.fetch_lock(NS, "b") as held, cache.usage.locked():
        assert held
        p = ctx.Process(target=_child_checks, args=(cache, q))
        p.start()
        out = dict(q.get(timeout=30) for _ in range(2))
        p.join(30)
    assert out == {"fetch": False, "budget": False}
    with cache.fetch_lock(NS, "b", blocking=False) as held:  # the child's exit released nothing of ours...
        assert held
    assert cache.used_bytes() == 0  # ...and our locks still work


def _hold(root, seconds, ready):
    cache = DiskCache(root, 1 << 20)
    with cache.fetch_lock(NS, "b"):
        ready.set()
        time.sleep(seconds)


def test_a_blocking_wait_wakes_when_the_holder_lets_go_and_honours_its_timeout(tmp_path):
    root = str(tmp_path / "c")
    DiskCache(root, 1 << 20)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold, args=(root, 1.0, ready))
    p.start()
    assert ready.wait(30)
    short = DiskCache(root, 1 << 20, lock_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(CacheLockTimeout):
        with short.fetch_lock(NS, "b"):
            pass
    assert 0.15 < time.monotonic() - t0 < 0.9
    waiter = DiskCache(root, 1 << 20, lock_timeout_s=30)
    with waiter.fetch_lock(NS, "b") as held:
        waited = time.monotonic() - t0
        assert held
    p.join(30)
    assert waited < 3.0  # woke on the release, not on a long polling tick
    # the timed-out wait's helper thread took the lock after the holder and let go of it
    deadline = time.monotonic() + 5
    while True:
        with short.fetch_lock(NS, "b", blocking=False) as held:
            if held:
                break
        assert time.monotonic() < deadline, "the abandoned wait kept the lock"
        time.sleep(0.01)


def test_descriptors_of_unlinked_blocks_are_swept_out(tmp_path, monkeypatch):
    """A block removed by another process no longer keeps its bytes through this process's open
    descriptor once this process has opened BLOCK_FDS more blocks."""
    monkeypatch.setattr(handles_mod, "BLOCK_FDS", 8)
    reader = DiskCache(str(tmp_path / "c"), 1 << 20)
    writer = DiskCache(str(tmp_path / "c"), 1 << 20)
    for k in range(8):
        assert writer.put(NS, f"b{k}", _block(k, 64))
    assert reader.read(NS, "b0", 0, 8) == _block(0, 64)[:8]  # the reader's first open
    writer.remove(NS, "b0")
    for k in range(1, 8):  # the 8th open sweeps
        assert reader.read(NS, f"b{k}", 0, 8) == _block(k, 64)[:8]
    assert reader.dir.local().open_block_fds() == 7  # b1..b7: b0's descriptor closed although the LRU had room


def test_a_dropped_cache_gives_its_descriptors_back(tmp_path):
    """A cache (or the Dataset holding it) that is dropped closes the lock and block files it kept
    open: a training process that opens datasets again and again must not run out of descriptors.
    Counted as the descriptors into the cache's directory, so other tests' files in the same
    process (closed by their finalizers at any time) do not move the count."""
    import gc

    root = str(tmp_path / "c")

    def into_cache() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(root)
            except OSError:  # closed meanwhile
                pass
        return n

    writer = DiskCache(root, 1 << 20)
    for k in range(8):
        assert writer.put(NS, f"b{k}", _block(k))
    base = into_cache()
    for _ in range(10):
        reader = DiskCache(root, 1 << 20)
        for k in range(8):
            assert reader.read(NS, f"b{k}", 0, 16) == _block(k)[:16]
        with reader.fetch_lock(NS, "b0"):
            pass
        assert into_cache() > base  # it does keep some open while alive
        del reader
        gc.collect()
    assert into_cache() <= base
