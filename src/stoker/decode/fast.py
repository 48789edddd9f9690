"""``stoker.decode.jpeg``: the built-in transforms' fast decode, for a user's own ``decode=``.

A custom ``decode(fields, rng)`` that calls Pillow for every image gives up what the built-in
``transform="train"`` path does per sample: for a RandomResizedCrop box it decodes only the box
(libjpeg-turbo through the optional ``_jpegroi`` extension: rows below the box are never decoded,
columns beside it skip IDCT and colour conversion) and resizes with Pillow's antialiased bilinear
filter on torch's uint8 kernel (:mod:`stoker.decode.resample`). :func:`jpeg` is that path as one
call that returns an ``(H, W, 3)`` uint8 array, so the user's own augmentation follows it:

    def decode(fields, rng):
        img = stoker.decode.jpeg(fields, size=224, crop="random", rng=rng)  # the sample's image
        ...  # colour jitter, flips, ... on the HWC array
        return img.transpose(2, 0, 1), fields["__label__"]

``crop="random"`` draws the box with the same random draws, in the same order, as the built-in
train transform, which then draws one ``rng.random()`` for its flip (mirror when < 0.5); so
``jpeg(..., crop="random")`` followed by that flip is the built-in train transform pixel for
pixel, and ``crop="center"`` is the built-in eval transform (tests/decode/test_fast.py).
"""

from __future__ import annotations

import operator

import numpy as np

from .image import DEFAULT_MAX_PIXELS, decode_image, decode_jpeg_box, jpeg_region_size
from .resample import resize_bilinear_aa
from .transforms import eval_resize_for, random_resized_crop_params, resize_center_crop

__all__ = ["jpeg"]


def _side(value, name: str) -> int:
    n = _coord(value, name)
    if n < 1:
        raise ValueError(f"{name} must be at least 1 pixel, got {n}")
    return n


def _coord(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a whole number of pixels, got {value!r}") from None


def _out_size(size) -> tuple[int, int] | None:
    """``size`` as ``(height, width)`` in pixels, or None (no resize)."""
    if size is None:
        return None
    if isinstance(size, (tuple, list)):
        if len(size) != 2:
            raise ValueError(f"size must be an int or (height, width), got {size!r}")
        return _side(size[0], "size height"), _side(size[1], "size width")
    n = _side(size, "size")
    return n, n


def _box(crop, hw: tuple[int, int], rng, scale, ratio) -> tuple[int, int, int, int] | None:
    """The ``(top, left, height, width)`` box of ``crop`` in an image of ``hw`` pixels (None: all of it)."""
    if crop is None:
        return None
    if isinstance(crop, str):
        if crop != "random":
            raise ValueError(f"crop must be None, 'random', 'center' or (top, left, height, width), got {crop!r}")
        if not isinstance(rng, np.random.Generator):
            raise ValueError(
                "crop='random' needs rng, a numpy.random.Generator (the decode's rng argument), "
                f"got {type(rng).__name__}"
            )
        return random_resized_crop_params(hw[0], hw[1], rng, scale, ratio)
    if not isinstance(crop, (tuple, list)) or len(crop) != 4:
        raise ValueError(f"crop must be None, 'random', 'center' or (top, left, height, width), got {crop!r}")
    top, left = _coord(crop[0], "crop top"), _coord(crop[1], "crop left")
    h, w = _side(crop[2], "crop height"), _side(crop[3], "crop width")
    if top < 0 or left < 0 or top + h > hw[0] or left + w > hw[1]:
        raise ValueError(
            f"crop box (top={top}, left={left}, height={h}, width={w}) is not inside the "
            f"{hw[0]}x{hw[1]} (height x width) image"
        )
    return top, left, h, w


def jpeg(
    data,
    size: int | tuple[int, int] | None = None,
    crop: str | tuple[int, int, int, int] | None = None,
    *,
    rng: np.random.Generator | None = None,
    key: str | None = None,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    exif_orientation: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Decode an image, crop it and resize it the way stoker's built-in transforms do, fast.

    A JPEG is decoded by libjpeg-turbo, and with a crop box only the box is decoded (the
    optional ``_jpegroi`` extension; where it was not built, or for a file it refuses, the whole
    image is decoded and cut: same pixels, slower). Files libjpeg-turbo warns about, CMYK JPEGs
    and every other format (PNG, WebP, ...) are decoded by Pillow
    (:func:`stoker.decode.decode_image`). The resize is Pillow's antialiased bilinear filter
    (within 2 levels of Pillow's own ``Image.resize(..., BILINEAR)``).

    Args:
        data: the encoded image (bytes, bytearray or memoryview), e.g. ``fields["jpg"]``; or
            the ``fields`` dict a Loader gives ``decode``, whose first member, the primary
            payload, is decoded (an ImageFolder pack's image, whatever its extension), with its
            ``__key__`` named in errors.
        size: the output in pixels: an int for ``size`` x ``size``, ``(height, width)``, or None
            to keep the crop's own size. ``crop="center"`` needs an int.
        crop: None (the whole image); ``"random"``: torchvision's RandomResizedCrop box
            (``scale`` of the area, aspect ``ratio`` width/height), drawn from ``rng`` with the
            built-in train transform's draws; ``"center"``: the built-in eval transform, the
            shorter side resized to ``round(size / 0.875)`` (256 for 224) then the centre
            ``size`` x ``size``; or ``(top, left, height, width)``, a box in the stored image's
            pixels.
        rng: a ``numpy.random.Generator`` (the ``rng`` a Loader gives ``decode``), for
            ``crop="random"``; consumed.
        key: the sample key, named in errors; by default the fields' ``__key__``, else the
            data's length.
        scale, ratio: RandomResizedCrop's ranges (torchvision's defaults).
        exif_orientation: apply the EXIF orientation tag first (default: ignore it, as
            torchvision's ImageFolder does; the box is then drawn on the rotated image, and the
            whole image is decoded).
        max_pixels: refuse images whose header declares more pixels (width x height).

    Returns:
        ``(height, width, 3)`` uint8 RGB array in HWC order (channels last), C-contiguous,
        writable and the caller's own; ``(size, size, 3)`` for an int ``size``.

    Raises:
        TypeError: ``data`` is neither bytes-like nor fields whose first member is bytes.
        ValueError: a bad ``size`` or ``crop``, a box outside the image, or ``crop="random"``
            without a Generator; the message names the argument.
        DecodeError: the bytes are empty, not an image, corrupt or truncated; ImageTooLarge
            (a DecodeError): more than ``max_pixels`` pixels. Both name ``key``.
    """
    data, name = _payload(data, key)
    out_hw = _out_size(size)
    if isinstance(crop, str) and crop == "center":
        if out_hw is None or isinstance(size, (tuple, list)):
            raise ValueError(f"crop='center' needs an int size (the square side in pixels), got {size!r}")
        img = decode_image(data, name, exif_orientation=exif_orientation, max_pixels=max_pixels)
        return np.ascontiguousarray(resize_center_crop(img, out_hw[0], eval_resize_for(out_hw[0])))
    # the box is drawn on the stored size, read from the JPEG header where the region decoder takes
    # the file; else (no extension, another format, EXIF applied) on the decoded image
    region_hw = None if exif_orientation or crop is None else jpeg_region_size(data, name, max_pixels)
    if region_hw is not None:
        box = _box(crop, region_hw, rng, scale, ratio)
        assert box is not None  # crop is not None on this path
        part = decode_jpeg_box(data, name, region_hw, box, max_pixels)
    else:
        img = decode_image(data, name, exif_orientation=exif_orientation, max_pixels=max_pixels)
        box = _box(crop, (img.shape[0], img.shape[1]), rng, scale, ratio)
        part = img if box is None else img[box[0] : box[0] + box[2], box[1] : box[1] + box[3]]
    if out_hw is None or out_hw == part.shape[:2]:
        return part if _own(part) else np.array(part, order="C", copy=True)
    return resize_bilinear_aa(part, out_hw[1], out_hw[0])


def _payload(data, key: str | None) -> tuple[bytes | bytearray | memoryview, str]:
    """``(encoded bytes, name in errors)`` of :func:`jpeg`'s ``data``: the bytes themselves, or a
    sample's fields' primary payload, its first member (``read_fields`` puts it first), named by
    ``key``, else the fields' ``__key__``, else the data's length. TypeError for anything else."""
    if isinstance(data, dict):
        fields = data
        key = fields.get("__key__") if key is None else key
        data = next(iter(fields.values()), None)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"stoker.decode.jpeg: the first of fields {list(fields)} is not a member's bytes; "
                "pass the image's bytes, e.g. fields['jpg']"
            )
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"stoker.decode.jpeg takes encoded image bytes or a sample's fields, got {type(data).__name__}")
    return data, key if key is not None else f"<{len(data)} bytes>"


def _own(arr: np.ndarray) -> bool:
    """Whether ``arr`` is a whole, C-contiguous, writable array nobody else holds a view of."""
    return arr.base is None and arr.flags.c_contiguous and arr.flags.writeable
