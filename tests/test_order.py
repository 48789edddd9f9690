"""Epoch order: registered permutations are permutations; ranks get equal counts, every sample once."""

import numpy as np
import pytest

from stoker.order import PERMUTATIONS, permutation, rank_plan


@pytest.mark.parametrize("name", sorted(PERMUTATIONS))
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_registered_orders_are_permutations(name, n):
    for seed in (0, 1):
        for epoch in (0, 3):
            p = permutation(n, seed, epoch, name)
            assert p.dtype == np.int64
            assert np.array_equal(np.sort(p), np.arange(n))


@pytest.mark.parametrize("window", [1, 3, 16])
def test_blockwise_order_keeps_windows_of_blocks_together(window):
    groups = np.repeat(np.arange(40), 7)  # 40 blocks of 7 samples
    p = permutation(len(groups), 5, 1, "blockwise", groups=groups, window=window, ramp=False)
    assert np.array_equal(np.sort(p), np.arange(len(groups)))
    # each window of the sequence draws from exactly `window` blocks (the last maybe fewer)
    per = window * 7
    for start in range(0, len(p), per):
        blocks = set(groups[p[start : start + per]].tolist())
        assert len(blocks) == min(window, 40 - start // 7)
    assert not np.array_equal(p, permutation(len(groups), 5, 2, "blockwise", groups=groups, window=window, ramp=False))


def test_permutation_is_pure_and_varies():
    a = permutation(500, 7, 2)
    assert np.array_equal(a, permutation(500, 7, 2))
    assert not np.array_equal(a, permutation(500, 7, 3))
    assert not np.array_equal(a, permutation(500, 8, 2))


@pytest.mark.parametrize("n,world", [(100, 1), (100, 4), (101, 4), (7, 3), (1000, 8), (5, 8)])
@pytest.mark.parametrize("seed,epoch", [(0, 0), (3, 5)])
def test_rank_split_pad(n, world, seed, epoch):
    perm = permutation(n, seed, epoch)
    plans = [rank_plan(perm, r, world, "pad") for r in range(world)]
    counts = {len(p) for p in plans}
    assert counts == {-(-n // world)}  # equal per rank, by construction
    allids = np.concatenate(plans)
    assert set(allids.tolist()) == set(range(n))  # every sample at least once
    dup = len(allids) - n
    assert 0 <= dup < world  # only the pad repeats
    if n % world == 0:
        assert len(np.unique(allids)) == len(allids)  # exactly once


@pytest.mark.parametrize("n,world", [(100, 4), (101, 4), (7, 3)])
def test_rank_split_drop(n, world):
    perm = permutation(n, 0, 1)
    plans = [rank_plan(perm, r, world, "drop") for r in range(world)]
    assert {len(p) for p in plans} == {n // world}
    allids = np.concatenate(plans)
    assert len(np.unique(allids)) == len(allids)  # never twice


def test_rank_split_errors():
    with pytest.raises(ValueError):
        rank_plan(np.arange(4), 4, 4)
    with pytest.raises(ValueError):
        rank_plan(np.arange(4), 0, 2, "bogus")
    with pytest.raises(KeyError):
        permutation(3, 0, 0, "nope")


@pytest.mark.parametrize("window", [1, 4, 50])
def test_cache_aware_order_serves_hits_first_within_windows(window):
    from stoker.order import cache_aware, mean_displacement

    plan = permutation(200, 3, 0)
    hit = np.random.default_rng(1).random(200) < 0.4
    out = cache_aware(plan, hit, window)
    assert sorted(out.tolist()) == sorted(plan.tolist())  # a permutation of the plan
    pos = {int(s): i for i, s in enumerate(plan)}
    hit_of = {int(s): bool(h) for s, h in zip(plan, hit)}
    for start in range(0, 200, window):
        chunk = out[start : start + window].tolist()
        flags = [hit_of[s] for s in chunk]
        assert flags == sorted(flags, reverse=True)  # hits, then misses
        assert set(chunk) == set(plan[start : start + window].tolist())  # nothing leaves its window
        hits = [s for s in chunk if hit_of[s]]
        assert hits == sorted(hits, key=pos.get)  # stable
    d = mean_displacement(plan, out)
    assert (d == 0.0) == (window == 1)
    assert d < window


def test_sample_stream_covers_each_epoch_once_across_ranks_and_works_as_a_torch_sampler():
    import torch
    from stoker.order import SampleStream

    n, world = 103, 4
    streams = [SampleStream(n, seed=9, order="uniform", rank=r, world_size=world, even="drop") for r in range(world)]
    for epoch in range(2):
        parts = [list(s) for s in streams]
        assert {len(p) for p in parts} == {n // world}
        flat = sorted(i for p in parts for i in p)
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(n))
        assert all(s.epoch == epoch + 1 for s in streams)
    assert list(streams[0]) != parts[0]  # a new permutation each epoch
    dl = torch.utils.data.DataLoader(list(range(n)), batch_size=10, sampler=SampleStream(n, seed=1, order="uniform"))
    assert sorted(int(v) for b in dl for v in b) == list(range(n))
    with pytest.raises(ValueError):
        SampleStream(n, rank=4, world_size=4)
    s = SampleStream(n, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({**s.state_dict(), "seed": 2})


def test_sample_stream_refuses_a_state_without_its_configuration():
    from stoker.order import SampleStream

    s = SampleStream(100, seed=1)
    it = iter(s)
    for _ in range(7):
        next(it)
    trimmed = {"epoch": s.state_dict()["epoch"], "position": s.state_dict()["position"]}
    other = SampleStream(100, seed=2)
    with pytest.raises(ValueError, match="lacks seed, order, window"):
        other.load_state_dict(trimmed)
    with pytest.warns(RuntimeWarning, match="lacks seed"):
        other.load_state_dict(trimmed, strict=False)
    assert other.state_dict()["position"] == 7
