"""The blockwise order's ramp-up at epoch start: small first windows, the same kind of order after.

Shuffle quality is compared with the order without the ramp by two measures:
- the Shannon entropy of the labels in each batch (bits), averaged over batches: a batch drawn
  from few blocks of a class-sorted layout has low entropy;
- the mean distance between a sample's position in the epoch and its position in storage, the
  measure mlx-data's documentation uses to compare shuffles (``mlx.data.Stream.shuffle``).
"""

import numpy as np
import pytest

from stoker.order import SampleStream, permutation, ramp_windows, rank_plan


def _label_entropy(labels: np.ndarray, batch: int) -> float:
    out = []
    for i in range(0, len(labels) - batch + 1, batch):
        _, counts = np.unique(labels[i : i + batch], return_counts=True)
        p = counts / counts.sum()
        out.append(float(-(p * np.log2(p)).sum()))
    return float(np.mean(out))


def test_ramp_windows_grow_1_2_4_8_then_the_window():
    w = ramp_windows(40, 16)
    sizes = np.bincount(w).tolist()
    assert sizes == [1, 2, 4, 8, 16, 9]
    assert np.bincount(ramp_windows(10, 3)).tolist() == [1, 2, 3, 3, 1]
    assert ramp_windows(5, 1).tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(ramp_windows(40, 16, ramp=False), np.arange(40) // 16)
    with pytest.raises(ValueError):
        ramp_windows(3, 0)


@pytest.mark.parametrize("n_blocks,window", [(1, 16), (3, 16), (40, 16), (100, 4)])
def test_ramped_order_is_a_pure_permutation_and_its_first_window_is_one_block(n_blocks, window):
    groups = np.repeat(np.arange(n_blocks), 7)
    p = permutation(len(groups), 3, 1, "blockwise", groups=groups, window=window)
    assert np.array_equal(np.sort(p), np.arange(len(groups)))
    assert np.array_equal(p, permutation(len(groups), 3, 1, "blockwise", groups=groups, window=window))
    assert len(set(groups[p[:7]].tolist())) == 1  # the first 7 samples come from one block
    # windows (by the ramp) hold exactly their blocks, in order
    sizes = np.bincount(ramp_windows(n_blocks, window))
    at = 0
    for size in sizes:
        assert len(set(groups[p[at : at + 7 * size]].tolist())) == size
        at += 7 * size


def test_ramp_keeps_rank_splits_even_and_resume_identical():
    groups = np.repeat(np.arange(30), 5)
    s = SampleStream(len(groups), 4, groups=groups, rank=1, world_size=3)
    whole = list(s)
    assert whole == rank_plan(permutation(len(groups), 4, 0, "blockwise", groups=groups), 1, 3).tolist()
    s2 = SampleStream(len(groups), 4, groups=groups, rank=1, world_size=3)
    it = iter(s2)
    head = [next(it) for _ in range(7)]
    state = s2.state_dict()
    s3 = SampleStream(len(groups), 4, groups=groups, rank=1, world_size=3)
    s3.load_state_dict(state)
    assert head + list(s3) == whole


def test_ramp_costs_little_shuffle_quality():
    # 200 blocks of 12 samples; a class-sorted layout (the worst case for a blockwise order)
    # and a packed layout (stoker pack shuffles samples across shards)
    n_blocks, per, classes, batch = 200, 12, 20, 64
    groups = np.repeat(np.arange(n_blocks), per)
    sorted_labels = np.repeat(np.arange(classes), n_blocks * per // classes)
    packed_labels = np.random.default_rng(0).permutation(sorted_labels)
    for labels in (sorted_labels, packed_labels):
        ent_ramp, ent_flat, disp_ramp, disp_flat = [], [], [], []
        for epoch in range(5):
            a = permutation(len(groups), 0, epoch, "blockwise", groups=groups, ramp=True)
            b = permutation(len(groups), 0, epoch, "blockwise", groups=groups, ramp=False)
            ent_ramp.append(_label_entropy(labels[a], batch))
            ent_flat.append(_label_entropy(labels[b], batch))
            disp_ramp.append(np.abs(a - np.arange(len(a))).mean())
            disp_flat.append(np.abs(b - np.arange(len(b))).mean())
        assert np.mean(ent_ramp) >= 0.95 * np.mean(ent_flat)
        assert np.mean(disp_ramp) >= 0.95 * np.mean(disp_flat)
