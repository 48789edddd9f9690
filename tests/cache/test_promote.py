"""The memory tier fills from the disk tier: a block read from disk is promoted under the memory
tier's budget, by its own policy, once, with the disk's bytes (stoker.cache.promote)."""

import os

import numpy as np
import pytest

from stoker import CacheOptions, Loader
from stoker.cache import DiskCache, TieredCache
from stoker.store.dataset import open_dataset

BLOCK = 128 << 10


def _block_files(root):
    """{block name: bytes} of every committed block under a cache tier's root (a block evicted
    while it is listed, by a worker reading ahead under ``lru``, is left out)."""
    out = {}
    for entry in os.scandir(root):
        if entry.is_dir() and entry.name.startswith("stoker-ns-"):
            for f in os.scandir(entry.path):
                if not f.name.startswith("."):
                    try:
                        with open(f.path, "rb") as fh:
                            out[f.name] = fh.read()
                    except FileNotFoundError:
                        continue
    return out


def _warm_disk(packed, disk_dir):
    """A disk-only cache over the whole dataset, filled by one epoch; the dataset."""
    ds = open_dataset(packed, cache_dir=str(disk_dir), cache_bytes=64 << 20, block_bytes=BLOCK)
    with Loader(ds, 16, num_workers=0, transform="eval") as loader:
        assert sum(len(y) for _, y in loader) == len(ds)
    assert len(_block_files(disk_dir)) == len(ds.blocks.start)
    return ds


def _tiered(packed, disk_dir, mem_dir, mem, policy="future"):
    return open_dataset(
        packed,
        cache_dir=str(disk_dir),
        cache_bytes=64 << 20,
        block_bytes=BLOCK,
        cache=CacheOptions(memory_bytes=mem, memory_dir=str(mem_dir), cache_policy=policy),
    )


def test_a_memory_tier_added_to_a_warm_disk_cache_hits_from_its_second_epoch(tmp_path, packed_local):
    disk_dir, mem_dir = tmp_path / "disk", tmp_path / "shm"
    plain = _warm_disk(packed_local, disk_dir)
    ds = _tiered(packed_local, disk_dir, mem_dir, 64 << 20)
    n_blocks = len(ds.blocks.start)
    with Loader(ds, 16, num_workers=2, transform="eval") as loader:  # two forked workers share the tier
        for _ in range(3):
            assert sum(len(y) for _, y in loader) == len(ds) and loader.stats.exactly_once
    first, *later = loader.history
    assert first.origin_bytes == 0 and first.cache_hits == len(ds)  # warm on disk: nothing fetched
    for e in later:  # from the second epoch on, every read is a memory hit
        assert e.memory_hits == e.cache_hits == len(ds), (e.epoch, e.memory_hits, e.cache_hits)
        assert e.memory_promotions == 0 and e.origin_bytes == 0
    assert first.memory_promotions == n_blocks  # each block promoted once, by one of the workers
    # the memory tier holds the disk's blocks, byte for byte, and the disk keeps its copies
    in_memory, on_disk = _block_files(mem_dir), _block_files(disk_dir)
    assert len(in_memory) == n_blocks and in_memory == on_disk
    for i in range(len(ds)):  # bytes read from the memory tier equal the origin's
        assert ds.read(i) == plain.read(i) == open_dataset(packed_local, cache=False).read(i)
    assert ds.cache.stats.memory_hits == len(ds)


@pytest.mark.parametrize("policy", ["future", "noevict", "lru"])
def test_promotion_keeps_the_memory_budget(tmp_path, packed_local, policy):
    disk_dir, mem_dir = tmp_path / "disk", tmp_path / "shm"
    _warm_disk(packed_local, disk_dir)
    probe = open_dataset(packed_local, cache=False, block_bytes=BLOCK)
    sizes = (probe.blocks.end - probe.blocks.start).astype(np.int64)
    mem = int(sizes.sum()) // 3
    ds = _tiered(packed_local, disk_dir, mem_dir, mem, policy)
    with Loader(ds, 16, num_workers=2, transform="eval") as loader:
        for _ in range(3):
            assert sum(len(y) for _, y in loader) == len(ds) and loader.stats.exactly_once
            in_memory = _block_files(mem_dir)
            assert 0 < sum(map(len, in_memory.values())) <= mem  # the budget holds
            assert ds.cache.memory.used_bytes() <= mem
    assert all(e.origin_bytes == 0 for e in loader.history)  # the disk copies stay: nothing refetched
    assert len(_block_files(disk_dir)) == len(sizes)
    assert in_memory == {k: v for k, v in _block_files(disk_dir).items() if k in in_memory}  # the disk's bytes
    if policy != "lru":  # the blocks promoted stay (nothing evicted for them), and hit in every later epoch
        assert all(e.memory_hits > 0 and e.evictions == 0 for e in loader.history[1:])
        # each counted once (a block promoted by the next epoch's first batches, read ahead, is not in history)
        assert 0 < sum(e.memory_promotions for e in loader.history) <= len(in_memory)


def test_the_read_that_promotes_reads_the_disk_file_once(tmp_path, packed_local, monkeypatch):
    disk_dir = tmp_path / "disk"
    _warm_disk(packed_local, disk_dir)
    ds = _tiered(packed_local, disk_dir, tmp_path / "shm", 64 << 20)
    cache = ds.cache
    assert isinstance(cache, TieredCache)
    b = 1
    name = ds.blocks.name(b)
    i = int(np.flatnonzero(ds.blocks.sample_block == b)[1])
    start, stop = int(ds.index.offset[i]), int(ds.index.offset[i] + ds.index.length[i])
    preads = []
    real = os.pread

    def counted(fd, n, at):
        preads.append((os.readlink(f"/proc/self/fd/{fd}"), n, at))
        return real(fd, n, at)

    monkeypatch.setattr(os, "pread", counted)
    rel = start - int(ds.blocks.start[b])
    data = cache.read(ds.version, name, rel, stop - start)
    assert data == ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[b]), start, stop)
    on_disk = [p for p in preads if p[0].startswith(str(disk_dir))]
    assert len(on_disk) == 1 and on_disk[0][1:] == (int(ds.blocks.nbytes(b)), 0)  # the whole block, once
    assert cache.stats.promotions == 1 and cache.stats.disk_hits == 1 and cache.memory.contains(ds.version, name)
    preads.clear()
    assert cache.read(ds.version, name, rel, stop - start) == data  # now from memory
    assert cache.stats.memory_hits == 1 and not [p for p in preads if p[0].startswith(str(disk_dir))]


def test_a_refused_promotion_is_not_tried_on_every_read(tmp_path, monkeypatch):
    mem, disk = DiskCache(str(tmp_path / "m"), 1000, "noevict"), DiskCache(str(tmp_path / "d"), 1 << 20, "noevict")
    cache = TieredCache(mem, disk)
    for k in range(3):
        disk.put("v", f"b{k}", bytes([k]) * 800)
    asked = []
    real = mem.would_admit
    monkeypatch.setattr(mem, "would_admit", lambda n, ns="": asked.append(n) or real(n, ns))
    assert cache.read("v", "b0", 0, 10) == bytes(10) and cache.stats.promotions == 1
    for _ in range(5):  # b1 and b2 do not fit: asked once, then left alone for a while
        for k in (1, 2):
            assert cache.with_fd("v", f"b{k}", lambda fd: os.pread(fd, 10, 0)) == bytes([k]) * 10
    assert asked == [800, 800] and cache.stats.promotions == 1 and mem.used_bytes() == 800
    assert cache.stats.disk_hits == 11 and cache.stats.memory_hits == 0
    assert cache.with_fd("v", "b0", lambda fd: os.pread(fd, 10, 0)) == bytes(10) and cache.stats.memory_hits == 1


def test_a_server_sending_a_disk_block_sends_the_promoted_copy_once(tmp_path):
    """The cluster cache service sends a hit with one ``sendfile`` from the descriptor that
    ``with_fd`` gives (stoker.cluster.service.cache_service): a block found only on disk is promoted
    and ``use`` called once, on the memory tier's file, whole."""
    mem, disk = DiskCache(str(tmp_path / "m"), 1 << 20), DiskCache(str(tmp_path / "d"), 1 << 20)
    mem.register("v", 1 << 20)
    disk.register("v", 1 << 20)
    cache = TieredCache(mem, disk)
    block = os.urandom(5000)
    disk.put("v", "blk", block)
    calls = []

    def send(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return os.pread(fd, len(block), 0)

    assert cache.with_fd("v", "blk", send) == block
    assert calls == [mem.path("v", "blk")] and cache.stats.promotions == 1 and cache.stats.disk_hits == 1
    assert cache.with_fd("v", "blk", send) == block and cache.stats.memory_hits == 1
