"""A Loader whose cache directory changes under it: removed in the middle of an epoch (the disk
tier's or the memory tier's, with and without workers), the job goes on and the cache is made
again; a pre-filled cache opened read-only is served without a write (no prefetcher, no staging,
no job record); see ../shared/cases/lifecycle/cache-dir-deleted and cache-dir-readonly."""

from __future__ import annotations

import os
import shutil

import pytest

from _helpers import batch_ids, pack_id_dataset, sample_id
from stoker import CacheOptions, Loader, RunOptions, open_dataset
from stoker.cache import layout

N = 160
BLOCK = 16 << 10


@pytest.fixture(scope="module")
def id_dataset(tmp_path_factory) -> str:
    """A packed dataset of N samples of 3000 bytes, each starting with its own id in ASCII."""
    return pack_id_dataset(tmp_path_factory.mktemp("ids"), N)


def _tree(root) -> dict:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_size if n in files else 0, st.st_mtime_ns)
    return out


@pytest.mark.parametrize(
    "workers,tier", [(2, "disk"), (0, "disk"), (2, "memory")], ids=["2-workers", "0-workers", "memory-tier"]
)
def test_a_cache_directory_removed_mid_epoch_is_made_again(id_dataset, tmp_path, workers, tier):
    ds = open_dataset(
        id_dataset,
        cache_dir=str(tmp_path / "cache"),
        cache_bytes=8 << 20,
        block_bytes=BLOCK,
        cache=CacheOptions(memory_bytes=(8 << 20) if tier == "memory" else 0, memory_dir=str(tmp_path / "mem")),
    )
    gone = tmp_path / ("mem" if tier == "memory" else "cache")
    with Loader(ds, 16, num_workers=workers, seed=3, decode=sample_id, run=RunOptions(timeout_s=30)) as loader:
        for epoch in range(3):
            plan, got = [int(i) for i in loader.plan()], []
            for k, batch in enumerate(loader):
                got += batch_ids(batch)
                if epoch == 0 and k == 3:  # fills in flight, blocks cached, descriptors open
                    os.rename(gone, tmp_path / "trash")  # gone at once (the workers make it again meanwhile)
                    shutil.rmtree(tmp_path / "trash")
            assert got == plan, f"epoch {epoch}"
            assert loader.stats.exactly_once
        assert layout.is_cache(str(gone))
        # what the removal took was read again (and cached again): more than the dataset's blocks
        # came from the origin in the first two epochs, nothing in the last
        blocks = int((ds.blocks.end - ds.blocks.start).sum())
        assert sum(h.origin_bytes for h in loader.history[:2]) > blocks and loader.stats.origin_bytes == 0


def test_a_prefilled_cache_is_served_read_only_without_a_write(id_dataset, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    ds = open_dataset(id_dataset, cache_dir=str(root), cache_bytes=8 << 20, block_bytes=BLOCK)
    with Loader(ds, 16, num_workers=2, seed=3, decode=sample_id) as loader:
        assert sum(len(b) for b in loader) == N
    before = _tree(root)
    monkeypatch.setenv("STOKER_CACHE_READ_ONLY", "1")  # as a pre-warmed image would set it
    ro = open_dataset(id_dataset, cache_dir=str(root), block_bytes=BLOCK)
    assert ro.cache.read_only
    with Loader(ro, 16, num_workers=2, seed=4, decode=sample_id, run=RunOptions(timeout_s=30)) as loader:
        got = [i for b in loader for i in batch_ids(b)]
        assert loader.processes.prefetcher is None  # nothing to fill
    assert sorted(got) == list(range(N)) and loader.stats.exactly_once
    assert loader.stats.origin_bytes == 0 and loader.stats.cache_hits == N
    assert _tree(root) == before


def test_a_partly_filled_read_only_cache_reads_the_rest_from_the_origin(id_dataset, tmp_path):
    root = tmp_path / "cache"
    ds = open_dataset(id_dataset, cache_dir=str(root), cache_bytes=8 << 20, block_bytes=BLOCK)
    for i in range(0, N, 40):
        ds[i]  # fills a few blocks
    before = _tree(root)
    ro = open_dataset(id_dataset, cache_dir=str(root), block_bytes=BLOCK, cache=CacheOptions(cache_read_only=True))
    with Loader(ro, 16, num_workers=0, seed=4, decode=sample_id) as loader:
        got = [i for b in loader for i in batch_ids(b)]
    assert sorted(got) == list(range(N)) and loader.stats.exactly_once
    assert 0 < loader.stats.cache_hits < N and loader.stats.origin_bytes > 0
    assert _tree(root) == before
    with pytest.raises(ValueError, match="memory tier"):
        open_dataset(id_dataset, cache_dir=str(root), cache=CacheOptions(cache_read_only=True, memory_bytes=1 << 20))


def test_derived_forms_over_a_read_only_cache_need_a_directory_of_their_own(id_dataset, tmp_path):
    from stoker import ImageOptions

    root = tmp_path / "cache"
    open_dataset(id_dataset, cache_dir=str(root), block_bytes=BLOCK)  # a cache, empty
    ro = open_dataset(id_dataset, cache_dir=str(root), block_bytes=BLOCK, cache=CacheOptions(cache_read_only=True))
    with Loader(ro, 16, num_workers=0, image=ImageOptions(cache_form="jpeg")) as loader:
        with pytest.raises(ValueError, match="is read-only: give it one"):
            iter(loader)
