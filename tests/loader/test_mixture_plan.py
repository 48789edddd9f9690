"""The mixture's epoch plan alone (stoker.loader.mixture, no I/O): counts within one batch of the
weights, exactly once within each share, even repeats of a source smaller than its share, the
same plan for the same (seed, epoch), and an interleaving whose every prefix keeps the weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.loader.mixture import epoch_chunks, interleave, mix_epoch, source_ids
from stoker.order import interleaved_shares

plans = st.tuples(
    st.lists(st.integers(1, 400), min_size=1, max_size=5),  # sizes
    st.lists(st.floats(0.01, 10.0), min_size=5, max_size=5),  # weights (cut to the sources)
    st.integers(1, 16),  # batch size
    st.integers(0, 2**31 - 1),  # seed
    st.integers(0, 50),  # epoch
)


def _case(sizes, weights, bs):
    w = weights[: len(sizes)]
    big = int(np.argmax(np.asarray(w) / sum(w)))
    sizes = list(sizes)
    sizes[big] = max(sizes[big], bs)  # the largest-weight source holds a batch (else ValueError)
    return sizes, w


@settings(max_examples=150, deadline=None)
@given(plans, st.sampled_from(["repeat", "take"]))
def test_counts_follow_the_weights_within_one_batch_and_each_share_is_served_exactly_once(case, small):
    sizes, weights, bs, seed, epoch = case
    sizes, w = _case(sizes, weights, bs)
    plan = mix_epoch(sizes, w, bs, seed, epoch, small=small)
    counts = plan.counts()
    total = len(mix_epoch(sizes, w, bs, seed, epoch).source) * bs  # the epoch before any source is cut
    share = np.asarray(w) / sum(w)
    for s, n in enumerate(sizes):
        ids = plan.ids[s]
        assert ids.min(initial=0) >= 0 and ids.max(initial=-1) < n
        times = np.bincount(ids, minlength=n)
        if counts[s] <= n:
            assert times.max(initial=0) <= 1  # exactly once within its share
        else:  # repeated: each sample floor or ceil(count / size) times
            assert small == "repeat" and times.min() == counts[s] // n and times.max() <= -(-counts[s] // n)
        if small == "repeat" or all(c != s for c, _, _ in plan.short):
            assert abs(counts[s] - share[s] * total) <= bs  # within one batch of its weight
    big = int(np.argmax(share))
    assert counts[big] <= sizes[big]  # the default epoch reads the largest-weight source once at most
    for s, want, has in plan.short:
        assert small == "take" and want > has and counts[s] == has // bs * bs


@settings(max_examples=100, deadline=None)
@given(plans)
def test_the_plan_is_a_pure_function_of_seed_and_epoch_and_chunks_cover_each_source(case):
    sizes, weights, bs, seed, epoch = case
    sizes, w = _case(sizes, weights, bs)
    a, b = mix_epoch(sizes, w, bs, seed, epoch), mix_epoch(sizes, w, bs, seed, epoch)
    assert np.array_equal(a.source, b.source) and all(np.array_equal(x, y) for x, y in zip(a.ids, b.ids, strict=True))
    for s in range(len(sizes)):  # the chunks of a source are its ids, in order, each once
        got = [a.chunk(j)[1] for j in range(len(a.source)) if a.source[j] == s]
        joined = np.concatenate(got) if got else np.zeros(0, np.int64)
        assert np.array_equal(joined, a.ids[s])
        assert all(len(x) == bs for x in got)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=6), st.integers(0, 1000), st.integers(0, 20))
def test_every_prefix_of_the_interleaving_keeps_each_sources_weight_within_its_bound(chunks, seed, epoch):
    """Within ``1 + S * w`` chunks (mixture.py's docstring; ``S`` sources with chunks, ``w`` the
    source's weight). Hypothesis found ``[1, 0, 1, 1, 13]`` 2.06 chunks off: three small sources
    whose phases all fall early delay the large one by up to one chunk each."""
    src = interleave(chunks, seed, epoch)
    assert np.array_equal(np.bincount(src, minlength=len(chunks)), chunks)
    total = sum(chunks)
    if not total:
        return
    sources = sum(1 for c in chunks if c)
    for s, c in enumerate(chunks):
        seen = np.cumsum(src == s)
        ideal = np.arange(1, total + 1) * c / total
        assert np.abs(seen - ideal).max() <= 1 + sources * c / total + 1e-9


@settings(max_examples=60, deadline=None)
@given(plans, st.integers(1, 8), st.sampled_from(["pad", "drop"]))
def test_ranks_get_equal_chunks_and_their_union_is_the_epoch(case, world, even):
    sizes, weights, bs, seed, epoch = case
    sizes, w = _case(sizes, weights, bs)
    plan = mix_epoch(sizes, w, bs, seed, epoch)
    m = len(plan.source)
    shares = interleaved_shares(np.arange(m), world, even)
    mine = [shares.plan(r) for r in range(world)]
    assert len({len(x) for x in mine}) == 1  # equal batches per rank
    union = np.sort(np.concatenate(mine))
    if even == "pad":
        assert set(union.tolist()) == set(range(m))  # every chunk served (a few twice, to even)
    else:
        assert len(union) == m // world * world and len(set(union.tolist())) == len(union)


def test_source_ids_repeat_evenly_and_a_bad_mixture_is_refused_by_name():
    ids = source_ids(10, 25, seed=1, epoch=0, source=2)
    assert sorted(np.bincount(ids, minlength=10).tolist()) == [2] * 5 + [3] * 5
    with pytest.raises(ValueError, match="3 weights for 2 sources"):
        epoch_chunks([10, 10], [0.5, 0.3, 0.2], 4)
    with pytest.raises(ValueError, match="weight 1 must be a positive"):
        epoch_chunks([10, 10], [0.5, 0.0], 4)
    with pytest.raises(ValueError, match="small must be one of"):
        epoch_chunks([10, 10], [0.5, 0.5], 4, small="cycle")
    with pytest.raises(ValueError, match="source 0 .* under one batch"):
        epoch_chunks([3, 100], [0.9, 0.1], 4)
    assert epoch_chunks([3, 100], [0.9, 0.1], 4, samples_per_epoch=40)[0].tolist() == [9, 1]
