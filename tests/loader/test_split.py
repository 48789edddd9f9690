"""The first batch of an epoch split over the workers (loader/pipeline/split.py): same batch, any skips."""

import numpy as np
import pytest

from stoker import Loader, RunOptions, open_dataset
from stoker.decode import DecodeError, decode_transform
from stoker.loader.pipeline.split import MIN_PART, join_replies, split_ids


def test_split_ids_cuts_contiguous_parts_of_at_least_the_minimum():
    ids = np.arange(100, 164)
    parts = split_ids(ids, 3)
    assert [o for o, _ in parts] == [0, 21, 43]
    assert np.array_equal(np.concatenate([p for _, p in parts]), ids)
    assert all(len(p) >= MIN_PART for _, p in parts)
    ((offset, part),) = split_ids(ids[:15], 4)  # under two parts' worth: one part
    assert offset == 0 and np.array_equal(part, ids[:15])
    assert len(split_ids(ids[:16], 4)) == 2 and len(split_ids(ids, 1)) == 1


def _ok(offset, n, skipped=(), wid=0):
    return ("ok", wid, 7, 0, 3, n, list(skipped), [f"k{s}" for s in skipped], {"w": wid}, None, None, [], offset)


def test_join_closes_the_rows_that_skipped_samples_left():
    images = np.zeros((8, 3, 2, 2), np.uint8)
    labels = np.full(8, -1, np.int64)
    # part 0 (rows 0-3) skipped one sample: wrote rows 0-2; part 1 (rows 4-7) wrote rows 4-7
    for r in range(3):
        images[r], labels[r] = r + 1, r + 1
    for r in range(4, 8):
        images[r], labels[r] = r + 10, r + 10
    msg = join_replies([_ok(4, 4, wid=1), _ok(0, 3, skipped=[42], wid=0)], images, labels)
    assert msg[0] == "ok" and msg[5] == 7 and msg[6] == [42] and msg[7] == ["k42"] and msg[-1] == 0
    assert labels[:7].tolist() == [1, 2, 3, 14, 15, 16, 17]
    assert [int(images[r, 0, 0, 0]) for r in range(7)] == [1, 2, 3, 14, 15, 16, 17]


def test_join_reports_the_first_failed_part():
    err = ("error", 1, 7, 0, 3, "bad-key", "DecodeError: x", "tb", {}, None, 4)
    err0 = ("error", 0, 7, 0, 3, "first-key", "DecodeError: y", "tb", {}, None, 0)
    assert join_replies([_ok(0, 4), err], None, None) is err
    assert join_replies([err, err0], None, None) is err0


@pytest.mark.parametrize("workers", [2, 3])
def test_a_split_first_batch_with_a_skipped_sample_is_the_batch_one_worker_makes(
    cases_packed, tmp_path, workers, monkeypatch
):
    import stoker.loader.pipeline.dispatch as run_mod

    calls = []

    def small_parts(ids, n_workers):  # the cases are 14 samples: parts of 2 or more
        calls.append(split_ids(ids, n_workers, min_part=2))
        return calls[-1]

    monkeypatch.setattr(run_mod, "split_ids", small_parts)
    ds = open_dataset(cases_packed, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    n = len(ds)
    keys = [ds.key(i) for i in range(n)]
    good = []
    for i in range(n):
        try:
            good.append((i, decode_transform(ds.read(i), keys[i], "eval", None)))
        except DecodeError:
            pass
    assert 0 < len(good) < n  # the cases hold undecodable samples
    bad = set(range(n)) - {i for i, _ in good}

    def first_part(seed):
        return set(Loader(ds, n, num_workers=0, seed=seed).plan(0)[: n // workers].tolist())

    seed = next(s for s in range(100) if bad & first_part(s))
    with Loader(ds, n, num_workers=workers, transform="eval", seed=seed, run=RunOptions(on_error="skip")) as loader:
        plan = loader.plan(0)  # a skipped sample in the first part: the rows after it must close up
        ((images, labels),) = list(loader)  # one batch: every sample, split over the workers
        st = loader.stats
    kept = [int(i) for i in plan if int(i) not in bad]
    good = sorted(good, key=lambda g: kept.index(g[0]))
    assert calls and all(len(c) == workers for c in calls)  # the batch went out in parts (the next epoch's too)
    assert st.skipped == n - len(good) and sorted(st.skipped_keys) == sorted(set(keys) - {keys[i] for i, _ in good})
    assert tuple(images.shape) == (len(good), 3, 224, 224)
    assert np.array_equal(images.numpy(), np.stack([img for _, img in good]))
    assert np.array_equal(labels.numpy(), ds.labels[[i for i, _ in good]])


def test_the_joined_reply_carries_the_counters_of_the_part_that_came_last():
    images, labels = np.zeros((8, 3, 2, 2), np.uint8), np.zeros(8, np.int64)
    msg = join_replies([_ok(4, 4, wid=1), _ok(0, 4, wid=0)], images, labels)  # part at offset 0 came last
    assert msg[1] == 0 and msg[8] == {"w": 0}


@pytest.mark.parametrize("workers", [2, 3])
def test_every_part_of_a_split_batch_is_counted_in_its_epoch(packed_local, tmp_path, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path), cache_bytes=64 << 20)
    with Loader(ds, len(ds), num_workers=workers, transform="eval") as loader:  # one batch an epoch
        for epoch in range(3):
            assert sum(len(y) for _, y in loader) == len(ds)
            st = loader.stats
            # each worker decoded one part and has no later batch: its counters come with that part
            assert st.cache_hits + st.cache_misses == len(ds), (epoch, st.cache_hits, st.cache_misses)
        assert loader.history[0].origin_bytes > 0 and loader.history[2].origin_bytes == 0
