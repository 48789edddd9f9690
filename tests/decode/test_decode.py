"""Decode tests: the shared real-world cases, the fallback path, errors and size limits."""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from stoker.decode import image as image_mod
from stoker.decode import DecodeError, ImageTooLarge, decode_image, decode_stats


def _local_cases_dir() -> Path:
    env = os.environ.get("STOKER_CASES")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "cases"


@pytest.fixture
def jpeg_cases(request) -> Path:
    try:
        base = Path(request.getfixturevalue("cases_dir"))
    except pytest.FixtureLookupError:
        base = _local_cases_dir()
    d = base / "pillow-jpeg"
    if not d.is_dir():
        pytest.skip(f"shared cases not found at {d}")
    return d


def _reference(data: bytes, transpose: bool = False) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        if transpose:
            im = ImageOps.exif_transpose(im)
        return np.asarray(im.convert("RGB"))


def _maxdiff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def _check_array(arr: np.ndarray) -> None:
    assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
    assert arr.flags.c_contiguous and arr.flags.writeable


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


FAST_FILES = [
    "hopper.jpg",
    "pil_sample_rgb.jpg",
    "flower2.jpg",
    "hopper_16bit_qtables.jpg",
    "icc_profile_big.jpg",
    "hopper_gray.jpg",
]
WARNING_FILES = ["hopper_bad_exif.jpg", "jpeg_ff00_header.jpg", "junk_jpeg_header.jpg"]
ORIENTATION_FILES = ["hopper_orientation_3.jpg", "hopper_orientation_6.jpg", "hopper_orientation_8.jpg"]


@pytest.mark.parametrize("name", FAST_FILES)
def test_ordinary_files_fast_path_match_reference(jpeg_cases, name):
    data = (jpeg_cases / name).read_bytes()
    before = decode_stats()
    arr = decode_image(data, name)
    _check_array(arr)
    assert _maxdiff(arr, _reference(data)) <= 2
    assert _delta(before, decode_stats())["fast"] == 1


def test_grayscale_becomes_three_equal_channels(jpeg_cases):
    arr = decode_image((jpeg_cases / "hopper_gray.jpg").read_bytes(), "gray")
    assert arr.shape == (128, 128, 3)
    assert np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 0], arr[..., 2])


def test_cmyk_goes_to_pillow_and_matches(jpeg_cases):
    data = (jpeg_cases / "pil_sample_cmyk.jpg").read_bytes()
    before = decode_stats()
    arr = decode_image(data, "cmyk")
    _check_array(arr)
    assert arr.shape == (100, 100, 3)
    assert _maxdiff(arr, _reference(data)) <= 2
    assert _delta(before, decode_stats())["fallback"] == 1


@pytest.mark.parametrize("name", WARNING_FILES)
def test_libjpeg_warning_files_take_fallback_and_match(jpeg_cases, name, monkeypatch):
    data = (jpeg_cases / name).read_bytes()
    calls = []
    real = image_mod._pillow_decode

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(image_mod, "_pillow_decode", spy)
    arr = decode_image(data, name)
    assert calls == [name]
    _check_array(arr)
    assert _maxdiff(arr, _reference(data)) <= 2


@pytest.mark.parametrize("name", ORIENTATION_FILES)
def test_orientation_policy(jpeg_cases, name):
    data = (jpeg_cases / name).read_bytes()
    ignored = decode_image(data, name)
    assert _maxdiff(ignored, _reference(data)) <= 2  # default: tag ignored, like ImageFolder
    applied = decode_image(data, name, exif_orientation=True)
    _check_array(applied)
    assert _maxdiff(applied, _reference(data, transpose=True)) <= 2
    assert _maxdiff(applied, ignored) > 50  # the tag really changed the pixels


def test_truncated_file_raises_naming_key(jpeg_cases):
    data = (jpeg_cases / "truncated_jpeg.jpg").read_bytes()
    with pytest.raises(DecodeError) as ei:
        decode_image(data, "shard-3/sample-0042")
    assert "shard-3/sample-0042" in str(ei.value)
    assert ei.value.key == "shard-3/sample-0042" and ei.value.reason
    assert not isinstance(ei.value, ImageTooLarge)


def test_truncated_refused_even_if_pillow_flag_set(jpeg_cases, monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(DecodeError, match="trunc-key"):
        decode_image((jpeg_cases / "truncated_jpeg.jpg").read_bytes(), "trunc-key")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored


def test_every_case_file_is_covered(jpeg_cases):
    names = {p.name for p in jpeg_cases.glob("*.jpg")}
    covered = set(FAST_FILES + WARNING_FILES + ORIENTATION_FILES) | {"pil_sample_cmyk.jpg", "truncated_jpeg.jpg"}
    assert names <= covered, names - covered


# ---------------------------------------------------------------- synthetic files


def _photo(w: int = 97, h: int = 61) -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x * y) % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(arr)


def _encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_png_named_jpeg_decodes():
    im = _photo()
    data = _encode(im, "PNG")
    before = decode_stats()
    arr = decode_image(data, "n01440764/n01440764_10026.JPEG")
    assert np.array_equal(arr, np.asarray(im))
    assert _delta(before, decode_stats())["pillow"] == 1


@pytest.mark.parametrize("data", [b"", bytearray(), memoryview(b"")])
def test_empty_bytes(data):
    with pytest.raises(DecodeError, match="empty-key"):
        decode_image(data, "empty-key")


@pytest.mark.parametrize("prefix", [b"", b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"])
def test_junk_bytes(prefix):
    junk = prefix + np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    with pytest.raises(DecodeError) as ei:
        decode_image(junk, "junk-key")
    assert "junk-key" in str(ei.value) and ei.value.key == "junk-key"


def test_memoryview_input_and_pickled_error():
    data = _encode(_photo(), "JPEG", quality=90)
    assert decode_image(memoryview(data), "mv").shape == (61, 97, 3)
    err = pickle.loads(pickle.dumps(DecodeError("k1", "why")))
    assert (err.key, err.reason) == ("k1", "why") and "k1" in str(err)


def _jpeg_with_dims(width: int, height: int) -> bytes:
    data = bytearray(_encode(_photo(16, 16), "JPEG", quality=90))
    i = 2
    while True:  # walk the marker segments to the SOF0 frame header
        assert data[i] == 0xFF
        marker, seglen = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
        if marker == 0xC0:
            data[i + 5 : i + 9] = struct.pack(">HH", height, width)
            return bytes(data)
        i += 2 + seglen


def _png_with_dims(width: int, height: int) -> bytes:
    data = bytearray(_encode(_photo(16, 16), "PNG"))
    ihdr = bytearray(data[12:29])  # b"IHDR" + 13 bytes of header fields
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(data)


@pytest.mark.parametrize("make", [_jpeg_with_dims, _png_with_dims], ids=["jpeg-sof0", "png-ihdr"])
def test_declared_huge_image_refused_before_allocating(make):
    data = make(30_000, 30_000)
    assert len(data) < 10_000
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ImageTooLarge) as ei:
            decode_image(data, "bomb-key")
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(ei.value)  # our header check (JPEG) or Pillow's bomb error (PNG) names the size
    assert "bomb-key" in msg and ("30000x30000" in msg or "900000000" in msg)
    assert elapsed < 0.5
    assert peak < 16 * 2**20  # the 2.7 GB pixel buffer was never allocated


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_max_pixels_parameter(fmt):
    data = _encode(_photo(40, 30), fmt)
    assert decode_image(data, "ok", max_pixels=1200).shape == (30, 40, 3)
    with pytest.raises(ImageTooLarge, match="small-limit"):
        decode_image(data, "small-limit", max_pixels=1199)


def _insert_stray_bytes(jpeg: bytes) -> bytes:
    i = jpeg.index(b"\xff\xdb")  # before the first DQT marker: libjpeg warns, Pillow reads it
    return jpeg[:i] + b"\x00\x00\x00" + jpeg[i:]


def test_fallback_counter_for_stray_bytes():
    im = _photo(120, 80)
    data = _insert_stray_bytes(_encode(im, "JPEG", quality=90))
    before = decode_stats()
    arr = decode_image(data, "stray")
    assert _delta(before, decode_stats()) == {"fast": 0, "roi": 0, "fallback": 1, "pillow": 0, "error": 0}
    assert _maxdiff(arr, _reference(data)) <= 2


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_all_tags_fast_path(orientation):
    im = _photo(97, 61)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(im, "JPEG", quality=95, exif=exif.tobytes())
    before = decode_stats()
    got = decode_image(data, "o", exif_orientation=True)
    assert _delta(before, decode_stats())["fast"] == 1
    _check_array(got)
    assert _maxdiff(got, _reference(data, transpose=True)) <= 2
    assert decode_image(data, "o").shape == (61, 97, 3)  # default ignores the tag


@pytest.mark.parametrize("orientation", [3, 6])
def test_exif_orientation_on_pillow_path(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(_photo(97, 61), "PNG", exif=exif.tobytes())
    got = decode_image(data, "p", exif_orientation=True)
    assert _maxdiff(got, _reference(data, transpose=True)) == 0
    assert got.shape == ((61, 97, 3) if orientation == 3 else (97, 61, 3))


def test_a_decode_error_names_the_sample_not_pillows_in_memory_file():
    import pickle

    from stoker.decode import DecodeError, decode_image

    with pytest.raises(DecodeError) as err:
        decode_image(b"definitely not an image, but long enough to be sniffed", "cls/k1")
    assert "cls/k1" in str(err.value) and "BytesIO" not in str(err.value) and "0x" not in str(err.value)
    again = pickle.loads(pickle.dumps(err.value))
    assert str(again) == str(err.value) and again.key == "cls/k1"
