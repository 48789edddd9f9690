"""Loader: order and exactly-once, deterministic augmentation, batches kept safe, errors never hang."""

import os
import signal

import numpy as np
import pytest
import torch

from stoker import ImageOptions, Loader, ReadOptions, RunOptions, WorkerError, open_dataset
from stoker.decode import decode_transform
from stoker.order import sample_seed


def _expected_eval(ds, ids):
    return np.stack([decode_transform(ds.read(int(i)), ds.key(int(i)), "eval", None) for i in ids])


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_follow_the_plan_exactly_once(packed_local, tmp_path, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, 16, num_workers=workers, transform="eval", seed=3) as loader:
        for epoch in range(2):
            plan = loader.plan()
            assert sorted(plan.tolist()) == list(range(len(ds)))
            seen = []
            for k, (images, labels) in enumerate(loader):
                ids = plan[k * 16 : (k + 1) * 16]
                assert images.dtype == torch.uint8 and labels.dtype == torch.int64
                assert tuple(images.shape) == (len(ids), 3, 224, 224)
                assert np.array_equal(labels.numpy(), ds.labels[ids])
                assert np.array_equal(images.numpy(), _expected_eval(ds, ids))
                seen.extend(ids.tolist())
            assert sorted(seen) == list(range(len(ds)))
            st = loader.stats
            assert st.epoch == epoch and st.samples == len(ds) and st.exactly_once
        assert loader.epoch == 2
        assert loader.history[1].cache_hit_ratio == 1.0 and loader.history[1].origin_bytes == 0


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_get_equal_counts_and_cover_the_dataset(packed_local, world):
    ds = open_dataset(packed_local, cache=False)
    counts, union = set(), []
    for rank in range(world):
        loader = Loader(ds, 32, num_workers=0, rank=rank, world_size=world, transform="eval", seed=1)
        loader.set_epoch(4)
        n = sum(len(y) for _, y in loader)
        counts.add(n)
        union.extend(loader.plan(4).tolist())
        assert loader.stats.exactly_once
    assert counts == {-(-len(ds) // world)}
    assert set(union) == set(range(len(ds)))


def test_train_augmentation_is_deterministic_and_independent_of_workers(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    runs = []
    for workers in (0, 2):
        with Loader(ds, 20, num_workers=workers, seed=9) as loader:
            runs.append([x.clone() for x, _ in loader])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # a sample's crop comes from (seed, epoch, sample id): check one against the transform directly
    loader = Loader(ds, 20, num_workers=0, seed=9)
    sid = int(loader.plan(0)[0])
    rng = np.random.default_rng(sample_seed(9, 0, sid))
    expect = decode_transform(ds.read(sid), ds.key(sid), "train", rng)
    assert np.array_equal(runs[0][0][0].numpy(), expect)
    # a new epoch gives a new order
    assert not np.array_equal(loader.plan(0), loader.plan(1))


def test_batches_the_user_keeps_are_never_overwritten(packed_local, tmp_path):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, 8, num_workers=2, transform="eval", read=ReadOptions(prefetch_batches=2)) as loader:
        plan = loader.plan()
        kept = list(loader)  # 15 batches held at once: far more than the slot ring
    for k, (images, _) in enumerate(kept):
        assert np.array_equal(images.numpy(), _expected_eval(ds, plan[k * 8 : (k + 1) * 8]))


def test_cache_smaller_than_dataset(packed_local, tmp_path):
    budget = 300 << 10
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=budget, block_bytes=64 << 10)
    assert ds.index.total_bytes > 4 * budget
    with Loader(ds, 16, num_workers=2, transform="eval", read=ReadOptions(staging_bytes=256 << 10)) as loader:
        for _ in range(2):
            assert sum(len(y) for _, y in loader) == len(ds)
            assert loader.stats.exactly_once
            assert ds.cache.used_bytes() <= budget
        assert loader.history[1].origin_bytes > 0 and loader.history[1].cache_hits > 0


def test_cases_decode_or_fail_naming_the_key(cases_packed, tmp_path):
    ds = open_dataset(cases_packed, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    keys = [ds.key(i) for i in range(len(ds))]
    assert "pillow/truncated_jpeg" in keys
    with Loader(ds, 4, num_workers=2, transform="eval", shuffle=False) as loader:
        with pytest.raises(WorkerError, match="pillow/truncated_jpeg"):
            for _ in loader:
                pass
    with Loader(ds, 4, num_workers=2, transform="eval", shuffle=False, run=RunOptions(on_error="skip")) as loader:
        got = sum(len(y) for _, y in loader)
        assert got == len(ds) - 1
        assert loader.stats.skipped == 1 and loader.stats.skipped_keys == ["pillow/truncated_jpeg"]
        assert loader.stats.exactly_once  # every sample that decodes, once; the other is in skipped
    for workers in (0, 2):  # one rank: a batch whose only sample is skipped is not yielded (no substitute)
        with Loader(
            ds, 1, num_workers=workers, transform="eval", shuffle=False, run=RunOptions(on_error="skip")
        ) as loader:
            sizes = [len(y) for _, y in loader]
            assert sizes == [1] * (len(ds) - 1) and loader.stats.skipped == 1 and loader.stats.padded == 0
            assert loader.stats.samples == loader.stats.batches == len(ds) - 1 and loader.stats.exactly_once
    for workers in (0, 2):  # two ranks: yielded with a substitute, so both ranks yield len(loader) batches
        sizes = {}
        for rank in (0, 1):
            with Loader(
                ds,
                1,
                num_workers=workers,
                transform="eval",
                shuffle=False,
                rank=rank,
                world_size=2,
                run=RunOptions(on_error="skip"),
            ) as loader:
                sizes[rank] = [len(y) for _, y in loader]
                assert len(sizes[rank]) == len(loader) and loader.stats.exactly_once
                if loader.stats.skipped:
                    assert loader.stats.padded == 1 and loader.stats.padded_keys != ["pillow/truncated_jpeg"]
        assert sizes[0] == sizes[1] == [1] * len(sizes[0])


def test_killed_worker_or_prefetcher_is_replaced(packed_local, tmp_path):
    """A SIGKILLed worker and then the prefetcher are replaced: the epoch delivers every sample once
    (tests/loader/test_respawn.py checks order, pixels and the bounds)."""
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, 4, num_workers=2, transform="eval", run=RunOptions(timeout_s=30)) as loader:
        it = iter(loader)
        n = len(next(it)[1])
        os.kill(loader.processes.workers[1].pid, signal.SIGKILL)
        n += len(next(it)[1])
        os.kill(loader.processes.prefetcher.pid, signal.SIGKILL)
        n += sum(len(y) for _, y in it)
        assert n == len(ds) and loader.stats.exactly_once
        assert loader.stats.worker_restarts == 1 and loader.stats.prefetcher_restarts == 1


def test_origin_errors_give_a_clear_error_after_bounded_retries(
    s3_origin, origin_faults, sample_tree, tmp_path, monkeypatch
):
    """Every object GET answered 503 (through the fault proxy): a shard read, the index read and
    a worker's read each end in an OriginError naming the object; two 503s are ridden out."""
    from stoker import OriginError
    from stoker_lab.bench.faultproxy import Fault, object_gets

    monkeypatch.setenv("STOKER_RETRY_BUDGET_S", "2")  # retries end after 2 s (default 30 s)
    from stoker.store.pack import pack
    from stoker_lab.bench.origin import upload_tree

    plain = s3_origin.storage_options()  # upload and pack straight to the origin
    upload_tree(str(sample_tree / "train"), s3_origin.url("err/raw"), plain)
    url = s3_origin.url("err/packed")
    pack(s3_origin.url("err/raw"), url, storage_options=plain, progress=False)
    proxy, opts = origin_faults  # the loader reads through the fault proxy
    ds = open_dataset(url, cache_dir=str(tmp_path), cache_bytes=64 << 20, storage_options=opts)
    proxy.set_fault(Fault("status", 503, match=object_gets))
    with pytest.raises(
        OriginError, match=r"s3://stoker/err/packed/shards/shard-000000.tar bytes .* attempt.*SlowDown \(HTTP 503\)"
    ):
        ds.read(0)
    with pytest.raises(OriginError, match="index.parquet"):
        open_dataset(url, cache=False, storage_options=opts)
    with Loader(ds, 8, num_workers=2, transform="eval", run=RunOptions(timeout_s=60)) as loader:
        with pytest.raises(WorkerError, match="OriginError") as err:
            next(iter(loader))
        cause = err.value.__cause__
        assert isinstance(cause, OriginError)  # the worker's own error, to catch
        # what was tried, whichever process tried: the worker alone, or the prefetcher whose
        # fetch of the block it waited for, then the worker with what was left of the budget
        assert cause.attempts >= 2 and cause.elapsed_s >= 1.0
        assert f"after {cause.attempts} attempt(s) in {cause.elapsed_s:.1f} s" in str(err.value)
    proxy.set_fault(
        Fault("status", 503, count=2, match=object_gets)
    )  # transient: two failures, then the retry succeeds
    retries, injected = ds.origin.counters.retries, proxy.stats()["faults_injected"]
    assert ds.read(1) == (sample_tree / "train" / f"{ds.key(1)}.JPEG").read_bytes()
    assert ds.origin.counters.retries - retries == proxy.stats()["faults_injected"] - injected == 2


def _fill_as_prefetcher(ds, b: int) -> None:
    from stoker import OriginError
    from stoker.loader.workers.worker import fresh_copy

    try:
        fresh_copy(ds).reader.fill_block(b, blocking=False, want_data=False)
    except OriginError:
        pass  # expected: the read that waited for this fill reports it


def test_a_read_that_waited_for_another_process_failed_fetch_counts_its_attempts(
    s3_origin, origin_faults, sample_tree, tmp_path, monkeypatch
):
    """The prefetcher spends the retry budget on a block the origin keeps throttling; a read
    that waited for that fetch then makes its one remaining try. Its error counts every
    attempt of both processes (exactly the 503s the origin served) and the seconds since the
    first, and names both; it no longer says "1 attempt(s) in 0.0 s"."""
    import multiprocessing as mp
    import time

    from stoker import OriginError
    from stoker.store.pack import pack
    from stoker_lab.bench.faultproxy import Fault
    from stoker_lab.bench.origin import upload_tree

    monkeypatch.setenv("STOKER_RETRY_BUDGET_S", "2")
    plain = s3_origin.storage_options()
    upload_tree(str(sample_tree / "train"), s3_origin.url("wait/raw"), plain)
    url = s3_origin.url("wait/packed")
    pack(s3_origin.url("wait/raw"), url, storage_options=plain, progress=False)
    proxy, opts = origin_faults
    ds = open_dataset(url, cache_dir=str(tmp_path), cache_bytes=64 << 20, storage_options=opts)
    proxy.set_fault(Fault("status", 503))  # every shard GET
    pre = mp.get_context("fork").Process(
        target=_fill_as_prefetcher, args=(ds, int(ds.blocks.sample_block[0])), name="stoker-prefetch"
    )
    pre.start()
    try:
        deadline = time.monotonic() + 30  # it holds the block's fetch lock from before its first GET
        while proxy.stats()["faults_injected"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.stats()["faults_injected"] > 0, "the prefetcher's fetch never reached the origin"
        with pytest.raises(OriginError) as err:
            ds.read(0)
    finally:
        pre.join(30)
    e = err.value
    assert e.tried is not None and len(e.tried) == 2, str(e)
    (first, n0, s0), (then, n1, s1) = e.tried
    assert first == f"the prefetcher (pid {pre.pid})" and then == f"the main process (pid {os.getpid()})"
    assert n0 >= 1 and n1 >= 1 and e.attempts == n0 + n1 == proxy.stats()["faults_injected"]
    assert e.elapsed_s >= max(s0, s1) and e.code == "SlowDown"
    shard = ds.index.shard_name(ds.blocks.shard[ds.blocks.sample_block[0]])
    assert str(e).startswith(f"origin error reading {url}/{shard} bytes "), str(e)
    assert (
        f"after {e.attempts} attempt(s) in {e.elapsed_s:.1f} s [the prefetcher (pid {pre.pid}): {n0} in "
        f"{s0:.1f} s; then the main process (pid {os.getpid()}), having waited for it: {n1} in"
    ) in str(e)


def test_an_epoch_cut_short_is_not_replayed(packed_local):
    ds = open_dataset(packed_local, cache=False)
    loader = Loader(ds, 16, num_workers=0, transform="eval", seed=2)
    firsts = []
    for _ in range(3):
        for x, _ in loader:
            firsts.append(x.clone())
            break
    assert [s.epoch for s in loader.history] == [0, 1, 2] and loader.epoch == 3
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])
    assert not loader.history[0].exactly_once  # honest: the epoch was cut short
    loader.set_epoch(0)
    assert torch.equal(next(iter(loader))[0], firsts[0])


def test_bad_arguments_are_refused(packed_local):
    ds = open_dataset(packed_local, cache=False)
    for make in (
        lambda: Loader(ds, 8, image=ImageOptions(image_size=0)),
        lambda: Loader(ds, 8, read=ReadOptions(order="bogus")),
        lambda: Loader(ds, 8, transform="x"),
        lambda: Loader(ds, 8, run=RunOptions(on_error="ignore")),
        lambda: Loader(ds, 8, num_workers=-1),
        lambda: Loader(ds, 8, rank=3, world_size=2),
    ):
        with pytest.raises(ValueError):
            make()


def test_cache_aware_order_is_exactly_once_and_resumable(packed_local, tmp_path):
    budget = 2 << 20
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=budget, block_bytes=128 << 10)
    cfg = dict(num_workers=2, transform="eval", seed=4, read=ReadOptions(cache_aware_window=40))
    with Loader(ds, 8, **cfg) as loader:
        list(loader)  # the cold epoch fills the cache up to the budget
        plain = loader.plan(1)
        got = [y.clone() for _, y in loader]
        st = loader.stats
        assert st.exactly_once and st.order_displacement > 0
        labels = torch.cat(got).numpy()
        assert sorted(labels.tolist()) == sorted(ds.labels[plain].tolist())
    # resume mid-epoch: the saved cache state gives the same order even if the cache changed since
    first = Loader(ds, 8, **cfg)
    list(first)
    it = iter(first)
    head = [next(it)[1].clone() for _ in range(3)]
    state = first.state_dict()
    rest_ref = [y.clone() for _, y in it]
    first.close()
    ds.cache.remove(ds.version, ds.blocks.name(0))  # the cache changes between save and restore
    second = Loader(ds, 8, **cfg)
    second.load_state_dict(state)
    rest = [y.clone() for _, y in second]
    second.close()
    assert len(head) == 3 and all(torch.equal(a, b) for a, b in zip(rest, rest_ref)) and len(rest) == len(rest_ref)


def test_worker_error_names_the_corrupt_sample_not_its_block_neighbour(packed_local, tmp_path):
    """A corrupt sample found while a worker fills the block for another sample: the error names
    the corrupt one (the sample being read is fine; it only shares the block)."""
    import shutil

    from stoker.loader import WorkerError

    dst = tmp_path / "copy"
    shutil.copytree(packed_local, dst)
    ds = open_dataset(str(dst), cache=False)
    order = Loader(ds, 8, num_workers=0, seed=3).plan(0)
    # a sample in the same block as the first sample of the epoch, but not that sample itself
    first = int(order[0])
    neighbours = [
        i for i in range(len(ds)) if ds.blocks.sample_block[i] == ds.blocks.sample_block[first] and i != first
    ]
    bad = neighbours[0]
    shard = dst / ds.index.shard_name(ds.index.shard[bad])
    raw = bytearray(shard.read_bytes())
    raw[int(ds.index.offset[bad]) + 10] ^= 0x01
    shard.write_bytes(bytes(raw))
    ds = open_dataset(str(dst), cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30, check=False)
    loader = Loader(ds, 8, num_workers=2, seed=3, run=RunOptions(timeout_s=60))
    with pytest.raises(WorkerError) as err:
        for _ in loader:
            pass
    head = str(err.value).splitlines()[0]
    assert f"failed on sample {ds.key(bad)!r}" in head, head


def test_a_checksum_failure_in_a_worker_raises_with_the_checksum_error_as_cause(packed_local, tmp_path):
    """A flipped byte in a shard: with workers the epoch ends in a WorkerError whose cause is the
    ChecksumError naming the sample, also with on_error="skip" (integrity failures are never skipped)."""
    import glob
    import shutil

    from stoker import ChecksumError

    copy = tmp_path / "copy"
    shutil.copytree(packed_local, copy)
    ds0 = open_dataset(str(copy), cache=False)
    i = 3
    shard = sorted(glob.glob(str(copy / "shards" / "*.tar")))[int(ds0.index.shard[i])]
    with open(shard, "r+b") as f:
        f.seek(int(ds0.index.offset[i]) + 10)
        b = f.read(1)
        f.seek(int(ds0.index.offset[i]) + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    for on_error in ("raise", "skip"):
        ds = open_dataset(str(copy), cache_dir=str(tmp_path / f"c-{on_error}"), cache_bytes=64 << 20)
        with Loader(ds, 8, num_workers=2, transform="eval", run=RunOptions(on_error=on_error)) as loader:
            with pytest.raises(WorkerError, match="ChecksumError") as err:
                for _ in loader:
                    pass
        assert isinstance(err.value.__cause__, ChecksumError) and err.value.__cause__.key == ds.key(i)
