"""One resume state for the whole job: every rank saves the same state, any rank of any world size
continues it, and the rest of the epoch is served exactly once (checked from the sample ids the
decode saw, not from the loader's counters)."""

import collections
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from stoker import Loader, ReadOptions, open_dataset
from stoker.order import permutation, rank_plan

SEED = 7


def _sample_id(fields, rng):
    """A user decode that returns the id of the sample it read."""
    return np.int64(fields["__id__"])


def _loader(ds, rank, world_size, batch_size=8, even="pad", num_workers=0, **kw):
    return Loader(
        ds,
        batch_size=batch_size,
        seed=SEED,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        decode=_sample_id,
        read=ReadOptions(even=even),
        **kw,
    )


def _ids(batch) -> list[int]:
    return [int(x) for x in batch]


def _cut(ds, world_size, batches, **kw):
    """``world_size`` loaders (ranks) of one job, each stopped after ``batches`` batches of epoch
    0: (ids they were served, each rank's state_dict)."""
    served, states = [], []
    for rank in range(world_size):
        loader = _loader(ds, rank, world_size, **kw)
        it = iter(loader)
        for _ in range(batches):
            served.extend(_ids(next(it)))
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    return served, states


def _resume(ds, state, world_size, num_workers=0, **kw):
    """The rest of epoch 0 on ``world_size`` ranks given ``state``: the ids each rank is served,
    without the padding repeats (``padding_mask``), and the batches per rank."""
    ids, counts = [], []
    for rank in range(world_size):
        loader = _loader(ds, rank, world_size, num_workers=num_workers, **kw)
        loader.load_state_dict(state)
        assert loader.epoch == 0
        mine = [i for b in loader for i in _ids(b)]
        mask = loader.padding_mask(0)[-len(mine) :] if mine else []  # a resumed epoch: its last batches
        ids.extend(i for i, pad in zip(mine, mask, strict=True) if not pad)
        counts.append(len(mine))
        assert loader.epoch == 1
        loader.close()
    return ids, counts


@pytest.mark.parametrize(
    "batch_size, batches, new_world, workers",
    [(8, 3, 1, 0), (8, 3, 3, 0), (7, 2, 3, 0), (7, 2, 1, 0), (5, 5, 4, 0), (7, 2, 3, 2)],
)
def test_two_rank_checkpoint_resumes_at_any_world_size(packed_local, batch_size, batches, new_world, workers):
    ds = open_dataset(packed_local, cache=False)
    served, states = _cut(ds, 2, batches, batch_size=batch_size)
    assert states[0] == states[1]  # one state for the job
    assert len(served) == len(set(served)) == 2 * batches * batch_size
    rest, counts = _resume(ds, states[0], new_world, num_workers=workers, batch_size=batch_size)
    assert len(set(counts)) == 1  # every rank the same number of samples (even="pad")
    # the epoch's every sample exactly once: what the two ranks had, plus the rest
    assert collections.Counter(served + rest) == collections.Counter(range(len(ds)))


def test_resume_at_another_world_size_with_even_drop(packed_local):
    ds = open_dataset(packed_local, cache=False)
    served, states = _cut(ds, 2, 2, batch_size=7, even="drop")
    rest, counts = _resume(ds, states[0], 3, batch_size=7, even="drop")
    assert len(set(counts)) == 1
    owed = len(ds) - len(served)
    assert len(rest) == owed // 3 * 3  # a remainder of fewer than 3 ids is dropped, as at the start
    assert len(set(served + rest)) == len(served) + len(rest)
    perm = permutation(len(ds), SEED, 0, "blockwise", groups=ds.blocks.sample_block, window=16)
    assert set(rest) == set(perm[len(served) : len(served) + len(rest)].tolist())


def test_rank_zero_state_resumes_rank_one_batch_for_batch(packed_local):
    """Lightning and accelerate save rank 0's state and load it on every rank: rank 1 then
    continues its own stream, identical to an uninterrupted run."""
    ds = open_dataset(packed_local, cache=False)
    whole = _loader(ds, 1, 2)
    ref = [_ids(b) for b in whole]
    whole.close()
    _, states = _cut(ds, 2, 3)
    rank1 = _loader(ds, 1, 2)
    rank1.load_state_dict(states[0])
    assert [_ids(b) for b in rank1] == ref[3:]
    rank1.close()


def test_state_is_global(packed_local):
    ds = open_dataset(packed_local, cache=False)
    _, states = _cut(ds, 3, 2, batch_size=6)
    assert states[0] == states[1] == states[2]
    assert states[0]["samples_done"] == 2 * 6 * 3 and states[0]["epoch"] == 0
    assert "rank" not in states[0]


def test_old_per_rank_state_is_read_with_a_warning(packed_local):
    ds = open_dataset(packed_local, cache=False)
    _, states = _cut(ds, 2, 3)
    old = {k: v for k, v in states[0].items() if k not in ("samples_done",)}
    old.update(batches_done=3, rank=1, world_size=2)
    rank1 = _loader(ds, 1, 2)
    with pytest.warns(DeprecationWarning, match="per-rank"):
        rank1.load_state_dict(old)
    assert rank1.state_dict() == states[0]
    rank1.close()


def test_resume_names_what_differs(packed_local):
    ds = open_dataset(packed_local, cache=False)
    _, states = _cut(ds, 2, 1)
    with pytest.raises(ValueError, match="seed"):
        Loader(ds, batch_size=8, seed=SEED + 1, num_workers=0).load_state_dict(states[0])
    with pytest.raises(ValueError, match="samples_done"):
        _loader(ds, 0, 1).load_state_dict(dict(states[0], samples_done=len(ds) + 1))


def test_padding_mask_marks_the_repeats(packed_local):
    """120 samples on 7 ranks: 6 padding repeats, each the last of a rank's epoch."""
    ds = open_dataset(packed_local, cache=False)
    ids, pads = [], 0
    for rank in range(7):
        loader = _loader(ds, rank, 7)
        mine = [i for b in loader for i in _ids(b)]
        mask = loader.padding_mask(0)
        assert mask.sum() <= 1 and (not mask.any() or mask[-1])
        pads += int(mask.sum())
        ids.extend(i for i, p in zip(mine, mask, strict=True) if not p)
        loader.close()
    assert pads == 7 * 18 - 120
    assert sorted(ids) == list(range(len(ds)))


def test_rank_plan_start_is_the_rest_of_the_plan():
    perm = np.random.default_rng(0).permutation(103)
    for w in (1, 2, 3, 5):
        for even in ("pad", "drop"):
            for k in (0, 1, 7, 20):
                for r in range(w):
                    assert np.array_equal(rank_plan(perm, r, w, even, k * w), rank_plan(perm, r, w, even)[k:])


def test_rank_and_world_size_from_the_environment(packed_local, monkeypatch):
    ds = open_dataset(packed_local, cache=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = Loader(ds, batch_size=8, num_workers=0)
    assert (loader.rank, loader.world_size) == (2, 3)
    assert len(loader.plan(0)) == 40
    loader.close()
    explicit = Loader(ds, batch_size=8, num_workers=0, rank=1, world_size=2)
    assert (explicit.rank, explicit.world_size) == (1, 2)
    explicit.close()


def test_world_size_one_in_a_group_warns_once(packed_local, monkeypatch):
    from stoker.loader import world as ranks

    ds = open_dataset(packed_local, cache=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(ranks, "_warned", False)
    with pytest.warns(UserWarning, match="world_size=1 .* 2 ranks"):
        Loader(ds, batch_size=8, num_workers=0, world_size=1).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = Loader(ds, batch_size=8, num_workers=0, world_size=1)  # once per process
        assert loader.rank == 0
        loader.close()


def test_no_environment_means_one_rank(packed_local, monkeypatch):
    ds = open_dataset(packed_local, cache=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = Loader(ds, batch_size=8, num_workers=0)
    assert (loader.rank, loader.world_size) == (0, 1)
    loader.close()


def test_bad_environment_is_named(packed_local, monkeypatch):
    ds = open_dataset(packed_local, cache=False)
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        Loader(ds, batch_size=8, num_workers=0)


_GROUP_CHILD = """
import json, os, sys
import torch.distributed as dist
from stoker import Loader, open_dataset
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=sys.argv[3], rank=rank, world_size=2)
ds = open_dataset(sys.argv[1], cache=False)
loader = Loader(ds, batch_size=8, num_workers=0, seed=3)
ids = [int(i) for i in loader.plan(0)]
out = [None, None]
dist.all_gather_object(out, ids)
print(json.dumps({"rank": loader.rank, "world_size": loader.world_size, "ids": ids, "all": out}))
dist.destroy_process_group()
"""


def test_loader_takes_rank_and_world_size_from_an_initialised_process_group(packed_local, tmp_path):
    """Two processes in a gloo group, no RANK/WORLD_SIZE in their environment and no rank
    arguments: each reads its half of the epoch."""

    pytest.importorskip("torch.distributed")
    init = f"file://{tmp_path}/rendezvous"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GROUP_CHILD, packed_local, str(r), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [(o["rank"], o["world_size"]) for o in outs] == [(0, 2), (1, 2)]
    halves = outs[0]["all"]
    assert [len(h) for h in halves] == [60, 60]
    assert sorted(halves[0] + halves[1]) == list(range(120))


class _OwnPlan(Loader):
    """A loader whose plan is its own (as the cluster's co-located plan is): not re-split."""

    def plan(self, epoch=None):
        return super().plan(epoch)


def test_a_plan_of_its_own_is_not_split_again(packed_local):
    ds = open_dataset(packed_local, cache=False)
    _, states = _cut(ds, 2, 2, batch_size=7)  # 28 served: not a whole number of 3 ranks' batches
    own = _OwnPlan(ds, batch_size=7, seed=SEED, rank=0, world_size=3, num_workers=0, decode=_sample_id)
    with pytest.raises(ValueError, match="samples_done=28 .* world_size=2"):
        own.load_state_dict(states[0])
    assert own.state_dict()["samples_done"] == 0  # nothing changed
    same = _OwnPlan(ds, batch_size=7, seed=SEED, rank=1, world_size=2, num_workers=0, decode=_sample_id)
    same.load_state_dict(states[0])
    assert same.state_dict() == states[0]
    own.close()
    same.close()


def test_world_size_without_rank_in_a_job_of_another_size_is_refused(packed_local, monkeypatch):
    ds = open_dataset(packed_local, cache=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="world_size=2 without rank= in a job of 3 ranks"):
        Loader(ds, batch_size=8, num_workers=0, world_size=2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    loader = Loader(ds, batch_size=8, num_workers=0, world_size=2)  # outside a job: rank 0
    assert loader.rank == 0
    loader.close()
