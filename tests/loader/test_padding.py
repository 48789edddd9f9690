"""Every rank yields the same number of batches under on_error="skip" (loader/workers/padding.py): a batch
whose every sample was skipped is yielded with substitutes, counted in stats.padded, never as
delivered samples; one that gets no substitute is a WorkerError saying the dataset looks unreadable.
A loader of one rank yields no such batch instead: every sample that decodes exactly once."""

from __future__ import annotations

import io

import numpy as np
import pytest

from _helpers import make_image_folder
from stoker import Loader, RunOptions, WorkerError, open_dataset
from stoker.decode import decode_transform, jpeg
from stoker.loader import ImageOptions
from stoker.loader.workers.padding import PAD_FIELD, probe_limit, probe_order
from stoker.order import sample_seed
from stoker.store.pack import pack

N = 32
BATCH = 4
#: Undecodable samples. Without shuffle rank 0 of 2 gets ids 0, 2, 4, ...: its batch 0 and batch 2
#: are undecodable whole, its batch 3 has one bad sample; rank 1 has none.
BAD = {0, 2, 4, 6, 16, 18, 20, 22, 26}
SIZE = 32


def make_ranked_dataset(root, cases_dir, n: int = N, bad=BAD) -> str:
    """A packed one-class ImageFolder of ``n`` small photos-like JPEGs, sample id i = file i, where
    the ids in ``bad`` hold the shared cases' truncated JPEG (a real broken file)."""
    from PIL import Image

    broken = (cases_dir / "pillow-jpeg" / "truncated_jpeg.jpg").read_bytes()
    rng = np.random.default_rng(0)
    files = {}
    for i in range(n):
        if i in bad:
            files[f"src/c/{i:03d}.jpg"] = broken
            continue
        img = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        files[f"src/c/{i:03d}.jpg"] = buf.getvalue()
    make_image_folder(root, files)
    pack(str(root / "src"), str(root / "packed"), progress=False)
    ds = open_dataset(str(root / "packed"), cache=False)
    assert [ds.key(i) for i in range(n)] == [f"c/{i:03d}" for i in range(n)]
    return str(root / "packed")


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, cases_dir) -> str:
    return make_ranked_dataset(tmp_path_factory.mktemp("ranked"), cases_dir)


def user_decode(fields, rng):
    """A custom decode (stoker.decode.jpeg raises DecodeError on the truncated file) that keeps
    the sample's id and whether it is a substitute."""
    return {
        "x": jpeg(fields, SIZE, "random", rng=rng),
        "id": fields["__id__"],
        "pad": fields.get(PAD_FIELD, False),
    }


def _small_parts(ids, n_workers):
    from stoker.loader.pipeline.split import split_ids

    return split_ids(ids, n_workers, min_part=2)  # the first batch (4 samples) in parts of 2


def _epoch(path, rank, workers, kind, monkeypatch):
    """(the batches of epoch 0 of rank ``rank`` of 2, the loader's len, its stats)."""
    monkeypatch.setattr("stoker.loader.pipeline.dispatch.split_ids", _small_parts)
    ds = open_dataset(path, cache=False)
    kw = dict(decode=user_decode) if kind == "user" else dict(image=ImageOptions(image_size=SIZE))
    with Loader(
        ds,
        BATCH,
        shuffle=False,
        seed=5,
        rank=rank,
        world_size=2,
        num_workers=workers,
        run=RunOptions(on_error="skip", timeout_s=60),
        **kw,
    ) as loader:
        batches = []
        for b in loader:
            if kind == "user":
                batches.append({k: np.asarray(v).copy() for k, v in b.items()})
            else:
                batches.append((b[0].numpy().copy(), b[1].numpy().copy()))
        return batches, len(loader), loader.stats


@pytest.mark.parametrize("kind", ["builtin", "user"])
@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_yield_the_same_number_of_batches(ranked, cases_dir, workers, kind, monkeypatch):
    ds = open_dataset(ranked, cache=False)
    got = {r: _epoch(ranked, r, workers, kind, monkeypatch) for r in (0, 1)}
    (b0, len0, st0), (b1, len1, st1) = got[0], got[1]
    assert len(b0) == len(b1) == len0 == len1 == N // 2 // BATCH  # the same count on both ranks
    assert st0.batches == st1.batches == len(b0)

    # rank 1 read no bad sample: every planned sample once, nothing padded
    assert st1.skipped == st1.padded == 0 and st1.exactly_once and st1.samples == N // 2
    # rank 0: batches 0 and 2 skipped whole and padded to their planned size, batch 3 one short
    plan0 = np.arange(0, N, 2)
    assert st0.skipped == len(BAD) and sorted(st0.skipped_keys) == sorted(ds.key(i) for i in BAD)
    assert st0.samples == len(plan0) - len(BAD)  # substitutes are not delivered samples
    assert st0.padded == 2 * BATCH and len(st0.padded_keys) == 2 * BATCH
    assert st0.exactly_once  # every planned sample that decodes once; the 9 others are in skipped
    padded_ids = [int(k.split("/")[1]) for k in st0.padded_keys]
    assert not set(padded_ids) & BAD
    for j in (0, 1):  # the substitutes of one batch are distinct and none of its planned samples
        assert len(set(padded_ids[j * 4 : j * 4 + 4])) == 4
    if kind == "user":
        sizes = [len(b["id"]) for b in b0]
        assert sizes == [4, 4, 4, 3]
        assert b0[0]["id"].tolist() + b0[2]["id"].tolist() == padded_ids  # the substitutes, in order
        assert [bool(p) for b in b0 for p in b["pad"]] == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 3
        assert b0[1]["id"].tolist() == [8, 10, 12, 14] and b0[3]["id"].tolist() == [24, 28, 30]
        assert not any(p for b in b1 for p in b["pad"])
        for b in (b0[0], b0[2]):  # each substitute augmented from its own seed, as any sample is
            for sid, x in zip(b["id"].tolist(), b["x"], strict=True):
                rng = np.random.default_rng(sample_seed(5, 0, sid))
                assert np.array_equal(x, jpeg(ds.read_fields(sid, meta=True), SIZE, "random", rng=rng))
    else:
        assert [len(y) for _, y in b0] == [4, 4, 4, 3]
        for (x, y), ids in ((b0[0], padded_ids[:4]), (b0[2], padded_ids[4:])):
            want = [
                decode_transform(ds.read(i), ds.key(i), "train", np.random.default_rng(sample_seed(5, 0, i)), size=SIZE)
                for i in ids
            ]
            assert np.array_equal(x, np.stack(want)) and np.array_equal(y, ds.labels[ids])


def test_substitutes_are_the_same_for_any_worker_count_and_decode(ranked, cases_dir, monkeypatch):
    """Chosen from (seed, epoch, the batch's ids) on the whole batch: the split first batch of
    two workers gets the substitutes one process picks."""
    keys = {(w, k): _epoch(ranked, 0, w, k, monkeypatch)[2].padded_keys for w in (0, 2) for k in ("builtin", "user")}
    assert len(set(map(tuple, keys.values()))) == 1, keys


def test_a_batch_with_no_decodable_substitute_says_the_dataset_looks_unreadable(tmp_path, cases_dir):
    path = make_ranked_dataset(tmp_path, cases_dir, n=6, bad=set(range(6)))
    ds = open_dataset(path, cache=False)
    for workers in (0, 2):
        for kw in ({}, {"decode": user_decode}):
            with Loader(
                ds, 2, shuffle=False, num_workers=workers, rank=0, world_size=2, run=RunOptions(on_error="skip"), **kw
            ) as loader:
                with pytest.raises(WorkerError, match="looks unreadable") as info:
                    list(loader)
            assert "c/000" in str(info.value) and "epoch 0" in str(info.value)


def test_substitutes_fill_the_batch_past_bad_probes(tmp_path, cases_dir):
    """Most of the dataset bad: the substitutes that decode fill the batch; the bad ones tried are
    not counted as skipped (they are not samples of the batch)."""
    bad = set(range(20)) - {3, 11, 17}
    path = make_ranked_dataset(tmp_path, cases_dir, n=20, bad=bad)
    ds = open_dataset(path, cache=False)
    # rank 0 of 2 plans the even ids: 0-6, 8-14, 16-18, every one bad
    with Loader(ds, 4, shuffle=False, num_workers=0, rank=0, world_size=2, run=RunOptions(on_error="skip")) as loader:
        sizes = [len(y) for _, y in loader]
        st = loader.stats
    assert len(sizes) == len(loader) == 3 and st.batches == 3
    assert st.skipped == 10 and st.samples == 0 and st.exactly_once
    # each batch padded with every good sample of the dataset (3), the last up to its planned 2
    assert sizes == [3, 3, 2] and st.padded == 8
    assert set(st.padded_keys) == {"c/003", "c/011", "c/017"} and len(st.padded_keys) == 8


@pytest.mark.parametrize("kind", ["builtin", "user"])
@pytest.mark.parametrize("workers", [0, 2])
def test_one_rank_drops_a_batch_whose_every_sample_is_skipped(tmp_path, cases_dir, workers, kind, monkeypatch):
    """``world_size=1``: no rank to keep level, so no substitutes: a batch whose every sample is
    skipped is not yielded (the first one too, decoded in parts by two workers), each sample that
    decodes is delivered once, and ``exactly_once`` holds over them."""
    monkeypatch.setattr("stoker.loader.pipeline.dispatch.split_ids", _small_parts)
    bad = set(range(20)) - {5, 11, 17}  # batches 0 (0-3) and 3 (12-15) bad whole
    path = make_ranked_dataset(tmp_path, cases_dir, n=20, bad=bad)
    ds = open_dataset(path, cache=False)
    kw = dict(decode=user_decode) if kind == "user" else dict(image=ImageOptions(image_size=SIZE))
    with Loader(
        ds, 4, shuffle=False, num_workers=workers, world_size=1, run=RunOptions(on_error="skip", timeout_s=60), **kw
    ) as loader:
        for epoch in range(2):
            got = [b["id"].tolist() if kind == "user" else b[1].tolist() for b in loader]
            st = loader.stats
            if kind == "user":
                assert got == [[5], [11], [17]]
            else:
                assert got == [[int(ds.labels[i])] for i in (5, 11, 17)]
            assert len(loader) == 5 and st.batches == 3 and st.epoch == epoch
            assert st.samples == 3 and st.skipped == 17 and st.padded == 0 and st.padded_keys == []
            assert st.exactly_once


def test_probe_order_is_a_pure_function_of_the_batch_and_leaves_it_out():
    a = list(probe_order(1, 0, [5, 9], 100))
    assert a == list(probe_order(1, 0, [5, 9], 100))
    assert sorted(a) == sorted(set(range(100)) - {5, 9})  # every other sample once
    assert a != list(probe_order(1, 1, [5, 9], 100)) and a != list(probe_order(2, 0, [5, 9], 100))
    for seed in range(20):  # consecutive tries far apart: not a walk through a run of bad neighbours
        b = list(probe_order(seed, 0, [], 100))
        assert min(min(abs(x - y), 100 - abs(x - y)) for x, y in zip(b, b[1:], strict=False)) >= 20
    assert list(probe_order(0, 0, [0], 1)) == [] and list(probe_order(0, 0, [], 1)) == [0]
    assert probe_limit(4) == 64 and probe_limit(256) == 1024


def test_substitutes_are_counted_in_the_live_figures_and_prometheus(ranked):
    """``padded`` reaches the live figures (stoker top's file) and ``stoker_padded_samples_total``,
    equal to the loader's stats."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    ds = open_dataset(ranked, cache=False)
    with Loader(
        ds,
        BATCH,
        shuffle=False,
        seed=5,
        rank=0,
        world_size=2,
        num_workers=0,
        image=ImageOptions(image_size=SIZE),
        run=RunOptions(on_error="skip", timeout_s=60, metrics_port=0),
    ) as loader:
        for _ in loader:
            pass
        st = loader.stats
        page = urllib.request.urlopen(loader.metrics_url, timeout=10).read().decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(page) for s in fam.samples}
    assert st.padded == 2 * BATCH
    assert values["stoker_padded_samples_total"] == st.padded
    assert values["stoker_skipped_samples_total"] == st.skipped
