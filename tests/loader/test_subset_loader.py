"""A Loader over a subset or a split part of a packed dataset keeps every guarantee: each selected
sample exactly once per epoch (its bytes the origin's), an exact mid-epoch resume that refuses a
state of another subset, ranks that split the subset, and reads of only the blocks that hold
its samples."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import batch_ids, pack_id_dataset, sample_id
from stoker import Loader, open_dataset
from stoker.loader.workers.padding import probe_order

N = 60
SIZE = 3000


def payload(fields, rng):
    """A ``decode=``: the sample's packed id (its bytes start with it) and its payload bytes."""
    data = fields["bin"]
    return {"id": np.array([int(data.split(b".")[0])], np.int64), "bytes": np.frombuffer(data, np.uint8).copy()}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    """``N`` samples of ``SIZE`` bytes, in blocks of five samples (16 KiB blocks)."""
    return pack_id_dataset(tmp_path_factory.mktemp("subset-loader"), N, size=SIZE, shard_bytes=64 << 10)


def _open(url, tmp_path):
    return open_dataset(url, cache_dir=str(tmp_path / "cache"), cache_bytes=32 << 20, block_bytes=16 << 10)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_over_a_subset_yields_each_selected_sample_once_with_the_origin_bytes(url, tmp_path, num_workers):
    ds = _open(url, tmp_path)
    train, val = ds.split([0.75, 0.25], seed=3)
    origin = open_dataset(url, cache=False)
    for part in (val, train):
        with Loader(part, batch_size=4, num_workers=num_workers, decode=payload, seed=1) as loader:
            got = []
            for batch in loader:
                for sid, data in zip(batch["id"].reshape(-1).tolist(), batch["bytes"].numpy(), strict=True):
                    assert data.tobytes() == origin.read(sid), sid
                    got.append(sid)
            assert sorted(got) == part.selection.tolist() and len(got) == len(part)
            assert loader.stats.exactly_once
            assert "samples=15, subset_of=60" in repr(loader) or part is train


def test_a_mid_epoch_resume_over_a_subset_is_exact_and_another_subsets_state_is_refused(url, tmp_path):
    ds = _open(url, tmp_path)
    train, val = ds.split([0.5, 0.5], seed=11)
    other_val = ds.split([0.5, 0.5], seed=12)[1]  # as many samples as train, other ones
    kw = dict(batch_size=4, num_workers=0, decode=sample_id, seed=5)
    with Loader(train, **kw) as full:
        whole_epoch = [batch_ids(b) for b in full]
    with Loader(train, **kw) as first:
        it = iter(first)
        head = [batch_ids(next(it)) for _ in range(3)]
        state = first.state_dict()
    assert state["subset"] == train.selection_digest
    with Loader(train, **kw) as again:
        again.load_state_dict(state)
        rest = [batch_ids(b) for b in again]
    assert head + rest == whole_epoch
    for other in (val, other_val, ds):
        with Loader(other, **kw) as wrong, pytest.raises(ValueError, match="saved by a loader over a subset of 30"):
            wrong.load_state_dict(state)
    with Loader(train, **kw) as whole_state, pytest.raises(ValueError, match="over the whole dataset"):
        whole_state.load_state_dict(Loader(ds, **kw).state_dict())
    # a state of an earlier release has no "subset": it was a whole dataset's, and still resumes one
    with Loader(ds, **kw) as before:
        old = {k: v for k, v in before.state_dict().items() if k != "subset"}
    with Loader(ds, **kw) as now:
        now.load_state_dict(old)
    with Loader(train, **kw) as sub, pytest.raises(ValueError, match="over the whole dataset"):
        sub.load_state_dict(old)


def test_two_ranks_split_a_subset(url, tmp_path):
    ds = _open(url, tmp_path)
    sub = ds.subset(lambda t: t["sample_id"].to_numpy() % 3 != 0)  # 40 samples
    served = []
    for rank in range(2):
        with Loader(sub, batch_size=4, rank=rank, world_size=2, num_workers=0, decode=sample_id) as loader:
            mine = [i for b in loader for i in batch_ids(b)]
            assert mine == loader.plan(0).tolist()
            served.append(mine)
    assert len(served[0]) == len(served[1]) == 20
    assert sorted(served[0] + served[1]) == sub.selection.tolist()


def test_only_the_blocks_of_the_subsets_samples_are_read_from_the_origin(url, tmp_path):
    ds = _open(url, tmp_path)
    assert len(ds.blocks) >= 10
    blocks = ds.blocks.sample_block
    wanted = {0, 7}  # the only blocks the subset needs: the first and one in the middle
    sub = ds.subset(np.flatnonzero(np.isin(blocks, list(wanted))).astype(np.int64)[1:])
    need = set(blocks[sub.selection].tolist())
    assert need == wanted
    with Loader(sub, batch_size=3, num_workers=2, decode=sample_id) as loader:
        got = sorted(i for b in loader for i in batch_ids(b))
        stats = loader.stats
    assert got == sub.selection.tolist()
    cached = set(np.flatnonzero(ds.blocks.cached(ds.cache, ds.version)).tolist())
    assert cached <= need, f"blocks with no selected sample were fetched: {sorted(cached - need)}"
    assert 0 < stats.origin_bytes <= int(ds.blocks.nbytes(np.array(sorted(need))).sum())


def test_substitutes_of_a_subset_come_from_the_subset():
    pool = np.array([2, 5, 11, 17, 23, 40], dtype=np.int64)
    tried = list(probe_order(seed=1, epoch=0, ids=[5, 11], num_samples=1000, pool=pool))
    assert sorted(tried) == [2, 17, 23, 40]
