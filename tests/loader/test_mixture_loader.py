"""A Loader over a 3-source mixture (weights 0.6 / 0.3 / 0.1, the third source smaller than its
share): per-epoch counts within one batch of the weights, equal batches on 2 and 4 ranks, each
source's samples exactly once within its share (the small one each twice), the origin's bytes,
per-source figures, a mid-epoch resume that gives the identical rest (also 4 ranks -> 2), and
the states of another mixture, or of a loader over one dataset, refused."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from _helpers import pack_id_dataset
from stoker import Loader, mix, open_dataset

SOURCES = (("web", 120, 3000), ("code", 60, 2000), ("books", 10, 1000))  # name, samples, bytes each
WEIGHTS = [0.6, 0.3, 0.1]
BS = 4


def fields(fields, rng):
    """A ``decode=``: the sample's packed id and its payload bytes (a batch is one source's)."""
    return {"id": np.array([fields["__id__"]], np.int64), "bytes": np.frombuffer(fields["bin"], np.uint8).copy()}


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture")
    return [pack_id_dataset(root / name, n, size=size, shard_bytes=64 << 10) for name, n, size in SOURCES]


def _mixture(urls, tmp_path, weights=WEIGHTS, **kw):
    dss = [open_dataset(u, cache_dir=str(tmp_path / "cache"), cache_bytes=32 << 20, block_bytes=16 << 10) for u in urls]
    return mix(dss, weights=weights, names=[s[0] for s in SOURCES], **kw)


def _batches(loader, limit=None, it=None):
    """(source index, packed ids) of each batch yielded (of ``it``, an iterator of ``loader`` kept
    open by the caller, when given), the source told by the payload length."""
    by_len = {size: s for s, (_, _, size) in enumerate(SOURCES)}
    out = []
    for batch in loader if it is None else it:
        out.append((by_len[batch["bytes"].shape[1]], batch["id"].reshape(-1).tolist()))
        if limit is not None and len(out) == limit:
            break
    return out


def _loaders(m, world, **kw):
    return [
        Loader(m, batch_size=BS, rank=r, world_size=world, num_workers=0, decode=fields, seed=3, **kw)
        for r in range(world)
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_a_mixture_over_ranks_keeps_the_weights_equal_batches_and_exactly_once_within_each_share(urls, tmp_path, world):
    m = _mixture(urls, tmp_path)
    loaders = _loaders(m, world)
    try:
        got = [_batches(ld) for ld in loaders]
        assert len({len(g) for g in got}) == 1  # equal batches per rank
        for ld, g in zip(loaders, got, strict=True):  # every batch is the plan's (source, ids)
            assert [(s, ids.tolist()) for s, ids in ld.plan(0)] == g
        chunks = len(loaders[0].epoch_mix(0).source)
        pad = -(-chunks // world) * world - chunks  # even="pad": the first chunks again, to even the ranks
        served = sorted(j for ld in loaders for j in ld.chunks(0).tolist())
        assert served == sorted(list(range(chunks)) + list(range(pad)))
        plan = loaders[0].epoch_mix(0)
        times = collections.Counter()
        for j in range(chunks):  # the epoch itself, without the pad chunks
            s, ids = plan.chunk(j)
            times.update((s, i) for i in ids.tolist())
        total = chunks * BS
        for s, (name, n, _) in enumerate(SOURCES):
            count = sum(c for (src, _), c in times.items() if src == s)
            assert abs(count - WEIGHTS[s] * total) <= BS, name  # within one batch of its weight
            per = {c for (src, _), c in times.items() if src == s}
            assert per == ({1} if count <= n else {count // n}), name  # once within its share; books twice
            assert len({i for (src, i) in times if src == s}) == min(n, count)
        delivered = collections.Counter((s, i) for g in got for s, ids in g for i in ids)
        assert all(delivered[k] >= c for k, c in times.items())
        assert sum(delivered.values()) == (chunks + pad) * BS
    finally:
        for ld in loaders:
            ld.close()


def test_bytes_come_from_each_sources_origin_and_stats_are_per_source(urls, tmp_path):
    m = _mixture(urls, tmp_path)
    origins = [open_dataset(u, cache=False) for u in urls]
    with Loader(m, batch_size=BS, num_workers=2, decode=fields, seed=1) as loader:
        seen = set()
        for batch in loader:
            for sid, data in zip(batch["id"].reshape(-1).tolist(), batch["bytes"].numpy(), strict=True):
                s = [size for _, _, size in SOURCES].index(len(data))
                if s not in seen or sid % 7 == 0:
                    assert data.tobytes() == origins[s].read(sid), (s, sid)
                    seen.add(s)
        assert seen == {0, 1, 2}
        cold = loader.stats
        assert set(cold.sources) == {"web", "code", "books"} and cold.exactly_once
        assert cold.sources["books"]["samples"] == 20 and cold.sources["web"]["samples"] == 120
        assert all(v["origin_bytes"] > 0 for v in cold.sources.values())
        assert cold.samples == sum(v["samples"] for v in cold.sources.values())
        for _ in loader:  # a warm epoch: every source from its own node cache
            pass
        warm = loader.stats
        assert warm.epoch == 1 and all(v["origin_bytes"] == 0 for v in warm.sources.values())
        assert all(v["cache_hit_ratio"] == 1.0 for v in warm.sources.values())


@pytest.mark.parametrize("resume_world", [4, 2])
def test_a_mid_epoch_resume_gives_the_identical_rest_also_from_4_ranks_to_2(urls, tmp_path, resume_world):
    m = _mixture(urls, tmp_path)
    full = _loaders(m, 4)
    whole = [_batches(ld) for ld in full]
    for ld in full:
        ld.close()
    first = _loaders(m, 4)
    k = 5
    its = [iter(ld) for ld in first]  # open: an iteration ended early moves the stream to the next epoch
    for ld, it in zip(first, its, strict=True):
        _batches(ld, limit=k, it=it)
    state = first[0].state_dict()
    assert all(ld.state_dict() == state for ld in first)  # the job's state, the same on every rank
    assert state["batches_done"] == k and state["samples_done"] == 4 * k
    for ld in first:
        ld.close()
    again = _loaders(_mixture(urls, tmp_path), resume_world)
    try:
        for ld in again:
            ld.load_state_dict(state)
        rest = [_batches(ld) for ld in again]
    finally:
        for ld in again:
            ld.close()
    assert len({len(r) for r in rest}) == 1  # equal batches per rank
    if resume_world == 4:
        assert rest == [w[k:] for w in whole]  # batch for batch
    else:  # split again over 2 ranks: exactly the chunks not yet served (and pads, the first chunks)
        plan = again[0].epoch_mix(0)
        owed = list(range(4 * k, len(plan.source)))
        pad = -(-len(owed) // resume_world) * resume_world - len(owed)
        want = collections.Counter(
            (s, i) for j in owed + list(range(pad)) for s in [plan.chunk(j)[0]] for i in plan.chunk(j)[1].tolist()
        )
        have = collections.Counter((s, i) for r in rest for s, ids in r for i in ids)
        assert have == want
        after_k = collections.Counter((s, i) for w in whole for s, ids in w[k:] for i in ids)
        owed_only = collections.Counter((plan.chunk(j)[0], i) for j in owed for i in plan.chunk(j)[1].tolist())
        assert not (owed_only - after_k)  # what the 4-rank run served after batch k, no sample more


def test_a_state_of_another_mixture_or_of_one_dataset_is_refused(urls, tmp_path):
    m = _mixture(urls, tmp_path)
    with Loader(m, batch_size=BS, num_workers=0, decode=fields) as loader:
        it = iter(loader)
        _batches(loader, limit=3, it=it)
        state = loader.state_dict()
    other = _mixture(urls, tmp_path, weights=[0.5, 0.4, 0.1])
    with Loader(other, batch_size=BS, num_workers=0, decode=fields) as loader:
        with pytest.raises(ValueError, match="another mixture: weights"):
            loader.load_state_dict(state)
    swapped = _mixture(list(reversed(urls)), tmp_path)
    with Loader(swapped, batch_size=BS, num_workers=0, decode=fields) as loader:
        with pytest.raises(ValueError, match="another mixture: source 0 has url="):
            loader.load_state_dict(state)
    plain = open_dataset(urls[0], cache=False)
    with Loader(plain, batch_size=BS, num_workers=0, decode=fields) as single:
        with pytest.raises(ValueError, match=r"saved by a loader over a mixture of \[.*stoker.mix"):
            single.load_state_dict(state)
        with Loader(m, batch_size=BS, num_workers=0, decode=fields) as loader:
            with pytest.raises(ValueError, match="not saved by a loader over a mixture"):
                loader.load_state_dict(single.state_dict())


def test_take_warns_naming_the_small_source_and_serves_what_it_has(urls, tmp_path):
    m = _mixture(urls, tmp_path, small="take")
    with pytest.warns(RuntimeWarning, match=r"'books' .* has 10 samples, under its share of 20"):
        loader = Loader(m, batch_size=BS, num_workers=0, decode=fields)
    with loader:
        got = _batches(loader)
        books = [i for s, ids in got if s == 2 for i in ids]
        assert len(books) == 8 and len(set(books)) == 8  # two whole batches of its 10, once each
