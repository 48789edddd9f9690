"""Region-of-interest JPEG decode (stoker.decode._jpegroi): exactly the whole-image pixels, and
the train path that uses it gives exactly what decoding the whole image first gives."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.decode import DecodeError, decode_image, decode_stats, decode_transform, train_transform
from stoker.decode import image as image_mod
from stoker.decode.image import REGION_DECODE, decode_jpeg_region, jpeg_region_size
from stoker.decode.transforms import random_resized_crop_params

needs_roi = pytest.mark.skipif(not REGION_DECODE, reason="stoker.decode._jpegroi not built (no libjpeg headers)")


def test_extension_built_where_libjpeg_headers_exist():
    """The extension is optional, but must not silently go missing on a machine that can build it."""
    if not any(Path(p, "jpeglib.h").exists() for p in ("/usr/include", "/usr/local/include")):
        pytest.skip("no jpeglib.h: the region decoder is legitimately absent")
    assert REGION_DECODE


def _photo(seed: int, size=(173, 131)) -> Image.Image:
    """A smooth-plus-texture RGB picture (chroma edges make upsampling errors visible)."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 3) % 256], -1)
    noise = rng.integers(0, 60, (h, w, 3))
    blocks = ((x // 7 + y // 5) % 2)[..., None] * np.array([90, 0, 160])
    return Image.fromarray(np.clip(base + noise + blocks, 0, 255).astype(np.uint8))


def _variants() -> list[tuple[str, bytes]]:
    out = []
    for seed, size in ((0, (173, 131)), (1, (64, 48)), (2, (500, 375)), (3, (17, 9))):
        im = _photo(seed, size)
        for ss in (0, 1, 2):  # 4:4:4, 4:2:2, 4:2:0
            for prog in (False, True):
                buf = io.BytesIO()
                im.save(buf, "JPEG", quality=88, subsampling=ss, progressive=prog)
                out.append((f"s{seed}-{size}-ss{ss}-p{int(prog)}", buf.getvalue()))
        buf = io.BytesIO()
        im.convert("L").save(buf, "JPEG", quality=90)
        out.append((f"s{seed}-gray", buf.getvalue()))
    return out


VARIANTS = _variants()
BIG_BASELINE = dict(VARIANTS)["s2-(500, 375)-ss0-p0"]  # 500x375, 4:4:4, baseline (sequential)


@needs_roi
@pytest.mark.parametrize("name,data", VARIANTS, ids=[n for n, _ in VARIANTS])
def test_region_equals_whole_image_slice(name, data):
    full = decode_image(data, name)
    hw = jpeg_region_size(data, name)
    assert hw == full.shape[:2]
    rng = np.random.default_rng(7)
    boxes = [(0, 0, hw[0], hw[1]), (hw[0] - 1, hw[1] - 1, 1, 1), (0, hw[1] // 2, hw[0], hw[1] - hw[1] // 2)]
    boxes += [random_resized_crop_params(hw[0], hw[1], rng) for _ in range(25)]
    for top, left, h, w in boxes:
        got = decode_jpeg_region(data, name, top, left, h, w)
        assert got is not None and got.shape == (h, w, 3)
        np.testing.assert_array_equal(
            got, full[top : top + h, left : left + w], err_msg=f"{name} box {top, left, h, w}"
        )


@needs_roi
def test_region_outside_image_is_a_caller_error():
    name, data = VARIANTS[0]
    h, w = jpeg_region_size(data, name)
    with pytest.raises(ValueError, match=re.escape(name)):
        decode_jpeg_region(data, name, 0, 1, h, w)
    with pytest.raises(ValueError, match=re.escape(name)):
        decode_jpeg_region(data, name, 0, 0, 0, w)


@needs_roi
@pytest.mark.parametrize("name,data", VARIANTS[:7], ids=[n for n, _ in VARIANTS[:7]])
def test_train_path_identical_to_whole_image_path(name, data):
    """decode_transform (region decode) == train_transform(decode_image(...)) with equal RNGs."""
    for seed in range(20):
        before = decode_stats()
        got = decode_transform(data, name, "train", np.random.default_rng(seed), size=64)
        assert decode_stats()["roi"] - before["roi"] == 1
        want = train_transform(decode_image(data, name), np.random.default_rng(seed), size=64)
        np.testing.assert_array_equal(got, want)


def _cases(cases_dir: Path) -> Path:
    d = cases_dir / "pillow-jpeg"
    if not d.is_dir():
        pytest.skip(f"shared cases not found at {d}")
    return d


def test_cases_train_path_matches_whole_image_path(cases_dir):
    """Every shared JPEG case through the train path: same pixels as decoding the whole file first
    (which the decode tests hold to the reference), or the same error naming the key."""
    d = _cases(cases_dir)
    for f in sorted(d.iterdir()):
        data = f.read_bytes()
        for seed in range(8):
            try:
                want = train_transform(decode_image(data, f.name), np.random.default_rng(seed), size=96)
            except DecodeError:
                with pytest.raises(DecodeError, match=f.name):
                    decode_transform(data, f.name, "train", np.random.default_rng(seed), size=96)
                continue
            got = decode_transform(data, f.name, "train", np.random.default_rng(seed), size=96)
            np.testing.assert_array_equal(got, want, err_msg=f"{f.name} seed {seed}")


@needs_roi
def test_truncated_file_refused_whatever_the_box(cases_dir):
    """A file cut short must fail for every crop, even one that lies in the part that is present."""
    data = (_cases(cases_dir) / "truncated_jpeg.jpg").read_bytes()
    assert jpeg_region_size(data, "t") is None  # no EOI marker: whole-image path
    for seed in range(10):
        with pytest.raises(DecodeError, match="shard-1/trunc"):
            decode_transform(data, "shard-1/trunc", "train", np.random.default_rng(seed))


@needs_roi
def test_cut_file_with_eoi_appended_is_refused_or_reference(cases_dir):
    """Truncated data followed by an EOI marker passes the EOI check; libjpeg then warns (premature
    end of data) inside any box that reaches the missing rows, and the whole file goes to the
    reference decoder; boxes above the cut decode from data that is present."""
    data = BIG_BASELINE
    cut = data[: len(data) * 2 // 3] + b"\xff\xd9"
    full_good = decode_image(data, "good")
    hw = jpeg_region_size(cut, "cut")
    assert hw == full_good.shape[:2]
    assert decode_jpeg_region(cut, "cut", hw[0] - 10, 0, 10, hw[1]) is None  # rows past the cut: warned
    top_rows = decode_jpeg_region(cut, "cut", 0, 0, 16, hw[1])
    np.testing.assert_array_equal(top_rows, full_good[:16])


@needs_roi
def test_corrupt_entropy_data_inside_box_falls_back(monkeypatch):
    """libjpeg warns inside the box: the whole file goes to decode_image (spied), and the result is
    what decoding the whole file first gives; boxes clear of the damage decode as regions."""
    bad = bytearray(BIG_BASELINE)
    sos = bad.find(b"\xff\xda")
    mid = sos + (len(bad) - sos) * 9 // 10  # near the bottom: boxes above it are clean
    bad[mid : mid + 40] = b"\xff\xd0" * 20  # bogus restart markers in the scan: libjpeg warns
    bad = bytes(bad)
    hw = jpeg_region_size(bad, "bad")
    assert hw is not None
    assert decode_jpeg_region(bad, "bad", 0, 0, hw[0], hw[1]) is None  # the whole image covers the damage
    calls = []
    real = image_mod.decode_image

    def spy(d, key, **kw):
        calls.append(key)
        return real(d, key, **kw)

    monkeypatch.setattr(image_mod, "decode_image", spy)
    outcomes = set()
    for seed in range(30):
        box = random_resized_crop_params(hw[0], hw[1], np.random.default_rng(seed))
        warned = decode_jpeg_region(bad, "bad", *box) is None
        calls.clear()
        got = decode_transform(bad, "bad-key", "train", np.random.default_rng(seed), size=64)
        assert calls == (["bad-key"] if warned else [])
        want = train_transform(real(bad, "bad-key"), np.random.default_rng(seed), size=64)
        # warned: Pillow decided (it decodes through corrupt data) and the box was cut from that
        np.testing.assert_array_equal(got, want)
        outcomes.add(warned)
    assert outcomes == {True, False}


def test_exif_orientation_takes_whole_image_path(cases_dir):
    """With exif_orientation=True the box is drawn on the rotated image: no region decode."""
    data = (_cases(cases_dir) / "hopper_orientation_6.jpg").read_bytes()
    before = decode_stats()
    got = decode_transform(data, "o6", "train", np.random.default_rng(3), size=64, exif_orientation=True)
    assert decode_stats()["roi"] == before["roi"]
    want = train_transform(decode_image(data, "o6", exif_orientation=True), np.random.default_rng(3), size=64)
    np.testing.assert_array_equal(got, want)


def test_without_extension_whole_image_path(monkeypatch):
    """The region decoder is optional: without it the train path decodes whole images, same pixels."""
    name, data = VARIANTS[0]
    want = decode_transform(data, name, "train", np.random.default_rng(5), size=64)
    monkeypatch.setattr(image_mod, "_jpegroi", None)
    assert jpeg_region_size(data, name) is None
    before = decode_stats()
    got = decode_transform(data, name, "train", np.random.default_rng(5), size=64)
    assert decode_stats()["roi"] == before["roi"] and decode_stats()["fast"] == before["fast"] + 1
    np.testing.assert_array_equal(got, want)


@needs_roi
@pytest.mark.parametrize("where", [0.5, 0.9, 0.99])
def test_structural_error_below_the_box_fails_every_epoch(where):
    """A second SOF marker inside a one-scan file's entropy data, below any box: the whole-image
    path refuses the file, so the region path must too, whatever box is drawn (else a sample
    would fail in some epochs and not others)."""
    import struct

    data = BIG_BASELINE
    sos = data.index(b"\xff\xda")
    scan0 = sos + 2 + struct.unpack(">H", data[sos + 2 : sos + 4])[0]
    sof = data.index(b"\xff\xc0")
    sofseg = data[sof : sof + 2 + struct.unpack(">H", data[sof + 2 : sof + 4])[0]]
    p = scan0 + int((len(data) - 2 - scan0) * where)
    while data[p - 1] == 0xFF:
        p += 1
    bad = data[:p] + sofseg + data[p:]
    with pytest.raises(DecodeError):
        decode_image(bad, "whole")
    assert jpeg_region_size(bad, "bad") is None
    for seed in range(12):
        with pytest.raises(DecodeError, match="bad-key"):
            decode_transform(bad, "bad-key", "train", np.random.default_rng(seed))


@needs_roi
def test_structure_check_accepts_restart_markers_and_multi_scan_files():
    from stoker.decode import _jpegroi

    im = _photo(4, (200, 150))
    for kw in ({"restart_marker_rows": 1}, {"restart_marker_blocks": 3}, {"progressive": True}, {}):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90, **kw)
        data = buf.getvalue()
        assert (b"\xff\xdd" in data) == any(k.startswith("restart") for k in kw)  # DRI: restart markers on
        assert _jpegroi.structure_ok(data), kw
        full = decode_image(data, "k")
        got = decode_jpeg_region(data, "k", 40, 33, 70, 90)
        np.testing.assert_array_equal(got, full[40:110, 33:123])
    assert not _jpegroi.structure_ok(BIG_BASELINE[:-2])  # no EOI
    assert not _jpegroi.structure_ok(b"")
    assert not _jpegroi.structure_ok(b"\xff\xd8\xff\xd9")  # no scan at all
