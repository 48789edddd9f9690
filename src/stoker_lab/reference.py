"""The "standard recipe" in plain Pillow + numpy: the reference stoker's decode is held to.

Same semantics as :mod:`stoker.decode.transforms` (torchvision ``RandomResizedCrop`` +
``RandomHorizontalFlip`` for training, ``Resize`` + ``CenterCrop`` for evaluation, Pillow
``BILINEAR`` resampling), and the same RNG draw order, so that with equal seeds both produce the
same crop box and flip and tests can compare pixels.  The demo's baseline (torch DataLoader +
Pillow) uses it as well.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from stoker.decode.transforms import center_offsets, eval_resize_for, random_resized_crop_params, resized_hw

__all__ = [
    "pillow_decode",
    "pillow_train_transform",
    "pillow_eval_transform",
    "pillow_decode_transform",
]


def pillow_decode(data: bytes) -> Image.Image:
    """``Image.open(BytesIO(data)).convert("RGB")`` (EXIF orientation ignored, as ImageFolder).

    Args:
        data: encoded image bytes.

    Returns:
        An RGB ``PIL.Image.Image`` (loaded).

    Raises:
        PIL.UnidentifiedImageError, OSError, ...: whatever Pillow raises.
    """
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def _to_chw(im: Image.Image) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(im, dtype=np.uint8).transpose(2, 0, 1))


def pillow_train_transform(img: Image.Image, rng: np.random.Generator, size: int = 224) -> np.ndarray:
    """``RandomResizedCrop(size)`` + ``RandomHorizontalFlip(0.5)`` with Pillow.

    Draw order: :func:`~stoker.decode.transforms.random_resized_crop_params`, then one
    ``rng.random()`` (mirror when ``< 0.5``) -- identical to ``train_transform``.

    Args:
        img: RGB PIL image.
        rng: numpy Generator (consumed).
        size: output side in pixels.

    Returns:
        ``(3, size, size)`` uint8 CHW, C-contiguous.
    """
    width, height = img.size
    top, left, h, w = random_resized_crop_params(height, width, rng)
    flip = bool(rng.random() < 0.5)
    res = img.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR)
    if flip:
        res = res.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_chw(res)


def pillow_eval_transform(img: Image.Image, size: int = 224, resize: int = 256) -> np.ndarray:
    """``Resize(resize)`` (shorter side; long side ``int(resize * long / short)``) +
    ``CenterCrop(size)`` (offsets ``int(round((dim - size) / 2))``) with Pillow BILINEAR.

    Args:
        img: RGB PIL image.
        size: crop side in pixels (``<= resize``).
        resize: shorter side after resizing, in pixels.

    Returns:
        ``(3, size, size)`` uint8 CHW, C-contiguous.

    Raises:
        ValueError: ``size > resize``.
    """
    if size > resize:
        raise ValueError(f"crop size {size} larger than resize {resize}")
    width, height = img.size
    new_h, new_w = resized_hw(height, width, resize)
    if (new_w, new_h) != (width, height):
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    top, left = center_offsets(new_h, new_w, size)
    return _to_chw(img.crop((left, top, left + size, top + size)))


def pillow_decode_transform(data: bytes, mode: str, rng: np.random.Generator | None, size: int = 224) -> np.ndarray:
    """Reference decode + transform (the baseline recipe's per-sample work).

    Args:
        data: encoded image bytes.
        mode: ``"train"`` (needs ``rng``) or ``"eval"``.
        rng: numpy Generator for train mode.
        size: output side in pixels.

    Returns:
        ``(3, size, size)`` uint8 CHW.

    Raises:
        ValueError: unknown mode or missing rng; Pillow's errors for bad data.
    """
    img = pillow_decode(data)
    if mode == "train":
        if rng is None:
            raise ValueError("mode='train' needs an rng")
        return pillow_train_transform(img, rng, size)
    if mode == "eval":
        return pillow_eval_transform(img, size, eval_resize_for(size))
    raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
