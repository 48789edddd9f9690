"""``stoker.decode.jpeg``, the public fast decode for a user's own ``decode=``: the built-in
transforms' pixels for the same crop, size and seed (region decode or not), a fresh HWC array, and
errors that say what was wrong."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import stoker
from stoker.decode import DecodeError, decode_image, decode_stats, decode_transform, resize_bilinear_aa
from stoker.decode import image as image_mod
from stoker.decode.image import REGION_DECODE


@pytest.fixture(scope="module")
def photos(sample_tree):
    """Ten of the sample tree's real photos (JPEG bytes), of several sizes."""
    files = sorted((sample_tree / "train").rglob("*.JPEG"))[:10]
    return [(f.stem, f.read_bytes()) for f in files]


def _train_like_builtin(data, key, seed):
    """jpeg(crop="random") then the built-in transform's flip draw, as CHW."""
    rng = np.random.default_rng(seed)
    img = stoker.decode.jpeg(data, 224, "random", rng=rng, key=key)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return img.transpose(2, 0, 1)


@pytest.mark.parametrize("region", [True, False], ids=["region-decode", "no-extension"])
def test_random_crop_gives_the_builtin_train_pixels(photos, region, monkeypatch):
    if region and not REGION_DECODE:
        pytest.skip("stoker.decode._jpegroi not built")
    if not region:  # as where the extension was not built: whole images, cut
        monkeypatch.setattr(image_mod, "_jpegroi", None)
    regions = 0
    for seed, (key, data) in enumerate(photos):
        want = decode_transform(data, key, "train", np.random.default_rng(seed), size=224)
        before = decode_stats()["roi"]
        got = _train_like_builtin(data, key, seed)
        regions += decode_stats()["roi"] - before
        assert got.shape == (3, 224, 224) and np.array_equal(got, want), key
    assert regions == (len(photos) if region else 0)  # only the box was decoded, where it can be


def test_center_crop_gives_the_builtin_eval_pixels(photos):
    for key, data in photos:
        for size in (224, 96):
            want = decode_transform(data, key, "eval", None, size=size)
            got = stoker.decode.jpeg(data, size, "center")
            assert np.array_equal(got.transpose(2, 0, 1), want), (key, size)


def test_a_box_and_a_size(photos):
    key, data = photos[0]
    whole = decode_image(data, key)
    h, w = whole.shape[:2]
    box = (h // 4, w // 3, h // 2, w // 3)
    cut = whole[box[0] : box[0] + box[2], box[1] : box[1] + box[3]]
    assert np.array_equal(stoker.decode.jpeg(data, crop=box), cut)  # no size: the box's own pixels
    assert np.array_equal(stoker.decode.jpeg(data, (40, 70), box), resize_bilinear_aa(cut, 70, 40))
    assert np.array_equal(stoker.decode.jpeg(data), whole)
    assert stoker.decode.jpeg(data, 64).shape == (64, 64, 3)


def test_the_result_is_a_fresh_writable_hwc_array(photos):
    key, data = photos[1]
    for crop in (None, (0, 0, 32, 32), "center"):
        a = stoker.decode.jpeg(data, 32 if crop == "center" else None, crop)
        b = stoker.decode.jpeg(data, 32 if crop == "center" else None, crop)
        assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3
        assert a.flags.c_contiguous and a.flags.writeable
        a[...] = 0  # ours to change: the next call is not touched
        assert b.any() and not np.shares_memory(a, b)


def test_other_formats_go_through_pillow():
    img = (np.arange(40 * 30 * 3) % 251).astype(np.uint8).reshape(40, 30, 3)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    assert np.array_equal(stoker.decode.jpeg(buf.getvalue(), crop=(5, 6, 10, 12)), img[5:15, 6:18])


def test_bad_input_says_what_was_wrong(photos):
    key, data = photos[0]
    with pytest.raises(DecodeError, match=r"cannot decode sample 'cat/1'.*not a readable image"):
        stoker.decode.jpeg(b"not an image at all", 224, "random", rng=np.random.default_rng(0), key="cat/1")
    with pytest.raises(DecodeError, match=r"'<0 bytes>'.*empty"):
        stoker.decode.jpeg(b"")
    with pytest.raises(DecodeError, match=r"'cat/2'.*truncated"):  # a truncated JPEG is refused, never padded
        stoker.decode.jpeg(data[: len(data) // 2], 224, key="cat/2")
    with pytest.raises(ValueError, match=r"crop='random' needs rng.*Generator"):
        stoker.decode.jpeg(data, 224, "random")
    h, w = decode_image(data, key).shape[:2]
    with pytest.raises(ValueError, match=rf"crop box \(top=0, left=0, height={h + 1}.*not inside the {h}x{w}"):
        stoker.decode.jpeg(data, crop=(0, 0, h + 1, 10))
    with pytest.raises(ValueError, match="crop must be None, 'random', 'center'"):
        stoker.decode.jpeg(data, 224, "middle")
    with pytest.raises(ValueError, match="size must be at least 1 pixel, got 0"):
        stoker.decode.jpeg(data, 0)
    with pytest.raises(ValueError, match="crop='center' needs an int size"):
        stoker.decode.jpeg(data, (224, 200), "center")
    with pytest.raises(
        TypeError, match=r"first of fields \['__key__', 'jpg'\] is not a member's bytes.*fields\['jpg'\]"
    ):
        stoker.decode.jpeg({"__key__": key, "jpg": data})
    with pytest.raises(TypeError, match="encoded image bytes or a sample's fields, got str"):
        stoker.decode.jpeg("cat/1.jpg")
    with pytest.raises(DecodeError, match=r"cannot decode sample 'dog/7'"):  # the fields' key is named
        stoker.decode.jpeg({"png": b"\x89PNG broken", "__key__": "dog/7", "__id__": 7}, 32)


def test_fields_decode_their_primary_payload(photos):
    key, data = photos[2]
    fields = {"JPEG": data, "txt": b"a caption", "__key__": key, "__id__": 2, "__label__": 0}
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    a = stoker.decode.jpeg(fields, 48, "random", rng=rng_a)
    assert np.array_equal(a, stoker.decode.jpeg(data, 48, "random", rng=rng_b))


def test_public_and_imported_on_first_use():
    """``stoker.decode.jpeg`` after a bare ``import stoker``, which still loads neither torch nor OpenCV."""
    code = (
        "import sys, stoker\n"
        "assert 'torch' not in sys.modules and 'cv2' not in sys.modules\n"
        "assert 'decode' in stoker.__all__\n"
        "print(stoker.decode.jpeg.__module__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "stoker.decode.fast"
