"""A peer read the cache service answers: its source says where the bytes came from.

The service's class runs here in the test process, without Ray (what it asks of Ray, its node, the
cluster secret and the node's address, is stood in for: tests/cluster/_dataplane.py), over the
local packed dataset."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from _dataplane import in_process_service  # noqa: E402

from stoker.cache import DiskCache  # noqa: E402
from stoker.cluster.service import cache_service as service_mod  # noqa: E402
from stoker.store.dataset import open_dataset  # noqa: E402


@pytest.fixture
def svc(tmp_path, monkeypatch):
    s = in_process_service(tmp_path / "root", monkeypatch)
    yield s
    s.close()


def _block_range(ds, b: int) -> tuple[int, int]:
    start = int(ds.blocks.start[b])
    return start, min(start + 1000, int(ds.blocks.end[b]))


def test_a_block_another_fill_brought_while_the_read_waited_is_served_from_the_cache(svc, packed_local, monkeypatch):
    """The read misses, then finds the block filled by another fill when it gets the block's lock:
    nothing was fetched for it, so it is "cache", not "origin" (which the reader would count as an
    origin read through a peer)."""
    ds = open_dataset(packed_local, block_bytes=128 << 10)
    dref = service_mod.dataset_ref(ds)
    assert svc.fill(dref, [0])["filled"] == 1  # another fill, say a warm-up's
    start, stop = _block_range(ds, 0)
    want = bytes(ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[0]), start, stop))

    real_read, misses = DiskCache.read, []

    def miss_once(self, *a, **kw):  # the read's first look comes just before the fill's write
        if not misses:
            misses.append(a)
            return None
        return real_read(self, *a, **kw)

    monkeypatch.setattr(DiskCache, "read", miss_once)
    assert svc.read(dref, 0, start, stop) == ("cache", want)
    assert misses  # the read did miss first


def test_a_block_fetched_for_the_read_is_origin_then_cache(svc, packed_local):
    ds = open_dataset(packed_local, block_bytes=128 << 10)
    dref = service_mod.dataset_ref(ds)
    start, stop = _block_range(ds, 1)
    source, data = svc.read(dref, 1, start, stop)
    assert source == "origin" and len(data) == stop - start
    assert svc.read(dref, 1, start, stop) == ("cache", data)
