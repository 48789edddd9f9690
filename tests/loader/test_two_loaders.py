"""Two Loaders over one Dataset object (train and eval), with a node cache smaller than the
dataset so that blocks go through the loaders' staging areas. Each loader's run reads a view of
the dataset with a staging area of its own (stoker.store.blocks): closing one never deletes the
other's staged blocks. Once the second loader found the first one's staging area on the shared
Dataset, used it, and the first one's close deleted it under it (FileNotFoundError in a worker,
or blocks fetched again); see ../shared/cases/lifecycle/two-loaders-one-dataset."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import batch_ids, pack_id_dataset, sample_id
from stoker import Loader, RunOptions, open_dataset

N = 240
BLOCK = 16 << 10


@pytest.fixture(scope="module")
def id_dataset(tmp_path_factory) -> str:
    """A packed dataset of N samples of 3000 bytes, each starting with its own id in ASCII."""
    return pack_id_dataset(tmp_path_factory.mktemp("ids"), N)


def _span_bytes(ds) -> int:
    """Bytes of every shard from its first block's start to its last block's end: an epoch that
    fetches each block once, some with merged GETs (which also read the tar headers between
    blocks), reads at most this from the origin."""
    total = 0
    for s in np.unique(ds.blocks.shard):
        mine = ds.blocks.shard == s
        total += int(ds.blocks.end[mine].max() - ds.blocks.start[mine].min())
    return total


def test_closing_one_of_two_loaders_over_one_dataset_leaves_the_other_whole(id_dataset, tmp_path):
    ds = open_dataset(id_dataset, cache_dir=str(tmp_path / "cache"), cache_bytes=48 << 10, block_bytes=BLOCK)
    floor = _span_bytes(ds)
    assert int((ds.blocks.end - ds.blocks.start).sum()) > 4 * (48 << 10)  # most blocks go through staging
    train = Loader(ds, 16, num_workers=2, seed=1, decode=sample_id, run=RunOptions(timeout_s=60))
    ev = Loader(
        ds, 16, num_workers=2, seed=9, decode=sample_id, transform="eval", shuffle=False, run=RunOptions(timeout_s=60)
    )
    try:
        # epoch 0: both at once, batch by batch
        it_t, it_e = iter(train), iter(ev)
        got_t, got_e = [], []
        for bt, be in zip(it_t, it_e, strict=True):
            got_t += batch_ids(bt)
            got_e += batch_ids(be)
        assert got_t == [int(i) for i in train.plan(0)] and got_e == [int(i) for i in ev.plan(0)]
        assert ds.reader.staging is None  # the shared Dataset is never given a loader's staging area
        # epoch 1: eval stops half-way and is closed while train is mid-epoch; train finishes it
        it_t, it_e = iter(train), iter(ev)
        got_t = []
        for k, (bt, _) in enumerate(zip(it_t, it_e, strict=False)):
            got_t += batch_ids(bt)
            if k == 3:
                break
        ev.close()
        got_t += [v for b in it_t for v in batch_ids(b)]
        assert got_t == [int(i) for i in train.plan(1)]
        assert train.stats.exactly_once
        assert train.stats.origin_bytes <= floor, (train.stats.origin_bytes, floor)  # no block fetched twice
        assert train.stats.direct_reads == 0  # no staged block deleted under a read that needed it
        # epoch 2, the eval loader gone: still every sample once, each block from the origin at most once
        got_t = [v for b in train for v in batch_ids(b)]
        assert got_t == [int(i) for i in train.plan(2)]
        assert train.stats.origin_bytes <= floor and train.stats.direct_reads == 0
    finally:
        ev.close()
        train.close()
    assert ds.reader.staging is None
    assert not [p for p in (tmp_path / "cache" / ".staging").glob("*/*/*")]  # both removed their own
