"""Derived-sample cache: forms, entries, the budgeted shared store, the loader path, auto choice."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from stoker.decode import decode_image
from stoker.decode.choose import _fidelity_rank, choose_form, measure_forms
from stoker.decode.forms import HEADER_BYTES, SAME, EntryError, Form, make_entry, parse_form, read_entry, resolution_cap
from stoker.decode.transforms import eval_transform, train_transform
from stoker.loader import ImageOptions, Loader, ReadOptions
from stoker.loader.derived import DerivedCache, transform_image
from stoker.order import sample_seed
from stoker.store.dataset import open_dataset


@pytest.fixture(scope="module")
def photos(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    return [(i, ds.read(i)) for i in range(12)]


def _img(data):
    return decode_image(data, "k")


def test_parse_form_names_and_errors():
    assert parse_form("raw") == Form("raw")
    assert parse_form("jpeg") == Form("jpeg", resolution_cap(224))
    assert parse_form("jpeg256q80").name == "jpeg256q80" and parse_form("rgb").side == 0
    assert parse_form("rgb256").name == "rgb256"
    for bad in ("png", "jpeg8", "rawq90", "rgb256q80", "jpeg256q0", ""):
        with pytest.raises(ValueError, match="form"):
            parse_form(bad)


def test_resolution_cap_monotone_and_documented():
    assert resolution_cap(224, 0.25) < resolution_cap(224, 0.5) < resolution_cap(224, 0.75)
    assert resolution_cap(224, 0.5) == 320 and resolution_cap(224, 0.5) % 8 == 0
    assert resolution_cap(112, 0.5) < resolution_cap(224, 0.5)


@pytest.mark.parametrize("name", ["jpeg256", "rgb256", "rgb"])
def test_entry_roundtrip(photos, name):
    form = parse_form(name)
    img = _img(photos[0][1])
    kind, hw, got = read_entry(form, make_entry(form, img))
    assert hw == img.shape[:2] and kind == form.kind
    h, w = form.stored_hw(*img.shape[:2])
    assert got.shape == (h, w, 3) and min(h, w) <= (form.side or min(img.shape[:2]))
    if name == "rgb":
        assert np.array_equal(got, img)


def test_jpeg_entry_within_cap_is_same(photos):
    img = _img(photos[0][1])
    form = Form("jpeg", max(img.shape[:2]) + 8)
    entry = make_entry(form, img)
    assert len(entry) == HEADER_BYTES and read_entry(form, entry)[0] == SAME


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "kind"])
def test_damaged_entry_detected(photos, damage):
    form = parse_form("jpeg256")
    entry = bytearray(make_entry(form, _img(photos[0][1])))
    if damage == "truncate":
        entry = entry[: len(entry) // 2]
    elif damage == "flip":
        entry[-10] ^= 0xFF
    elif damage == "header":
        entry[:4] = b"XXXX"
    with pytest.raises(EntryError):
        read_entry(parse_form("rgb256") if damage == "kind" else form, bytes(entry))


def test_reduced_transform_equals_full_at_full_size(photos):
    img = _img(photos[1][1])
    a = train_transform(img, np.random.default_rng(3))
    b = transform_image(img, img.shape[:2], "train", np.random.default_rng(3), 224)
    assert np.array_equal(a, b)
    assert np.array_equal(eval_transform(img), transform_image(img, img.shape[:2], "eval", None, 224))


def test_reduced_transform_close_to_full(photos):
    """The cap loses detail, not geometry: same crop box, small mean difference."""
    for _, data in photos[:6]:
        img = _img(data)
        small = read_entry(parse_form("rgb256"), make_entry(parse_form("rgb256"), img))[2]
        for seed in range(4):
            full = transform_image(img, img.shape[:2], "train", np.random.default_rng(seed), 224)
            red = transform_image(small, img.shape[:2], "train", np.random.default_rng(seed), 224)
            assert np.abs(full.astype(int) - red).mean() < 8


def _store(tmp_path, cap=1 << 30, form="jpeg256"):
    return DerivedCache(str(tmp_path / "derived"), cap, form, "v1")


def test_store_hit_miss_and_namespace(tmp_path, photos):
    st = _store(tmp_path)
    assert st.get(0, "a/0") is None and st.stats.misses == 1
    assert st.put(0, "a/0", _img(photos[0][1]))
    kind, hw, img = st.get(0, "a/0")
    assert kind == "jpeg" and st.stats.hits == 1
    other = DerivedCache(st.root, 1 << 30, "jpeg256", "v2")  # another dataset version: never served
    assert other.get(0, "a/0") is None
    assert DerivedCache(st.root, 1 << 30, "rgb256", "v1").get(0, "a/0") is None  # another form


def test_budget_never_exceeded(tmp_path, photos):
    imgs = [_img(d) for _, d in photos]
    one = len(make_entry(parse_form("jpeg256"), imgs[0]))
    cap = 3 * one
    st = _store(tmp_path, cap)
    stored = [st.put(i, f"k{i}", img) for i, img in enumerate(imgs)]
    assert 1 <= sum(stored) < len(imgs) and st.stats.refused >= 1
    on_disk = sum(e.stat().st_size for e in os.scandir(os.path.dirname(st.path(0))))
    assert on_disk <= cap and st.used_bytes() <= cap


def _writer(root, cap, ids, imgs, start):
    st = DerivedCache(root, cap, "rgb256", "v1")
    while time.monotonic() < start:
        pass
    for i in ids:
        st.put(i, f"k{i}", imgs[i % len(imgs)])


def test_concurrent_writers_share_budget(tmp_path, photos):
    imgs = [_img(d) for _, d in photos[:4]]
    root = str(tmp_path / "derived")
    one = len(make_entry(parse_form("rgb256"), imgs[0]))
    cap = 10 * one
    ctx = mp.get_context("fork")
    start = time.monotonic() + 0.3
    procs = [
        ctx.Process(target=_writer, args=(root, cap, list(range(k, 40, 2)) + [0, 1], imgs, start)) for k in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    st = DerivedCache(root, cap, "rgb256", "v1")
    ns = os.path.dirname(st.path(0))
    names = os.listdir(ns)
    assert not [n for n in names if n.startswith(".tmp-")]
    assert sum(os.path.getsize(os.path.join(ns, n)) for n in names) <= cap
    for n in names:  # every committed entry is whole
        read_entry(st.form, open(os.path.join(ns, n), "rb").read())
    assert st.used_bytes() <= cap


def _slow_writer(root, imgs):
    st = DerivedCache(root, 1 << 30, "rgb", "v1")
    i = 0
    while True:
        st.put(i, f"k{i}", imgs[i % len(imgs)])
        i += 1


def test_sigkilled_writer_leaves_no_damage(tmp_path, photos):
    imgs = [_img(d) for _, d in photos[:4]]
    root = str(tmp_path / "derived")
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_slow_writer, args=(root, imgs))
    p.start()
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    st = DerivedCache(root, 1 << 30, "rgb", "v1")
    st.recover()
    ns = os.path.dirname(st.path(0))
    names = os.listdir(ns)
    assert names and not [n for n in names if n.startswith(".tmp-")]
    for n in names:
        read_entry(st.form, open(os.path.join(ns, n), "rb").read())
    assert st.used_bytes() == sum(os.path.getsize(os.path.join(ns, n)) for n in names)


def test_corrupt_entry_logged_with_key_and_dropped(tmp_path, photos, caplog):
    st = _store(tmp_path)
    st.put(5, "cls/img-5", _img(photos[0][1]))
    with open(st.path(5), "r+b") as f:
        f.truncate(HEADER_BYTES + 10)
    with caplog.at_level(logging.WARNING, logger="stoker.loader.derived"):
        assert st.get(5, "cls/img-5") is None
    assert "cls/img-5" in caplog.text and st.path(5) in caplog.text
    assert st.stats.corrupt == 1 and not os.path.exists(st.path(5))


def _epoch_arrays(loader):
    imgs, labels = [], []
    for x, y in loader:
        imgs.append(x.numpy().copy())
        labels.append(y.numpy().copy())
    return np.concatenate(imgs), np.concatenate(labels)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_fills_then_decodes_from_derived(tmp_path, packed_local, workers):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30)
    kw = dict(batch_size=16, num_workers=workers, seed=1, shuffle=False, read=ReadOptions(prefetch_next_epoch=False))
    with Loader(ds, **kw) as plain:
        want0, _ = _epoch_arrays(plain)
    with Loader(ds, **kw, image=ImageOptions(cache_form="jpeg256", cache_form_bytes=1 << 30)) as lo:
        got0, _ = _epoch_arrays(lo)
        assert np.array_equal(got0, want0)  # misses: the raw path, byte-identical
        assert lo.stats.derived_fills == len(ds) and lo.stats.derived_hits == 0
        # corrupt one entry: it is detected, read raw and written again
        der = lo.cfg.derived
        with open(der.path(3), "r+b") as f:
            f.seek(-20, os.SEEK_END)
            f.write(b"\0" * 20)
        got1, _ = _epoch_arrays(lo)
        assert lo.stats.derived_hits == len(ds) - 1 and lo.stats.derived_fills == 1
    form = der.form
    for sid in (0, 7, 3):
        kind, hw, img = read_entry(form, open(der.path(sid), "rb").read())
        rng = np.random.default_rng(sample_seed(1, 1, sid))
        expect = transform_image(img, hw, "train", rng, 224)
        if sid == 3:  # the damaged entry was served raw in epoch 1
            expect = train_transform(decode_image(ds.read(3), "k"), np.random.default_rng(sample_seed(1, 1, 3)))
        assert np.array_equal(got1[sid], expect)


def test_measure_forms_pixel_fields(photos):
    r = measure_forms([d for _, d in photos[:6]], ("jpeg256", "rgb"), min_seconds=0.01)
    assert set(r["forms"]) == {"raw", "jpeg256", "rgb"}
    assert r["forms"]["rgb"]["pixel_max"] == 0  # uncapped pixels: exactly the raw path
    j = r["forms"]["jpeg256"]
    assert 0 < j["pixel_mad"] < 8 and j["bytes_per_sample"] < r["forms"]["raw"]["bytes_per_sample"]


def test_auto_choice_and_zero_budget(tmp_path, packed_local):
    ds = open_dataset(packed_local, cache_dir=str(tmp_path / "cache"), cache_bytes=1 << 30)
    r = choose_form(ds, workers=2, capacity_bytes=1 << 30, root=str(tmp_path / "d"), samples=8, min_seconds=0.01)
    assert r["choice"] in r["forms"] and r["raw_source"] == "cache"
    for row in r["forms"].values():
        assert row["rate_per_core"] <= min(row["decode_per_core"], row["storage_per_core"]) * 1.0001 or row["fit"] < 1
    top = max(v["rate_per_core"] for v in r["forms"].values())
    assert r["rate_per_core"] * r["min_gain"] >= top  # within min_gain of the fastest ...
    order = sorted(r["forms"], key=_fidelity_rank)  # ... and the most faithful such form
    assert all(r["forms"][k]["rate_per_core"] * r["min_gain"] < top for k in order[: order.index(r["choice"])])
    with Loader(
        ds,
        16,
        num_workers=0,
        image=ImageOptions(cache_form="auto", cache_form_bytes=0, cache_form_dir=str(tmp_path / "d")),
    ) as lo:
        next(iter(lo))
        assert lo.cache_form_report["choice"] == "raw" and lo.cfg.derived is None


def test_loader_rejects_unknown_form(packed_local):
    ds = open_dataset(packed_local, cache_dir=None)
    with pytest.raises(ValueError, match="unknown sample form 'webp'"):
        Loader(ds, 4, image=ImageOptions(cache_form="webp"))
