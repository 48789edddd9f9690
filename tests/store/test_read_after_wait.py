"""A sample read that missed and then found its block filled by another process (while it waited on
the block's fetch lock) reads only the sample's range from the cache, not the whole block."""

from __future__ import annotations

import numpy as np

from stoker.store.checks import sample_ok
from stoker.store.dataset import open_dataset


def test_a_read_after_waiting_reads_only_the_samples_range(packed_local, tmp_path, monkeypatch):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "c"), cache_bytes=64 << 20, block_bytes=256 << 10)
    b = next(b for b in range(len(ds.blocks)) if np.count_nonzero(ds.blocks.sample_block == b) >= 2)
    i = int(np.flatnonzero(ds.blocks.sample_block == b)[1])
    assert ds.reader.fill_block(b, want_data=False) == "filled"  # "another process's" fill
    reads = []
    real = type(ds.cache).read

    def traced(self, namespace, name, offset, length, count=True):
        reads.append((name, offset, length))
        return real(self, namespace, name, offset, length, count)

    monkeypatch.setattr(type(ds.cache), "read", traced)
    rel = int(ds.index.offset[i]) - int(ds.blocks.start[b])
    n = int(ds.index.length[i])
    where, data = ds.reader.block_for_read(b, rel, n)
    assert where == "cache" and reads == [(ds.blocks.name(b), rel, n)]
    assert sample_ok(ds, i, data)
    requests = ds.origin.counters.requests
    out = ds.read(i)
    assert type(out) is bytes and sample_ok(ds, i, out) and ds.origin.counters.requests == requests
