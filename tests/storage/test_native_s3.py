"""obstore reads (stoker.storage._native_s3) against the local S3 server: same bytes as s3fs, the same
errors and retries, used by the leaf processes (prefetcher, decode workers) only.

A process that forks after using obstore can crash or hang its children (tokio), so every test
that reads through obstore does it in a child process of its own; the pytest process never does.
"""

from __future__ import annotations

import os

import pytest

from _helpers import fault_proxy, in_child

pytest.importorskip("obstore")

from stoker import OriginError  # noqa: E402
from stoker.loader import Loader  # noqa: E402
from stoker.storage import Origin  # noqa: E402
from stoker.storage._native_s3 import NativeS3Reader  # noqa: E402
from stoker.store.dataset import open_dataset  # noqa: E402
from stoker_lab.bench.faultproxy import Fault, object_gets  # noqa: E402


def _create_only_where_it_can_stand_in(url, opts):
    assert NativeS3Reader.create(url, opts) is not None
    assert NativeS3Reader.create("file:///tmp/x", {}) is None
    assert NativeS3Reader.create("memory://x", {}) is None
    assert NativeS3Reader.create(url, {**opts, "profile": "other"}) is None  # not covered: s3fs keeps it
    assert NativeS3Reader.create(url, {**opts, "client_kwargs": {"region_name": "us-east-1", "verify": False}}) is None


def test_create_only_where_it_can_stand_in(s3_packed):
    in_child(_create_only_where_it_can_stand_in, *s3_packed)


def _same_bytes_as_s3fs_and_errors(url, opts):
    fs_origin = Origin(url, opts)
    nat = Origin(url, opts)
    assert nat.use_native()
    shard = "shards/shard-000000.tar"
    size = fs_origin.size(shard)
    for start, end in ((0, 1), (0, 4096), (1000, 70000), (size - 10, size)):
        assert nat.read_range(shard, start, end) == fs_origin.read_range(shard, start, end)
    assert nat.counters.requests == 4 and nat.counters.bytes == 1 + 4096 + 69000 + 10
    with pytest.raises(FileNotFoundError):
        nat.read_range("shards/missing.tar", 0, 10)
    with pytest.raises(OriginError, match="short read"):
        nat.read_range(shard, size - 10, size + 10)
    os.environ["STOKER_NATIVE_S3"] = "0"
    assert not Origin(url, opts).use_native()


def test_same_bytes_as_s3fs_and_errors(s3_packed):
    in_child(_same_bytes_as_s3fs_and_errors, *s3_packed)


def _retries_and_origin_error(url, opts):
    """Through a fault proxy started in this (child) process: every object GET answered 503
    until the budget ends in OriginError; then two 503s, which the retries ride out."""
    proxy, popts = fault_proxy(opts)
    with proxy:
        nat = Origin(url, popts, backoff_s=0.01, retry_budget_s=0.5)
        assert nat.use_native()
        proxy.set_fault(Fault("status", 503, match=object_gets))
        with pytest.raises(
            OriginError, match=r"shard-000000.tar bytes 0-100 after \d+ attempt.*SlowDown \(HTTP 503\)"
        ) as err:
            nat.read_range("shards/shard-000000.tar", 0, 100)
        assert (err.value.code, err.value.status) == ("SlowDown", 503) and err.value.attempts >= 2
        assert proxy.stats()["faults_injected"] == err.value.attempts
        nat.retry_budget_s = 30
        proxy.set_fault(Fault("status", 503, count=2, match=object_gets))  # transient: two failures, then it succeeds
        retries, injected = nat.counters.retries, proxy.stats()["faults_injected"]
        assert len(nat.read_range("shards/shard-000000.tar", 0, 100)) == 100
        assert nat.counters.retries - retries == proxy.stats()["faults_injected"] - injected == 2


def test_retries_and_origin_error(s3_packed):
    in_child(_retries_and_origin_error, *s3_packed)


def test_loader_leaf_processes_read_with_obstore(s3_packed, tmp_path, monkeypatch):
    """The prefetcher and the workers (forked, never forking) read blocks through obstore; the
    training process itself does not; every sample arrives exactly once."""
    url, opts = s3_packed
    log = tmp_path / "native-pids"
    real = NativeS3Reader.read_range

    def traced(self, key, start, end):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(self, key, start, end)

    monkeypatch.setattr(NativeS3Reader, "read_range", traced)
    ds = open_dataset(url, cache_dir=str(tmp_path / "cache"), cache_bytes=64 << 20, storage_options=opts)
    with Loader(ds, 16, num_workers=2, transform="eval") as loader:
        assert sum(len(y) for _, y in loader) == len(ds) and loader.stats.exactly_once
        children = set(loader.processes.pids())
    pids = {int(x) for x in log.read_text().split()}
    assert pids and pids <= children and os.getpid() not in pids
