"""The byte path's no-copy reads (obstore's buffer handed to the checksum and the cache write, not
copied into ``bytes``): the bytes that reach the cache are the origin's, a short or reset answer is
retried or raised and never stored, the cache's accounting is unchanged, and a sample handed to
the user is still ``bytes``. Every obstore read runs in a child process (see test_native_s3.py)."""

from __future__ import annotations

import pickle

import pytest
import xxhash

from _helpers import fault_proxy, in_child

pytest.importorskip("obstore")

from stoker import OriginError  # noqa: E402
from stoker.store.dataset import open_dataset  # noqa: E402
from stoker.store.runs import fill_run  # noqa: E402
from stoker_lab.bench.faultproxy import Fault, object_gets  # noqa: E402


def _cached_equals_origin(ds, plain) -> int:
    """Every cached block's file equals the same range read from the origin through s3fs; returns
    the blocks compared."""
    n = 0
    for b in range(len(ds.blocks)):
        path = ds.cache.path(ds.version, ds.blocks.name(b))
        try:
            with open(path, "rb") as f:
                got = f.read()
        except FileNotFoundError:
            continue
        shard = ds.index.shard_name(ds.blocks.shard[b])
        want = plain.read_range(shard, int(ds.blocks.start[b]), int(ds.blocks.end[b]))
        assert xxhash.xxh3_64_intdigest(got) == xxhash.xxh3_64_intdigest(want), ds.blocks.name(b)
        n += 1
    return n


def _native_fills_store_the_origins_bytes(url, opts, cache_dir):
    proxy, popts = fault_proxy(opts)
    with proxy:
        ds = open_dataset(
            url,
            cache_dir=cache_dir,
            cache_bytes=256 << 20,
            storage_options=popts,
            block_bytes=64 << 10,
            retry_budget_s=5,
        )
        plain = open_dataset(url, cache=False, storage_options=opts).origin
        assert ds.origin.use_native()
        shard = ds.index.shard_name(ds.blocks.shard[0])
        assert not isinstance(ds.origin.read_range(shard, 0, 100), bytes)  # obstore's buffer, not copied
        fresh = pickle.loads(pickle.dumps(ds.origin))  # as the prefetcher gets it
        assert fresh.use_native() and len(fresh.read_range(shard, 10, 20)) == 10
        assert fresh._fs is None  # native reads build no s3fs filesystem
        nb = len(ds.blocks)
        half = nb // 2
        # resets and truncated bodies on some GETs: retried, never stored short
        proxy.set_fault(Fault("reset", match=object_gets, every=3, count=3))
        for b in range(half):
            assert ds.reader.fill_block(b, blocking=True, want_data=False) == "filled"
        # (every=1: a run merges its blocks into few GETs, one per shard; the first two are cut short)
        proxy.set_fault(Fault("truncate", match=object_gets, every=1, count=2))
        status = fill_run(ds, list(range(half, nb)))  # merged GETs: blocks stored as views of one buffer
        # "busy": two blocks of the run on one fetch-lock stripe (the run holds the first one's)
        assert all(s in ("filled", "busy") for s in status.values()) and "filled" in status.values(), status
        for b, s in status.items():
            if s == "busy":
                assert ds.reader.fill_block(b, blocking=True, want_data=False) == "filled"
        proxy.set_fault(None)
        assert proxy.stats()["faults_injected"] >= 4
        assert _cached_equals_origin(ds, plain) == nb
        total = int(sum(int(ds.blocks.end[b] - ds.blocks.start[b]) for b in range(nb)))
        assert ds.cache.used_bytes() == total and ds.cache.stats.fill_bytes == total
        assert ds.cache.stats.fills == nb and ds.cache.stats.evictions == 0
        for i in range(0, len(ds), 7):
            assert type(ds.read(i)) is bytes


def test_native_fills_store_the_origins_bytes(s3_packed, tmp_path):
    in_child(_native_fills_store_the_origins_bytes, *s3_packed, str(tmp_path / "cache"))


def _a_failing_get_is_raised_and_nothing_is_stored(url, opts, cache_dir):
    proxy, popts = fault_proxy(opts)
    with proxy:
        ds = open_dataset(
            url,
            cache_dir=cache_dir,
            cache_bytes=256 << 20,
            storage_options=popts,
            block_bytes=64 << 10,
            retry_budget_s=0.3,
        )
        assert ds.origin.use_native()
        ds.origin.backoff_s = 0.01
        for mode in ("truncate", "reset"):
            proxy.set_fault(Fault(mode, match=object_gets))
            with pytest.raises(OriginError):
                ds.reader.fill_block(0, blocking=True, want_data=False)
            status = fill_run(ds, [1, 2])
            assert all(isinstance(s, OriginError) for s in status.values()), status
            with pytest.raises(OriginError):
                ds.origin.read_range(ds.index.shard_name(ds.blocks.shard[0]), 0, 1000)
        proxy.set_fault(None)
        assert not any(ds.cache.contains(ds.version, ds.blocks.name(b)) for b in range(3))
        assert ds.cache.used_bytes() == 0 and ds.cache.stats.fills == 0
        assert ds.reader.fill_block(0, blocking=True, want_data=False) == "filled"  # the origin is back


def test_a_failing_get_is_raised_and_nothing_is_stored(s3_packed, tmp_path):
    in_child(_a_failing_get_is_raised_and_nothing_is_stored, *s3_packed, str(tmp_path / "cache"))
