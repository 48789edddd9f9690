"""Derived sample forms: cheaper-to-decode copies of a sample kept in the derived-sample cache.

A *form* is what a sample is stored as after its first decode (Cachew, ATC'22: cache a
pipeline's data at the point that maximises throughput):

* ``raw``: the original encoded bytes (no derived copy; the default path);
* ``jpeg<S>``: the decoded image resized (antialiased bilinear, :func:`resize_bilinear_aa`)
  so its shorter side is at most ``S`` pixels, re-encoded as a baseline JPEG (quality 90,
  4:2:0, libjpeg-turbo's accurate DCT, the quality FFCV writes ImageNet at);
* ``rgb<S>`` / ``rgb``: the decoded uint8 pixels, shorter side capped at ``S`` (``rgb``: full size).

An entry is one byte string: a fixed 40-byte header (magic, format version, kind, the original
and stored sizes, payload length, xxh3-64 of the payload) then the payload.  The original size
is kept so the transforms draw RandomResizedCrop boxes for the *original* image
(:func:`~stoker.decode.transforms.train_transform_reduced`).  A ``jpeg`` entry of an image that
is already within the cap stores no payload ("same"): re-encoding it would only lose quality at
the same decode cost, so the reader goes to the raw sample. The default cap: :func:`resolution_cap`
(320 px for 224).
"""

from __future__ import annotations

import functools
import math
import re
import struct
from dataclasses import dataclass

import numpy as np
import simplejpeg
import xxhash

from ..errors import EntryError  # noqa: F401 - re-exported
from .transforms import random_resized_crop_params, resize_bilinear_aa

__all__ = ["Form", "parse_form", "resolution_cap", "make_entry", "read_entry", "EntryError", "SAME"]

_MAGIC = b"STKD"
_FORMAT = 1
_HEADER = struct.Struct("<4sBBHIIIIQQ")  # magic, format, kind, reserved, H0, W0, h, w, length, xxh3
HEADER_BYTES = _HEADER.size  # 40
_KINDS = {"jpeg": 1, "rgb": 2, "same": 3}
SAME = "same"
JPEG_QUALITY = 90


@dataclass(frozen=True)
class Form:
    """A sample form. ``kind``: ``"raw"``, ``"jpeg"`` or ``"rgb"``; ``side``: cap on the shorter
    side in pixels (0 = no cap; raw ignores it); ``quality``: JPEG quality (1-100)."""

    kind: str
    side: int = 0
    quality: int = JPEG_QUALITY

    @property
    def name(self) -> str:
        """Canonical name (``raw``, ``jpeg320``, ``jpeg256q80``, ``rgb``, ``rgb256``)."""
        if self.kind == "raw":
            return "raw"
        cap = str(self.side) if self.side else ""
        q = f"q{self.quality}" if self.kind == "jpeg" and self.quality != JPEG_QUALITY else ""
        return f"{self.kind}{cap}{q}"

    def stored_hw(self, h: int, w: int) -> tuple[int, int]:
        """Size the image is stored at: shorter side capped at ``side`` (never enlarged),
        longer side ``round(long * side / short)``."""
        short = min(h, w)
        if not self.side or short <= self.side:
            return h, w
        f = self.side / short
        return (self.side, max(1, round(w * f))) if h <= w else (max(1, round(h * f)), self.side)


_FORM_RE = re.compile(r"^(raw|jpeg|rgb)(\d*)(?:q(\d+))?$")


def parse_form(text: str | Form, size: int = 224) -> Form:
    """``"raw"``, ``"jpeg"`` (cap :func:`resolution_cap` for ``size``), ``"jpeg256"``,
    ``"jpeg256q80"``, ``"rgb"`` (uncapped), ``"rgb256"`` -> :class:`Form`.

    Raises:
        ValueError: an unknown name, a cap < 16 px, or a quality outside 1..100.
    """
    if isinstance(text, Form):
        return text
    m = _FORM_RE.match(str(text))
    if not m:
        raise ValueError(f"unknown sample form {text!r}: expected raw, jpeg[S][qQ], rgb[S] or auto")
    kind, side, q = m.group(1), m.group(2), m.group(3)
    if kind == "raw":
        if side or q:
            raise ValueError(f"form {text!r}: raw takes no size or quality")
        return Form("raw")
    if q and kind != "jpeg":
        raise ValueError(f"form {text!r}: only jpeg takes a quality")
    cap = int(side) if side else (resolution_cap(size) if kind == "jpeg" else 0)
    if side and cap < 16:
        raise ValueError(f"form {text!r}: a cap under 16 px is not supported")
    quality = int(q) if q else JPEG_QUALITY
    if not 1 <= quality <= 100:
        raise ValueError(f"form {text!r}: quality must be 1..100")
    return Form(kind, cap, quality)


@functools.lru_cache(maxsize=64)
def resolution_cap(size: int = 224, keep: float = 0.5, aspect: float = 4 / 3, draws: int = 4000) -> int:
    """Shorter side (pixels, rounded up to a multiple of 8) at which a fraction ``keep`` of
    RandomResizedCrop(``size``) crops (scale 0.08-1, ratio 3/4-4/3) of an image of aspect
    ``aspect`` have at least ``size`` source pixels along both axes, i.e. are not upsampled.

    Computed by drawing ``draws`` crops with :func:`random_resized_crop_params` (seed 0) on a
    1000 x round(1000 * aspect) image. For size 224: keep 0.5 -> 320, 0.75 -> 416, 0.25 -> 272.
    Below the cap a crop keeps every pixel it would have had; above it (large-area crops of
    large images) the output is a little softer than from the full image.

    Raises:
        ValueError: ``keep`` outside (0, 1).
    """
    if not 0.0 < keep < 1.0:
        raise ValueError(f"keep must be in (0, 1), got {keep}")
    rng = np.random.default_rng(0)
    short, long_ = 1000, int(round(1000 * aspect))
    frac = np.empty(draws)
    for i in range(draws):
        _, _, h, w = random_resized_crop_params(short, long_, rng)
        frac[i] = min(h, w) / short  # crop's smaller side as a fraction of the image's shorter side
    need = size / np.quantile(frac, 1.0 - keep)
    return int(math.ceil(need / 8.0) * 8)


def make_entry(form: Form, img: np.ndarray) -> bytes:
    """The derived entry of a decoded image.

    Args:
        form: a ``jpeg`` or ``rgb`` :class:`Form`.
        img: ``(H, W, 3)`` uint8 RGB, the decode of the raw sample.

    Returns:
        Header + payload bytes (``jpeg`` within the cap: header only, kind ``same``).

    Raises:
        ValueError: ``raw`` form or a bad image.
    """
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(f"expected (H, W, 3) uint8 image, got {img.shape} {img.dtype}")
    H, W = img.shape[:2]
    h, w = form.stored_hw(H, W)
    if form.kind == "jpeg" and (h, w) == (H, W):
        return _HEADER.pack(_MAGIC, _FORMAT, _KINDS[SAME], 0, H, W, H, W, 0, xxhash.xxh3_64_intdigest(b""))
    small = img if (h, w) == (H, W) else resize_bilinear_aa(img, w, h)
    if form.kind == "jpeg":
        payload = simplejpeg.encode_jpeg(
            np.ascontiguousarray(small), quality=form.quality, colorspace="RGB", colorsubsampling="420", fastdct=False
        )
    elif form.kind == "rgb":
        payload = np.ascontiguousarray(small).tobytes()
    else:
        raise ValueError(f"form {form.name!r} has no derived entry")
    return (
        _HEADER.pack(_MAGIC, _FORMAT, _KINDS[form.kind], 0, H, W, h, w, len(payload), xxhash.xxh3_64_intdigest(payload))
        + payload
    )


def read_entry(form: Form, entry) -> tuple[str, tuple[int, int], np.ndarray | None]:
    """Check and decode a derived entry.

    Args:
        form: the :class:`Form` the entry was stored as.
        entry: the entry's bytes.

    Returns:
        ``(kind, (H, W) of the original, image)``; ``kind`` is the form's kind, or ``"same"``
        (image ``None``: use the raw sample). The image is ``(h, w, 3)`` uint8, writable for
        ``jpeg``; read-only over ``entry`` for ``rgb``.

    Raises:
        EntryError: short or damaged entry, another kind, a checksum mismatch, or a payload
            that does not decode to the recorded size.
    """
    if len(entry) < HEADER_BYTES:
        raise EntryError(f"entry is {len(entry)} bytes, shorter than its {HEADER_BYTES}-byte header")
    magic, fmt, kind, _, H, W, h, w, n, digest = _HEADER.unpack_from(entry, 0)
    if magic != _MAGIC or fmt != _FORMAT:
        raise EntryError(f"bad magic/format {magic!r}/{fmt}")
    if kind not in (_KINDS[form.kind], _KINDS[SAME]) or (kind == _KINDS[SAME] and form.kind != "jpeg"):
        raise EntryError(f"entry kind {kind} is not form {form.name!r}")
    if len(entry) != HEADER_BYTES + n:
        raise EntryError(f"payload is {len(entry) - HEADER_BYTES} bytes, header says {n} (truncated?)")
    payload = memoryview(entry)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        raise EntryError("payload checksum mismatch")
    if min(H, W, h, w) <= 0 or h > H or w > W:
        raise EntryError(f"implausible sizes: original {H}x{W}, stored {h}x{w}")
    if kind == _KINDS[SAME]:
        return SAME, (H, W), None
    if form.kind == "rgb":
        if n != h * w * 3:
            raise EntryError(f"rgb payload of {n} bytes for {h}x{w}x3")
        return "rgb", (H, W), np.frombuffer(payload, np.uint8).reshape(h, w, 3)
    try:
        img = simplejpeg.decode_jpeg(payload, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
    except ValueError as exc:
        raise EntryError(f"stored JPEG does not decode: {exc}") from exc
    if img.shape != (h, w, 3):
        raise EntryError(f"stored JPEG is {img.shape}, header says {(h, w, 3)}")
    return "jpeg", (H, W), img
