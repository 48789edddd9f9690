"""Transform tests: torchvision crop semantics, agreement with the Pillow reference, buffers.

Agreement tolerance.  stoker resizes with torch's antialiased bilinear uint8 kernel, which
computes Pillow's BILINEAR filter weights in fixed point, so the two differ only by rounding.
Measured on 500x375 q90 photos (chelsea, astronaut, coffee, motorcycle, horse) and on a
12-megapixel photo: worst pixel 1 level, mean 0.00-0.12 per crop (most on upscaled crops).
(The previous OpenCV approximation, a Gaussian pre-blur and INTER_LINEAR, was off by up to 41
levels.)  A wrong crop box, a missed
flip or an unfiltered (aliased) downscale gives means of 3 to 60.  Bounds: worst pixel <= 2
levels and mean < 0.5 per sample (upscaled crops round differently most often), mean < 0.1 over all.
"""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.decode import (
    decode_image,
    decode_transform,
    eval_transform,
    random_resized_crop_params,
    resize_bilinear_aa,
    train_transform,
)
from stoker.decode.resample import one_intra_op_thread, resize_box_aa
from stoker_lab.decode_rate import measure_decode_rate
from stoker_lab.reference import pillow_decode, pillow_eval_transform, pillow_train_transform

PHOTOS = ["chelsea", "astronaut", "coffee", "motorcycle_left", "horse"]


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """~500x375 quality-90 JPEGs re-encoded from scikit-image's sample photographs."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("scikit-image not installed")
    data_dir = Path(list(spec.submodule_search_locations)[0]) / "data"
    out = []
    for name in PHOTOS:
        im = Image.open(data_dir / f"{name}.png").convert("RGB").resize((500, 375), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _stats(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(mean, worst) absolute difference in levels."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return float(d.mean()), float(d.max())


WORST_LEVELS = 2  # worst pixel against Pillow


# ------------------------------------------------------------------ crop parameters


@pytest.mark.parametrize("hw", [(375, 500), (500, 375), (224, 224), (33, 1000), (1, 1), (7, 3)])
def test_crop_params_within_bounds(hw):
    height, width = hw
    rng = np.random.default_rng(0)
    for _ in range(2000):
        top, left, h, w = random_resized_crop_params(height, width, rng)
        assert all(isinstance(v, int) for v in (top, left, h, w))
        assert h >= 1 and w >= 1 and top >= 0 and left >= 0
        assert top + h <= height and left + w <= width


def test_crop_params_area_and_ratio_ranges():
    height, width = 375, 500
    rng = np.random.default_rng(1)
    areas = []
    for _ in range(5000):
        _, _, h, w = random_resized_crop_params(height, width, rng)
        areas.append(h * w / (height * width))
        # rounding w and h to integers moves ratio and area by at most ~(0.5/h + 0.5/w) relative
        slack = 1.1 * (0.5 / h + 0.5 / w)
        assert 3 / 4 * (1 - slack) <= w / h <= 4 / 3 * (1 + slack)
        assert 0.08 * (1 - slack) <= areas[-1] <= 1.0
    areas = np.array(areas)
    assert areas.min() < 0.1 and areas.max() > 0.95  # both ends of the range are reached
    # where every attempt fits (square image, scale <= 0.5) the area fraction is uniform
    fits = []
    for _ in range(4000):
        _, _, h, w = random_resized_crop_params(1000, 1000, rng, scale=(0.08, 0.5))
        fits.append(h * w / 1e6)
    assert abs(np.mean(fits) - 0.29) < 0.01
    assert np.histogram(fits, bins=4, range=(0.08, 0.5))[0].min() > 900


def test_crop_params_log_ratio_is_uniform():
    rng = np.random.default_rng(2)
    logs = []
    for _ in range(4000):
        _, _, h, w = random_resized_crop_params(2000, 2000, rng, scale=(0.25, 0.25))
        logs.append(math.log(w / h))
    logs = np.array(logs)
    assert abs(logs.mean()) < 0.01  # symmetric in log space around ratio 1
    assert np.histogram(logs, bins=4, range=(math.log(3 / 4), math.log(4 / 3)))[0].min() > 800


@pytest.mark.parametrize(
    "hw, expected",
    [
        ((10, 1000), (0, 493, 10, 13)),  # too wide: h = H, w = round(H * 4/3)
        ((1000, 10), (493, 0, 13, 10)),
    ],  # too tall: w = W, h = round(W / (3/4))
)
def test_crop_params_fallback_for_extreme_aspect(hw, expected):
    rng = np.random.default_rng(3)
    assert random_resized_crop_params(*hw, rng) == expected
    # the fallback is reached after exactly 10 attempts of 2 uniform draws each
    twin = np.random.default_rng(3)
    for _ in range(10):
        twin.uniform(0.08, 1.0)
        twin.uniform(math.log(3 / 4), math.log(4 / 3))
    assert rng.random() == twin.random()


def test_crop_params_fallback_within_ratio_is_whole_image():
    # every attempt fails (scale > 1 can never fit), in-range aspect -> the whole image
    assert random_resized_crop_params(300, 350, np.random.default_rng(0), scale=(1.5, 2.0)) == (0, 0, 300, 350)


def test_crop_params_draw_order():
    # first attempt succeeds on a big image: area, log-ratio, top, left, in that order
    checked = 0
    for seed in range(50):
        rng, twin = np.random.default_rng(seed), np.random.default_rng(seed)
        top, left, h, w = random_resized_crop_params(375, 500, rng)
        area = 375 * 500 * twin.uniform(0.08, 1.0)
        aspect = math.exp(twin.uniform(math.log(3 / 4), math.log(4 / 3)))
        w0, h0 = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if not (w0 <= 500 and h0 <= 375):
            continue  # first attempt rejected; covered by the fallback test
        assert (w, h) == (w0, h0)
        assert (top, left) == (twin.integers(0, 375 - h + 1), twin.integers(0, 500 - w + 1))
        checked += 1
    assert checked > 20


# ------------------------------------------------------------------ agreement with Pillow


def test_train_matches_pillow_reference(photos):
    means = []
    for i, data in enumerate(photos):
        arr, pil = decode_image(data, f"p{i}"), pillow_decode(data)
        for seed in range(30):
            ours = train_transform(arr, np.random.default_rng(seed))
            ref = pillow_train_transform(pil, np.random.default_rng(seed))
            mean, worst = _stats(ours, ref)
            assert mean < 0.5 and worst <= WORST_LEVELS, (i, seed, mean, worst)
            means.append(mean)
    assert np.mean(means) < 0.1


def test_train_flip_is_applied(photos):
    arr = decode_image(photos[0], "p0")
    pil = pillow_decode(photos[0])
    seeds = {True: None, False: None}
    for seed in range(20):  # find one seed that flips and one that does not
        rng = np.random.default_rng(seed)
        random_resized_crop_params(375, 500, rng)
        seeds[bool(rng.random() < 0.5)] = seed
    for flip, seed in seeds.items():
        ours = train_transform(arr, np.random.default_rng(seed))
        ref = pillow_train_transform(pil, np.random.default_rng(seed))
        assert _stats(ours, ref)[1] <= WORST_LEVELS
        assert _stats(ours[:, :, ::-1].copy(), ref)[0] > 3.0  # mirror image really differs


def test_eval_matches_pillow_reference(photos):
    for i, data in enumerate(photos):
        ours = eval_transform(decode_image(data, f"p{i}"))
        ref = pillow_eval_transform(pillow_decode(data))
        mean, worst = _stats(ours, ref)
        assert mean < 0.5 and worst <= WORST_LEVELS, (i, mean, worst)


@pytest.mark.parametrize("hw", [(90, 120), (150, 100), (230, 600)])
def test_upscale_and_odd_sizes_match(photos, hw):
    pil = pillow_decode(photos[2]).resize((hw[1], hw[0]), Image.Resampling.BILINEAR)
    arr = np.asarray(pil).copy()
    for seed in range(10):
        mean, worst = _stats(
            train_transform(arr, np.random.default_rng(seed)), pillow_train_transform(pil, np.random.default_rng(seed))
        )
        assert mean < 0.5 and worst <= WORST_LEVELS, (seed, mean, worst)
    mean, worst = _stats(eval_transform(arr), pillow_eval_transform(pil))
    assert mean < 0.5 and worst <= WORST_LEVELS


@pytest.fixture(scope="module")
def photo_12mp(photos) -> Image.Image:
    """A 4000x3000 photo (12 megapixels): a demo photo upscaled, with fine noise for texture."""
    base = pillow_decode(photos[1]).resize((4000, 3000), Image.Resampling.BICUBIC)
    noise = np.random.default_rng(0).integers(-40, 41, (3000, 4000, 3), dtype=np.int16)
    return Image.fromarray(np.clip(np.asarray(base).astype(np.int16) + noise, 0, 255).astype(np.uint8))


def test_large_downscales_match_pillow(photo_12mp):
    arr = np.asarray(photo_12mp)
    for seed in (0, 1):  # RandomResizedCrop of a 12 MP photo: 224 px from crops of ~900-3000 px
        mean, worst = _stats(
            train_transform(arr, np.random.default_rng(seed)),
            pillow_train_transform(photo_12mp, np.random.default_rng(seed)),
        )
        assert mean < 0.5 and worst <= WORST_LEVELS, (seed, mean, worst)
    ours = resize_bilinear_aa(arr, 500, 375)  # an 8x downscale
    ref = np.asarray(photo_12mp.resize((500, 375), Image.Resampling.BILINEAR))
    mean, worst = _stats(ours, ref)
    assert mean < 0.5 and worst <= WORST_LEVELS, (mean, worst)


@pytest.mark.parametrize(
    "box",
    [
        (20.3, 30.7, 200.6, 250.2),
        (0.5, 0.25, 33.3, 41.9),
        (10.0, 12.0, 150.5, 150.5),
        (100.9, 0.0, 17.2, 499.0),
        (3.7, 5.2, 224.0, 100.5),
        (40.1, 60.9, 180.3, 210.7),
    ],
)
def test_fractional_box_is_pillows_box_resize(photos, box):
    """A box with edges between pixels (derived forms) is resampled as Pillow's resize(box=...)
    of the crop rounded outwards."""
    img = decode_image(photos[3], "p3")
    y0, x0, hf, wf = box
    ours = resize_box_aa(img, y0, x0, hf, wf, 224, 224)
    ys, xs = math.floor(y0), math.floor(x0)
    ye, xe = math.ceil(y0 + hf), math.ceil(x0 + wf)
    crop = Image.fromarray(np.ascontiguousarray(img[ys:ye, xs:xe]))
    ref = np.asarray(
        crop.resize((224, 224), Image.Resampling.BILINEAR, box=(x0 - xs, y0 - ys, x0 - xs + wf, y0 - ys + hf))
    )
    mean, worst = _stats(ours, ref)
    assert worst <= WORST_LEVELS, (box, mean, worst)


def test_resize_keeps_read_only_and_strided_inputs(photos):
    img = decode_image(photos[0], "p0")
    ref = resize_bilinear_aa(img[10:300, 20:400].copy(), 224, 224)
    view = img[10:300, 20:400]
    assert np.array_equal(resize_bilinear_aa(view, 224, 224), ref)
    frozen = img.copy()
    frozen.flags.writeable = False
    assert np.array_equal(resize_bilinear_aa(frozen[10:300, 20:400], 224, 224), ref)
    out = resize_bilinear_aa(img[::-1][75:365, 20:400][::-1], 224, 224)  # negative strides
    assert np.array_equal(out, ref) and out.flags.c_contiguous
    with pytest.raises(ValueError, match="positive"):
        resize_bilinear_aa(img, 0, 10)


def test_scratch_resize_equals_the_fresh_one_and_reuses_its_buffer(photos):
    """The workers' resize writes into one buffer per thread and size: same pixels as
    resize_bilinear_aa, the same memory on the next call, another buffer for another size, and
    the upscale path (OpenCV) untouched."""
    img = decode_image(photos[0], "p0")
    a = resize_bilinear_aa(img[10:300, 20:400], 224, 224, scratch=True)
    assert np.array_equal(a, resize_bilinear_aa(img[10:300, 20:400], 224, 224))
    first = a.__array_interface__["data"][0]
    b = resize_bilinear_aa(img[0:200, 0:250], 224, 160, scratch=True)
    assert np.array_equal(b, resize_bilinear_aa(img[0:200, 0:250], 224, 160))
    c = resize_bilinear_aa(img[50:350, 10:310], 224, 224, scratch=True)
    assert c.__array_interface__["data"][0] == first  # reused: a caller must copy it out at once
    assert np.array_equal(c, resize_bilinear_aa(img[50:350, 10:310], 224, 224))
    small = img[:100, :120]
    assert np.array_equal(resize_bilinear_aa(small, 224, 224, scratch=True), resize_bilinear_aa(small, 224, 224))


def test_eval_geometry_exact():
    # shorter side already 256: no resampling, only torchvision's centre-crop rounding
    img = np.random.default_rng(0).integers(0, 256, (256, 301, 3), dtype=np.uint8)
    out = eval_transform(img)
    left = int(round((301 - 224) / 2.0))  # 38 (round half to even), as torchvision
    assert np.array_equal(out, img[16:240, left : left + 224].transpose(2, 0, 1))
    assert np.array_equal(pillow_eval_transform(Image.fromarray(img)), out)


def test_eval_resize_long_side_rule():
    # 375x502 -> shorter side 256, longer int(256 * 502 / 375) = int(342.69) = 342 (torchvision
    # truncates; rounding would give 343 and shift the centre crop by a pixel)
    x = np.arange(502)
    row = (127.5 + 120 * np.sin(2 * np.pi * x / 9.0)).astype(np.uint8)
    img = np.ascontiguousarray(np.broadcast_to(row[None, :, None], (375, 502, 3)))
    expected = Image.fromarray(img).resize((342, 256), Image.Resampling.BILINEAR)
    left = int(round((342 - 224) / 2.0))
    expected = np.asarray(expected)[16:240, left : left + 224].transpose(2, 0, 1)
    assert _stats(eval_transform(img), np.ascontiguousarray(expected))[0] < 2.0
    assert _stats(pillow_eval_transform(Image.fromarray(img)), np.ascontiguousarray(expected))[0] == 0
    with pytest.raises(ValueError):
        eval_transform(img, size=300, resize=256)


# ------------------------------------------------------------------ buffers and determinism


def test_output_shape_dtype_contiguity(photos):
    arr = decode_image(photos[1], "p1")
    for out in (
        train_transform(arr, np.random.default_rng(0)),
        eval_transform(arr),
        train_transform(arr, np.random.default_rng(0), size=160),
    ):
        assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[0] == 3
        assert out.shape[1] == out.shape[2] and out.flags.c_contiguous
    assert train_transform(arr, np.random.default_rng(0), size=160).shape == (3, 160, 160)


def test_out_writes_into_batch_slot(photos):
    batch = np.full((4, 3, 224, 224), 7, np.uint8)
    arr = decode_image(photos[0], "p0")
    res = train_transform(arr, np.random.default_rng(5), out=batch[2])
    assert res is batch[2] or np.shares_memory(res, batch[2])
    assert np.array_equal(batch[2], train_transform(arr, np.random.default_rng(5)))
    assert (batch[[0, 1, 3]] == 7).all()
    res = decode_transform(photos[1], "p1", "eval", None, out=batch[0])
    assert np.shares_memory(res, batch)
    assert np.array_equal(batch[0], eval_transform(decode_image(photos[1], "p1")))


def test_out_non_contiguous_view(photos):
    arr = decode_image(photos[0], "p0")
    big = np.zeros((3, 224, 448), np.uint8)
    view = big[:, :, ::2]
    train_transform(arr, np.random.default_rng(6), out=view)
    assert np.array_equal(view, train_transform(arr, np.random.default_rng(6)))
    assert (big[:, :, 1::2] == 0).all()
    with pytest.raises(ValueError):
        train_transform(arr, np.random.default_rng(6), out=np.zeros((3, 224, 225), np.uint8))


def test_determinism(photos):
    a = decode_transform(photos[3], "k", "train", np.random.default_rng(42))
    b = decode_transform(photos[3], "k", "train", np.random.default_rng(42))
    c = decode_transform(photos[3], "k", "train", np.random.default_rng(43))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_decode_transform_arguments(photos):
    with pytest.raises(ValueError):
        decode_transform(photos[0], "k", "train", None)
    with pytest.raises(ValueError):
        decode_transform(photos[0], "k", "test", np.random.default_rng(0))
    x = decode_transform(photos[0], "k", "eval", None, size=128)
    assert x.shape == (3, 128, 128)
    with pytest.raises(ValueError, match="Generator"):
        decode_transform(photos[0], "k", "train", 0)
    for mode in ("train", "eval"):
        with pytest.raises(ValueError, match="size"):
            decode_transform(photos[0], "k", mode, np.random.default_rng(0), size=0)
        ro = np.zeros((3, 64, 64), np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            decode_transform(photos[0], "k", mode, np.random.default_rng(0), size=64, out=ro)


def test_measure_decode_rate(photos):
    for recipe in ("stoker", "pillow"):
        for mode in ("train", "eval"):
            rate = measure_decode_rate(photos, mode, min_seconds=0.05, recipe=recipe)
            assert rate > 10
    with pytest.raises(ValueError):
        measure_decode_rate(photos, recipe="nope", min_seconds=0.0)
    with pytest.raises(ValueError):
        measure_decode_rate([], min_seconds=0.0)


def test_one_intra_op_thread_restores_the_pool():
    import torch

    before = torch.get_num_threads()
    with one_intra_op_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
