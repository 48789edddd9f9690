"""Property-based tests (Hypothesis) over the sizes users meet: 0-64 samples, world size 1-64,
batch size, ``drop_last``, ``even``, 0-2 workers.

At the order level (:mod:`stoker.order`) and at the Loader level they check that every rank
gets the same count (by construction, so DDP never waits on a rank that ran out), that the
statistics tell the truth about what was delivered, and that resume lands exactly where the
saved run stopped, also across epochs that deliver nothing (0 samples, or fewer samples than
ranks with ``drop_last``).

Loader-level datasets are tiny PNGs (one flat colour per sample, so every delivered image names
its sample), packed once per session; the 0-sample dataset is an index written directly,
because ``stoker pack`` refuses an empty source. One dataset holds samples that are not images,
read with ``on_error="skip"`` (as every dataset here) to check the statistics of skips.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stoker.order import PERMUTATIONS, SampleStream, permutation, rank_plan

#: The packed datasets: name -> (samples, numbers of the samples that no decoder reads).
DATASETS = {**{str(n): (n, ()) for n in (0, 1, 2, 3, 5, 8, 13, 64)}, "7-bad": (7, (0, 3, 4))}
ORDERS = sorted(PERMUTATIONS)
EPOCHS = 3
QUICK = settings(max_examples=150, deadline=None)


def _colour(i: int) -> int:
    return (i * 37) % 256  # 37 is odd: distinct for i < 256


# -- order level -------------------------------------------------------------------------


@QUICK
@given(
    n=st.integers(0, 64),
    world=st.integers(1, 64),
    even=st.sampled_from(["pad", "drop"]),
    order=st.sampled_from(ORDERS),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 1000),
)
def test_rank_plans_have_equal_counts_and_cover_the_permutation(n, world, even, order, seed, epoch):
    perm = permutation(n, seed, epoch, order)
    assert np.array_equal(np.sort(perm), np.arange(n))
    plans = [rank_plan(perm, r, world, even) for r in range(world)]
    want = -(-n // world) if even == "pad" else n // world
    assert [len(p) for p in plans] == [want] * world  # equal by construction
    got = np.bincount(np.concatenate(plans), minlength=n) if n else np.zeros(0, np.int64)
    if even == "pad":
        assert (got >= 1).all()  # every sample read
        assert got.sum() - n < world  # only the pad repeats
        assert n == 0 or got.max() - got.min() <= 1  # repeats spread evenly
    else:
        assert (got <= 1).all() and got.sum() == want * world  # never twice


def _save_points(ref: list) -> list:
    """Event indices ``k`` at which a run can save its state after ``ref[:k]``: before an
    ``iter()`` (before an ("epoch", e) marker, or after the last event) or after an item."""
    return [k for k in range(len(ref) + 1) if k in (0, len(ref)) or ref[k][0] == "epoch" or ref[k - 1][0] != "epoch"]


def _resumed(ref: list, k: int) -> list:
    """What a run restored from the state saved after ``ref[:k]`` must yield: the rest, its first
    ``iter()`` continuing the saved epoch (marked by that epoch's ("epoch", e) again)."""
    if k < len(ref) and ref[k][0] != "epoch":
        return [next(x for x in reversed(ref[:k]) if x[0] == "epoch")] + ref[k:]
    return ref[k:]


def _stream_run(stream: SampleStream, stop: int | None = None):
    """Iterate ``stream`` epoch by epoch until its epoch reaches EPOCHS. Returns (events,
    state): events ("epoch", e) before each ``iter()`` and ("id", i) for each id; with ``stop``
    the state saved after ``stop`` events (a point of :func:`_save_points`)."""
    events: list = []
    while stream.epoch < EPOCHS:
        if len(events) == stop:
            return events, stream.state_dict()
        events.append(("epoch", stream.epoch))
        for i in stream:
            events.append(("id", i))
            if len(events) == stop:
                return events, stream.state_dict()
    return events, (stream.state_dict() if len(events) == stop else None)


@QUICK
@given(
    n=st.integers(0, 64),
    world=st.integers(1, 64),
    even=st.sampled_from(["pad", "drop"]),
    order=st.sampled_from(ORDERS),
    seed=st.integers(0, 1000),
    cut=st.floats(0, 1, exclude_max=True),
)
def test_sample_stream_resumes_exactly_where_it_stopped(n, world, even, order, seed, cut):
    rank = seed % world
    make = lambda: SampleStream(n, seed, order=order, rank=rank, world_size=world, even=even)  # noqa: E731
    ref, _ = _stream_run(make())
    points = _save_points(ref)
    k = points[int(cut * len(points))]
    head, state = _stream_run(make(), stop=k)
    assert head == ref[:k] and state is not None
    second = make()
    second.load_state_dict(json.loads(json.dumps(state)))
    rest, _ = _stream_run(second)
    assert rest == _resumed(ref, k)  # the same ids and the same epochs, empty ones too


# -- Loader level --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_datasets(tmp_path_factory) -> dict:
    """{name: url} for DATASETS: 12x12 PNGs of one flat colour each (``_colour`` of the
    sample's number; the bad ones: bytes that are no image), 3 classes, packed; 0 samples:
    an empty index."""
    from PIL import Image

    from stoker.store.index import INDEX_NAME, build_table, table_to_bytes
    from stoker.store.pack import pack

    root = tmp_path_factory.mktemp("tiny")
    urls = {}
    for name, (n, bad) in DATASETS.items():
        dst = root / f"ds{name}"
        if n == 0:
            dst.mkdir()
            table, _ = build_table([], [], [], [], [], [], [], [], [])
            (dst / INDEX_NAME).write_bytes(table_to_bytes(table))
        else:
            for i in range(n):
                d = root / f"src{name}" / f"c{i % 3}"
                d.mkdir(parents=True, exist_ok=True)
                if i in bad:
                    (d / f"s{i:03d}.png").write_bytes(b"not an image")
                else:
                    Image.fromarray(np.full((12, 12, 3), _colour(i), np.uint8)).save(d / f"s{i:03d}.png")
            pack(str(root / f"src{name}"), str(dst), progress=False)
        urls[name] = str(dst)
    return urls


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny-cache"))


def _number(ds, sample_id: int) -> int:
    return int(ds.key(sample_id).rsplit("/s", 1)[1][:3])


configs = st.fixed_dictionaries(
    {
        "n": st.sampled_from(sorted(DATASETS)),
        "world": st.integers(1, 64),
        "rank_frac": st.floats(0, 1, exclude_max=True),
        "batch_size": st.integers(1, 9),
        "drop_last": st.booleans(),
        "even": st.sampled_from(["pad", "drop"]),
        "order": st.sampled_from(ORDERS),
        "seed": st.integers(0, 1000),
        "cut": st.floats(0, 1, exclude_max=True),
        "cap": st.one_of(st.none(), st.integers(0, 4)),
    }
)


def _loader(urls, cache_dir, cfg, workers, ds=None, rank=None):
    from stoker import ImageOptions, Loader, ReadOptions, RunOptions, open_dataset

    ds = ds or open_dataset(urls[cfg["n"]], cache_dir=cache_dir, cache_bytes=64 << 20)
    return Loader(
        ds,
        batch_size=cfg["batch_size"],
        num_workers=workers,
        transform="eval",
        seed=cfg["seed"],
        rank=int(cfg["rank_frac"] * cfg["world"]) if rank is None else rank,
        world_size=cfg["world"],
        drop_last=cfg["drop_last"],
        read=ReadOptions(order=cfg["order"], even=cfg["even"]),
        image=ImageOptions(image_size=8),
        run=RunOptions(timeout_s=60, on_error="skip"),
    )


def _run(loader, stop: int | None = None, cap: int | None = None):
    """Iterate until ``loader.epoch`` reaches EPOCHS, checking each epoch's statistics against
    what it delivered. Returns (events, state): ("epoch", e) per ``iter()``, ("batch", ids) per
    batch; with ``stop`` the state saved after ``stop`` events (a point of :func:`_save_points`).
    ``cap``: the consumer takes at most that many batches of an epoch (by the loader's position,
    so a resumed run cuts at the same place): it breaks on the first batch past it, unused."""
    ds, bs = loader.dataset, loader.batch_size
    colour_to_id = {_colour(_number(ds, s)): s for s in range(len(ds))}
    bad = {s for s in range(len(ds)) if _number(ds, s) in DATASETS[os.path.basename(ds.url)[2:]][1]}
    events: list = []
    while loader.epoch < EPOCHS:
        if len(events) == stop:
            return events, loader.state_dict()
        epoch, first_iter, start = loader.epoch, len(loader.history), loader.state_dict()["batches_done"]
        whole = loader.plan(epoch).tolist()
        planned = whole[start * bs :]
        events.append(("epoch", epoch))
        delivered, padded, yielded, done = [], [], 0, None
        for images, labels in loader:
            ids = [colour_to_id[int(c)] for c in images[:, 0, 0, 0].tolist()]
            assert labels.tolist() == [int(ds.labels[i]) for i in ids]
            assert 1 <= len(ids) <= bs
            position = loader.state_dict()
            assert position["epoch"] == epoch
            own = whole[(position["batches_done"] - 1) * bs : position["batches_done"] * bs]
            if all(i in bad for i in own):  # every sample skipped: with several ranks, substitutes (workers/padding.py)
                assert loader.world_size > 1  # one rank yields no such batch
                good = len(ds) - len(bad)  # every other sample is tried (a dataset this small)
                assert len(ids) == len(set(ids)) == min(len(own), good) and not set(ids) & bad
                padded.extend(ids)
            else:
                assert ids == [i for i in own if i not in bad]  # the plan, in order
                delivered.extend(ids)
            yielded += 1
            if cap is not None and position["batches_done"] > cap:
                done = position["batches_done"]
                break
            events.append(("batch", tuple(ids)))
            if len(events) == stop:
                return events, loader.state_dict()
        stats = loader.stats
        assert len(loader.history) == first_iter + 1 and stats is loader.history[-1]
        assert stats.epoch == epoch
        processed = planned if done is None else planned[: (done - start) * bs]
        assert delivered == [i for i in processed if i not in bad]  # the plan, in order
        assert stats.samples == len(delivered)  # substitutes are not delivered samples
        assert stats.padded == len(padded) and sorted(stats.padded_keys) == sorted(ds.key(i) for i in padded)
        assert stats.batches == yielded
        if done is None and loader.world_size > 1:  # every batch of the plan, skipped samples or not: the same count
            assert yielded == -(-len(planned) // bs)  # on every rank
        elif done is None:  # one rank: no batch whose every sample is skipped (no substitutes)
            assert yielded == sum(any(i not in bad for i in planned[j : j + bs]) for j in range(0, len(planned), bs))
        assert stats.skipped == len(processed) - len(delivered)
        assert sorted(stats.skipped_keys) == sorted(ds.key(i) for i in processed if i in bad)
        # an epoch whose plan is empty for a dataset that has samples (drop_last, more ranks than
        # samples with even="drop") delivers nothing: it says why and is not exactly once
        empty = len(loader.plan(epoch)) == 0 and len(ds) > 0
        assert bool(stats.empty_reason) == empty
        assert stats.exactly_once == (processed == planned and not empty)  # over the samples that decode
        assert loader.state_dict()["epoch"] == epoch + 1  # a cut epoch is not replayed: not on resume either
    return events, (loader.state_dict() if len(events) == stop else None)


def _check_loader(urls, cache_dir, cfg, workers):
    n, world, bs = DATASETS[cfg["n"]][0], cfg["world"], cfg["batch_size"]
    ref_loader = _loader(urls, cache_dir, cfg, workers)
    try:
        # equal counts on every rank, every epoch (the plans only: no processes)
        per_rank = {len(ref_loader.plan(e)) for e in range(EPOCHS)}
        for r in range(world):
            other = _loader(urls, cache_dir, cfg, 0, ds=ref_loader.dataset, rank=r)
            per_rank |= {len(other.plan(e)) for e in range(EPOCHS)}
        want = -(-n // world) if cfg["even"] == "pad" else n // world
        if cfg["drop_last"]:
            want -= want % bs
        assert per_rank == {want}
        assert len(ref_loader) == -(-want // bs)
        ref, _ = _run(ref_loader, cap=cfg["cap"])
    finally:
        ref_loader.close()
    points = _save_points(ref)
    k = points[int(cfg["cut"] * len(points))]
    first = _loader(urls, cache_dir, cfg, workers)
    try:
        head, state = _run(first, stop=k, cap=cfg["cap"])
    finally:
        first.close()
    assert head == ref[:k] and state is not None
    second = _loader(urls, cache_dir, cfg, workers)
    try:
        second.load_state_dict(json.loads(json.dumps(state)))
        rest, _ = _run(second, cap=cfg["cap"])
    finally:
        second.close()
    # the first iter() continues the saved epoch unless all its batches were done
    e, done = state["epoch"], state["batches_done"]
    mid = 0 < done < -(-len(second.plan(e)) // bs)
    assert rest == [("epoch", e)] * mid + ref[k:]  # the same batches and epochs, empty ones too


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=configs)
# a batch whose samples are all skipped (sequential: ids 0 and 1 are bad), and a state saved
# before an epoch that gives this rank nothing (3 samples on 8 ranks, drop)
@example(
    cfg={
        "n": "7-bad",
        "world": 1,
        "rank_frac": 0.0,
        "batch_size": 2,
        "drop_last": False,
        "even": "pad",
        "order": "sequential",
        "seed": 0,
        "cut": 0.5,
        "cap": None,
    }
)
@example(
    cfg={
        "n": "3",
        "world": 8,
        "rank_frac": 0.0,
        "batch_size": 2,
        "drop_last": False,
        "even": "drop",
        "order": "blockwise",
        "seed": 0,
        "cut": 0.5,
        "cap": None,
    }
)
# a consumer that leaves every epoch after 2 batches, saved after the cut
@example(
    cfg={
        "n": "13",
        "world": 1,
        "rank_frac": 0.0,
        "batch_size": 2,
        "drop_last": False,
        "even": "pad",
        "order": "uniform",
        "seed": 0,
        "cut": 0.4,
        "cap": 2,
    }
)
def test_loader_counts_stats_and_resume_in_process(tiny_datasets, tiny_cache, cfg):
    _check_loader(tiny_datasets, tiny_cache, cfg, 0)


@settings(
    max_examples=int(os.environ.get("STOKER_PROPERTY_WORKER_EXAMPLES", "6")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(cfg=configs, workers=st.integers(1, 2))
def test_loader_counts_stats_and_resume_with_workers(tiny_datasets, tiny_cache, cfg, workers):
    _check_loader(tiny_datasets, tiny_cache, cfg, workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_empty_and_rank_starved_epochs_resume_at_the_same_epoch(tiny_datasets, tiny_cache, workers):
    """A state saved before an epoch that delivers nothing resumes at that epoch, not the next."""
    for name, world, even in (("0", 1, "pad"), ("3", 8, "drop")):
        cfg = {
            "n": name,
            "world": world,
            "rank_frac": 0.5,
            "batch_size": 2,
            "drop_last": True,
            "even": even,
            "order": "blockwise",
            "seed": 1,
            "cut": 0.0,
            "cap": None,
        }
        loader = _loader(tiny_datasets, tiny_cache, cfg, workers)
        assert list(loader) == [] and loader.epoch == 1 and loader.stats.samples == 0
        state = loader.state_dict()
        assert (state["epoch"], state["batches_done"]) == (1, 0)
        loader.close()
        resumed = _loader(tiny_datasets, tiny_cache, cfg, workers)
        resumed.load_state_dict(state)
        assert resumed.epoch == 1
        assert list(resumed) == [] and resumed.stats.epoch == 1 and resumed.epoch == 2
        resumed.close()


# -- resume at another world size or placement (order level) ----------------------------


@QUICK
@given(
    n=st.integers(0, 80),
    world=st.integers(1, 9),
    nodes=st.integers(1, 4),
    even=st.sampled_from(["pad", "drop"]),
    seed=st.integers(0, 2**32 - 1),
    colocated=st.booleans(),
    served_frac=st.floats(0, 1),
)
def test_the_rest_of_an_epoch_splits_into_equal_shares_of_the_samples_not_served(
    n, world, nodes, even, seed, colocated, served_frac
):
    """Whatever was served before (any set), the shares of the rest give every rank the same
    count, serve each sample not served once (``drop``: all but fewer than ``world``), never one
    served before but as a marked repeat; and after k entries per rank the shares say the ranks
    served exactly the samples of those entries. Co-located shares hold the same samples as the
    interleaved ones."""
    from stoker.cluster.schedule import colocated_shares
    from stoker.order import interleaved_shares

    rng = np.random.default_rng(seed)
    perm = permutation(n, seed, 0, "uniform")
    served = rng.random(n) < served_frac
    sample_node = rng.integers(-1, nodes, n)
    rank_node = rng.integers(-1, nodes, world).tolist()
    plain = interleaved_shares(perm, world, even, served)
    shares = colocated_shares(perm, sample_node, rank_node, even, served) if colocated else plain
    owed = int((~served).sum())
    want = -(-owed // world) if even == "pad" else owed // world
    plans = [shares.plan(r) for r in range(world)]
    pads = [shares.padding(r) for r in range(world)]
    assert [len(p) for p in plans] == [want] * world
    real = np.concatenate([p[~m] for p, m in zip(plans, pads, strict=True)])
    assert len(real) == len(set(real.tolist())) and not served[real].any()
    assert (len(real) == owed) if even == "pad" else (owed - len(real) < world)
    assert all(not m.any() or m[m.argmax() :].all() for m in pads)  # the repeats come last
    assert sorted(np.concatenate(plans).tolist()) == sorted(
        np.concatenate([plain.plan(r) for r in range(world)]).tolist()
    )
    for k in {0, 1, want // 2, want}:
        got = shares.served(k)
        first = [p[:k][~m[:k]] for p, m in zip(plans, pads, strict=True)]
        expect = served.copy()
        expect[np.concatenate(first).astype(np.int64)] = True
        assert np.array_equal(got, expect)
