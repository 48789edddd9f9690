"""Training / evaluation transforms with torchvision semantics, on numpy, OpenCV and torch.

* :func:`train_transform` = ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip(0.5)``
* :func:`eval_transform`  = ``Resize(resize)`` + ``CenterCrop(size)``

Both take an ``(H, W, 3)`` uint8 RGB image and return ``(3, size, size)`` uint8 CHW, optionally
written straight into a caller's buffer (a slot of a shared-memory batch).

Resampling is Pillow's antialiased BILINEAR filter, as torchvision applies it to PIL images:
:mod:`stoker.decode.resample` (torch's uint8 antialiased kernel; Pillow's own for boxes whose
edges fall between pixels).  Crop boxes, flips and rounding follow torchvision exactly.
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from .image import DEFAULT_MAX_PIXELS, decode_image, decode_jpeg_box, jpeg_region_size
from .resample import resize_bilinear_aa, resize_box_aa

__all__ = [
    "random_resized_crop_params",
    "train_transform",
    "eval_transform",
    "eval_resize_for",
    "decode_transform",
]

# Workers are processes: OpenCV's own thread pool would oversubscribe the cores.
cv2.setNumThreads(1)


def random_resized_crop_params(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """Crop box of torchvision's ``RandomResizedCrop.get_params``.

    Up to 10 attempts: draw a target area ``uniform(*scale) * H * W`` and an aspect ratio
    ``exp(uniform(log ratio[0], log ratio[1]))``; if the rounded box fits, draw its top-left
    uniformly.  Otherwise fall back to a centre crop of the whole image clamped to the ratio
    range.  RNG draw order per attempt: area, log-ratio, then (on success) top, left; each is one
    ``rng.uniform`` / ``rng.integers`` call.

    Args:
        height, width: image size in pixels (> 0).
        rng: numpy Generator (consumed).
        scale: (min, max) fraction of the image area.
        ratio: (min, max) aspect ratio width / height.

    Returns:
        ``(top, left, h, w)`` ints with ``0 <= top``, ``top + h <= height``, ``0 <= left``,
        ``left + w <= width``, ``h, w >= 1``.

    Raises:
        ValueError: non-positive image size, or a decreasing ``scale`` / ``ratio`` range.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if scale[0] > scale[1] or ratio[0] > ratio[1]:
        raise ValueError(f"scale and ratio must be (min, max), got {scale}, {ratio}")
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * float(rng.uniform(scale[0], scale[1]))
        aspect = math.exp(float(rng.uniform(log_lo, log_hi)))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    # Fallback: central crop, as large as possible within the ratio range.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    h, w = max(1, min(h, height)), max(1, min(w, width))
    return (height - h) // 2, (width - w) // 2, h, w


def _check_img(img: np.ndarray) -> None:
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"expected (H, W, 3) uint8 image, got shape {img.shape} dtype {img.dtype}")


def _out_buffer(out: np.ndarray | None, size: int) -> np.ndarray:
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"size must be a positive int (pixels), got {size!r}")
    if out is None:
        return np.empty((3, size, size), np.uint8)
    if out.shape != (3, size, size) or out.dtype != np.uint8:
        raise ValueError(f"out must be (3, {size}, {size}) uint8, got {out.shape} {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def _hwc_to_chw(src: np.ndarray, out: np.ndarray, flip: bool) -> None:
    """Write HWC ``src`` (optionally mirrored left-right) into CHW ``out``."""
    if flip:
        src = cv2.flip(src, 1)
    if out.flags.c_contiguous:
        planes = [out[0], out[1], out[2]]
        got = cv2.split(src, planes)
        # cv2 writes in place (and hands back the same arrays) only if the buffers fit; check.
        if all(g is p for g, p in zip(got, planes)):
            return
    out[...] = src.transpose(2, 0, 1)


def train_transform(
    img: np.ndarray, rng: np.random.Generator, size: int = 224, out: np.ndarray | None = None
) -> np.ndarray:
    """``RandomResizedCrop(size)`` then ``RandomHorizontalFlip(p=0.5)``, to CHW.

    RNG draw order (shared with ``stoker_lab.reference.pillow_train_transform``): the crop parameters
    (:func:`random_resized_crop_params`, default scale/ratio), then one ``rng.random()``; the
    image is mirrored when it is ``< 0.5``.

    Args:
        img: ``(H, W, 3)`` uint8 RGB.
        rng: numpy Generator (consumed).
        size: output side in pixels.
        out: optional ``(3, size, size)`` uint8 array (any view) to write into.

    Returns:
        ``(3, size, size)`` uint8 CHW (``out`` itself when given).

    Raises:
        ValueError: wrong image or ``out`` shape/dtype.
    """
    _check_img(img)
    out = _out_buffer(out, size)
    top, left, h, w = random_resized_crop_params(img.shape[0], img.shape[1], rng)
    flip = bool(rng.random() < 0.5)
    return _resize_flip(img[top : top + h, left : left + w], flip, size, out)


def _resize_flip(crop: np.ndarray, flip: bool, size: int, out: np.ndarray) -> np.ndarray:
    """Resize an HWC crop to ``size`` x ``size``, mirror it if ``flip``, write CHW into ``out``."""
    _hwc_to_chw(resize_bilinear_aa(crop, size, size, scratch=True), out, flip)
    return out


def _train_from_region(
    data, key: str, hw: tuple[int, int], rng: np.random.Generator, size: int, out: np.ndarray | None, max_pixels: int
) -> np.ndarray:
    """:func:`train_transform` of a JPEG of size ``hw``, decoding only the crop box.

    Same RNG draws, same pixels as decoding the whole image first.  If libjpeg warns inside
    the box, the whole file goes to :func:`decode_image` (the reference decoder judges it) and
    the already drawn box is cut from that.
    """
    out = _out_buffer(out, size)
    box = random_resized_crop_params(hw[0], hw[1], rng)
    flip = bool(rng.random() < 0.5)
    return _resize_flip(decode_jpeg_box(data, key, hw, box, max_pixels), flip, size, out)


def eval_resize_for(size: int) -> int:
    """Default ``Resize`` side for a centre crop of ``size``: 256 for 224 (ratio 0.875)."""
    return int(round(size / 0.875))


def resized_hw(height: int, width: int, resize: int) -> tuple[int, int]:
    """Output ``(height, width)`` in pixels of torchvision ``Resize(int)``: shorter side ->
    ``resize``, longer side scaled and truncated (int())."""
    if width <= height:
        return int(resize * height / width), resize
    return resize, int(resize * width / height)


def center_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """``(top, left)`` in pixels of torchvision's ``CenterCrop(size)`` of a ``height`` x ``width``
    image: ``int(round((dim - size) / 2))``."""
    return int(round((height - size) / 2.0)), int(round((width - size) / 2.0))


def resize_center_crop(img: np.ndarray, size: int, resize: int) -> np.ndarray:
    """``Resize(resize)`` then ``CenterCrop(size)`` of an ``(H, W, 3)`` uint8 image: an HWC view
    ``(size, size, 3)`` of the resized image (``size <= resize``, unchecked)."""
    new_h, new_w = resized_hw(img.shape[0], img.shape[1], resize)
    top, left = center_offsets(new_h, new_w, size)
    return resize_bilinear_aa(img, new_w, new_h)[top : top + size, left : left + size]


def eval_transform(img: np.ndarray, size: int = 224, resize: int = 256, out: np.ndarray | None = None) -> np.ndarray:
    """``Resize(resize)`` (shorter side) then ``CenterCrop(size)``, to CHW.

    The longer side becomes ``int(resize * long / short)`` and the crop offsets are
    ``int(round((dim - size) / 2))``, as in torchvision.

    Args:
        img: ``(H, W, 3)`` uint8 RGB.
        size: crop side in pixels; must be ``<= resize``.
        resize: target shorter side in pixels.
        out: optional ``(3, size, size)`` uint8 array to write into.

    Returns:
        ``(3, size, size)`` uint8 CHW (``out`` itself when given).

    Raises:
        ValueError: wrong image/``out`` shape or dtype, or ``size > resize``.
    """
    _check_img(img)
    if size > resize:
        raise ValueError(f"crop size {size} larger than resize {resize} (padding is not supported)")
    out = _out_buffer(out, size)
    _hwc_to_chw(resize_center_crop(img, size, resize), out, False)
    return out


def decode_transform(
    data,
    key: str,
    mode: str,
    rng: np.random.Generator | None,
    *,
    size: int = 224,
    out: np.ndarray | None = None,
    exif_orientation: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    resize: int | None = None,
) -> np.ndarray:
    """Decode one sample and apply the train or eval transform (the loader's hot path).

    In train mode a JPEG is decoded only inside its crop box when the region decoder is built
    (:func:`~stoker.decode.image.decode_jpeg_region`; same pixels, about 1.5x faster); with
    ``exif_orientation=True``, for non-JPEGs and for JPEGs the fast path refuses, the whole
    image is decoded first.

    Args:
        data: encoded image bytes (bytes-like).
        key: sample key, for error messages.
        mode: ``"train"`` (RandomResizedCrop + flip; needs ``rng``) or ``"eval"``
            (Resize + CenterCrop; ``rng`` unused).
        rng: numpy Generator for ``"train"``.
        size: output side in pixels.
        out: optional ``(3, size, size)`` uint8 buffer to write into.
        exif_orientation, max_pixels: passed to :func:`decode_image`.
        resize: eval shorter side; default :func:`eval_resize_for` (256 for 224).

    Returns:
        ``(3, size, size)`` uint8 CHW.

    Raises:
        DecodeError / ImageTooLarge: see :func:`decode_image`.
        ValueError: unknown ``mode``, ``rng`` missing in train mode, bad ``out``.
    """
    if mode == "train":
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"mode='train' needs a numpy Generator as rng, got {type(rng).__name__}")
        if not exif_orientation:  # the box is drawn on the stored (unrotated) size
            hw = jpeg_region_size(data, key, max_pixels)
            if hw is not None:
                return _train_from_region(data, key, hw, rng, size, out, max_pixels)
        img = decode_image(data, key, exif_orientation=exif_orientation, max_pixels=max_pixels)
        return train_transform(img, rng, size, out)
    if mode != "eval":
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    img = decode_image(data, key, exif_orientation=exif_orientation, max_pixels=max_pixels)
    return eval_transform(img, size, eval_resize_for(size) if resize is None else resize, out)


# -- transforms of a reduced copy, in the original image's coordinates ------------------------
# A derived (reduced) copy of an image keeps the original's size in its header.  The crop box is
# drawn on the *original* size with the same RNG draws as :func:`train_transform`, so the same
# region of the same picture is taken; only the source it is resampled from has fewer pixels.


def train_transform_reduced(
    img: np.ndarray, orig_hw: tuple[int, int], rng: np.random.Generator, size: int = 224, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`train_transform` of the original image, computed from a reduced copy ``img``.

    The crop box is drawn for the original size ``orig_hw`` (identical RNG draws and order as
    :func:`train_transform`), scaled to ``img``'s pixels and resampled with
    :func:`resize_box_aa`. When ``img`` has the original size this *is* :func:`train_transform`.

    Args:
        img: ``(h, w, 3)`` uint8, a resized copy of an ``orig_hw = (H, W)`` image.
        orig_hw: the original (height, width) in pixels.
        rng, size, out: as :func:`train_transform`.

    Returns:
        ``(3, size, size)`` uint8 CHW.
    """
    _check_img(img)
    H, W = int(orig_hw[0]), int(orig_hw[1])
    if img.shape[:2] == (H, W):
        return train_transform(img, rng, size, out)
    out = _out_buffer(out, size)
    top, left, h, w = random_resized_crop_params(H, W, rng)
    flip = bool(rng.random() < 0.5)
    fy, fx = img.shape[0] / H, img.shape[1] / W
    res = resize_box_aa(img, top * fy, left * fx, h * fy, w * fx, size, size)
    _hwc_to_chw(res, out, flip)
    return out


def eval_transform_reduced(
    img: np.ndarray, orig_hw: tuple[int, int], size: int = 224, resize: int = 256, out: np.ndarray | None = None
) -> np.ndarray:
    """:func:`eval_transform` of the original image, computed from a reduced copy ``img``.

    ``Resize(resize)`` + ``CenterCrop(size)`` of the original is the box of side
    ``size * H / new_h`` at offset ``top * H / new_h`` (and likewise in x) of the original,
    resampled to ``size``; it is scaled to ``img``'s pixels and resampled with
    :func:`resize_box_aa`.  (Resampling the box straight from the source, instead of resizing
    the whole image first, is one resampling instead of two; on an integer box it is the same.)

    Args:
        img: ``(h, w, 3)`` uint8 reduced copy of an ``orig_hw`` image.
        orig_hw, size, resize, out: as :func:`eval_transform`.

    Returns:
        ``(3, size, size)`` uint8 CHW.
    """
    _check_img(img)
    H, W = int(orig_hw[0]), int(orig_hw[1])
    if img.shape[:2] == (H, W):
        return eval_transform(img, size, resize, out)
    if size > resize:
        raise ValueError(f"crop size {size} larger than resize {resize} (padding is not supported)")
    out = _out_buffer(out, size)
    new_h, new_w = resized_hw(H, W, resize)
    top, left = center_offsets(new_h, new_w, size)
    fy, fx = img.shape[0] / new_h, img.shape[1] / new_w
    res = resize_box_aa(img, top * fy, left * fx, size * fy, size * fx, size, size)
    _hwc_to_chw(res, out, False)
    return out
