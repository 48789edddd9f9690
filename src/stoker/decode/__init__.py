"""Image decode and augmentation: libjpeg-turbo fast path, Pillow fallback, torchvision semantics."""

from .image import DEFAULT_MAX_PIXELS, DecodeError, ImageTooLarge, decode_image, decode_stats
from .rate import measure_decode_rate
from .reference import (
    pillow_decode,
    pillow_decode_transform,
    pillow_eval_transform,
    pillow_train_transform,
)
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
    "measure_decode_rate",
    "pillow_decode",
    "pillow_decode_transform",
    "pillow_eval_transform",
    "pillow_train_transform",
    "random_resized_crop_params",
    "resize_bilinear_aa",
    "train_transform",
]
