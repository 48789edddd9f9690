"""Image decode and augmentation: libjpeg-turbo fast path, Pillow fallback, torchvision semantics.

For a Loader's own ``decode=``: :func:`jpeg` (``stoker.decode.jpeg``) is the built-in transforms'
region decode and resize as one call, returning an ``(H, W, 3)`` uint8 array.
"""

from .fast import jpeg
from .image import DEFAULT_MAX_PIXELS, DecodeError, ImageTooLarge, decode_image, decode_stats
from .transforms import (
    decode_transform,
    eval_resize_for,
    eval_transform,
    random_resized_crop_params,
    resize_bilinear_aa,
    train_transform,
)

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DecodeError",
    "ImageTooLarge",
    "decode_image",
    "decode_stats",
    "decode_transform",
    "eval_resize_for",
    "eval_transform",
    "jpeg",
    "random_resized_crop_params",
    "resize_bilinear_aa",
    "train_transform",
]
