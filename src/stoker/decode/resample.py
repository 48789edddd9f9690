"""Antialiased bilinear resampling of uint8 RGB images, as Pillow's ``BILINEAR`` filter.

torchvision on PIL images resizes with Pillow's BILINEAR filter: a triangle filter whose support
widens with the downscale factor (an antialiasing filter).  Two entry points:

* :func:`resize_bilinear_aa` (an integer box: a crop, or the whole image), when it downscales
  on either axis, uses torch's ``interpolate(mode="bilinear", antialias=True)``, which has a
  uint8 kernel for channels-last CPU tensors (torch 2.1 and later; vectorised with AVX2).  It
  computes Pillow's filter weights in fixed point, so its output differs from Pillow's by at
  most one or two levels from rounding.  Its cost grows with the output size plus the source
  rows and columns touched, so it does not blur every source pixel first.  Upscaling on both
  axes the filter is plain bilinear interpolation, done by OpenCV's ``INTER_LINEAR`` (half
  torch's cost there).
* :func:`resize_box_aa` (a box whose edges fall between pixels, used by the derived forms)
  uses Pillow's own ``Image.resize(box=...)`` when it downscales, the one library that resamples
  a real-valued box with this filter (torch's kernel has no sub-pixel offset), and OpenCV's
  bilinear ``warpAffine`` when it upscales on both axes (within 1 level of Pillow, half its cost).

torch runs the kernel on its intra-op thread pool.  Loader workers are processes, one per core,
so each pins one thread (:func:`one_intra_op_thread`); a measurement of the per-core rate does
the same.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Iterator

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = ["resize_bilinear_aa", "resize_box_aa", "one_intra_op_thread"]


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run the body with torch's intra-op thread pool set to one thread, then restore it.

    For code that measures one process's (one core's) rate, and for worker processes that
    must not spawn a thread per core each.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_nchw(img: np.ndarray) -> torch.Tensor:
    """``(h, w, 3)`` uint8 array -> ``(1, 3, h, w)`` channels-last uint8 tensor (a view when it can)."""
    if min(img.strides) < 0 or not img.flags.c_contiguous:
        # numpy copies a row-strided crop view row by row (memcpy); torch's copy of the same view
        # into channels-last memory goes element by element, measured 1.2 ms for a 300x300 crop
        # (more than the resize), against tens of microseconds here
        img = np.ascontiguousarray(img)
    if img.flags.writeable:
        t = torch.from_numpy(img)
    else:  # torch warns on read-only memory; the kernel only reads it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(img)
    # unsqueeze first: the batch stride is then H*W*3, and torch takes the tensor for channels-last
    # (its fast uint8 kernel, and a channels-last output that is an HWC array with no copy)
    return t.unsqueeze(0).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)


def resize_bilinear_aa(img: np.ndarray, out_w: int, out_h: int, scratch: bool = False) -> np.ndarray:
    """Resize like Pillow's BILINEAR (antialiased when downscaling), to within 2 levels.

    Args:
        img: ``(h, w, 3)`` uint8; may be a non-contiguous crop view (rows strided).
        out_w, out_h: output size in pixels (> 0).
        scratch: write into a buffer this thread reuses for every call of the size, for a caller
            that copies the result out at once (a worker writing a batch slot): no allocation per
            sample. The result is then overwritten by this thread's next such call of the same
            size, so it must not be kept.

    Returns:
        ``(out_h, out_w, 3)`` uint8 C-contiguous array (a new one, or ``img`` itself when it
        is already contiguous and of the output size).

    Raises:
        ValueError: a non-positive output size.
    """
    h, w = img.shape[:2]
    if out_w < 1 or out_h < 1:
        raise ValueError(f"output size must be positive, got {out_w}x{out_h}")
    if (h, w) == (out_h, out_w):
        return np.ascontiguousarray(img)
    if out_h >= h and out_w >= w:
        # Upscaling on both axes the filter is plain bilinear interpolation (support 1 source
        # pixel, edges clamped), which OpenCV's INTER_LINEAR computes at half torch's cost here
        # (fixed-point weights in 1/2048 pixel: within 1 level of Pillow).
        res_cv = cv2.resize(img, (out_w, out_h), interpolation=cv2.INTER_LINEAR)
        if res_cv.shape != (out_h, out_w, 3):
            raise RuntimeError(f"cv2.resize returned shape {res_cv.shape}, expected {(out_h, out_w, 3)}")
        return res_cv
    buf = _scratch_buffer(out_h, out_w) if scratch else None
    out = _interpolate_aa(_as_nchw(img), out_h, out_w, buf)[0].permute(1, 2, 0).numpy()
    if out.shape != (out_h, out_w, 3):
        raise RuntimeError(f"torch interpolate returned shape {out.shape}, expected {(out_h, out_w, 3)}")
    return np.ascontiguousarray(out)  # channels-last output: already contiguous, no copy


_tls = threading.local()


def _interpolate_aa(x: torch.Tensor, out_h: int, out_w: int, out: torch.Tensor | None) -> torch.Tensor:
    """torch's antialiased bilinear resize of channels-last ``(1, 3, h, w)`` uint8 ``x``.

    Calls the ATen operator that ``F.interpolate(mode="bilinear", antialias=True)`` ends in,
    without that function's argument handling (measured 26 us against 10 us per call here, a few
    per cent of a demo photo's decode and resize), into ``out`` when given; falls back to
    ``F.interpolate`` on a torch without it.
    """
    op = getattr(torch._C._nn, "_upsample_bilinear2d_aa", None)
    if op is None:  # pragma: no cover - every torch the package allows has it
        res = F.interpolate(x, size=(out_h, out_w), mode="bilinear", align_corners=False, antialias=True)
        if out is None:
            return res
        return out.copy_(res)
    if out is None:
        return op(x, (out_h, out_w), False, None, None)
    return op(x, (out_h, out_w), False, None, None, out=out)


def _scratch_buffer(out_h: int, out_w: int) -> torch.Tensor:
    """This thread's channels-last ``(1, 3, out_h, out_w)`` uint8 output buffer of that size."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    buf = bufs.get((out_h, out_w))
    if buf is None:
        buf = bufs[(out_h, out_w)] = torch.empty((1, 3, out_h, out_w), dtype=torch.uint8).contiguous(
            memory_format=torch.channels_last
        )
    return buf


def resize_box_aa(img: np.ndarray, y0: float, x0: float, hf: float, wf: float, out_h: int, out_w: int) -> np.ndarray:
    """Resample the real-valued box ``[y0, y0+hf) x [x0, x0+wf)`` of ``img`` to ``(out_h, out_w)``.

    Same filter as :func:`resize_bilinear_aa` (Pillow's BILINEAR, pixel-centre alignment
    ``src = x0 + (dst + 0.5) * wf / out_w - 0.5``), but the box may start and end between pixels.
    Only pixels inside the box (rounded outwards) are read, as when a crop is resized.  An integer
    box goes to :func:`resize_bilinear_aa`; any other to ``cv2.warpAffine`` (bilinear) when it
    is upscaled on both axes, else to Pillow's ``Image.resize(box=...)``.

    Args:
        img: ``(H, W, 3)`` uint8.
        y0, x0, hf, wf: box in pixels of ``img`` (``hf, wf > 0``; inside the image).
        out_h, out_w: output size in pixels.

    Returns:
        New ``(out_h, out_w, 3)`` uint8 array.

    Raises:
        ValueError: an empty box or a non-positive output size.
    """
    if not (hf > 0 and wf > 0) or out_h < 1 or out_w < 1:
        raise ValueError(f"box {hf}x{wf} and output {out_h}x{out_w} must be positive")
    H, W = img.shape[:2]
    ys, xs = max(0, int(math.floor(y0 + 1e-6))), max(0, int(math.floor(x0 + 1e-6)))
    ye = min(H, max(ys + 1, int(math.ceil(y0 + hf - 1e-6))))
    xe = min(W, max(xs + 1, int(math.ceil(x0 + wf - 1e-6))))
    region = img[ys:ye, xs:xe]
    if (xs, ys) == (x0, y0) and (xe - xs, ye - ys) == (wf, hf):
        return resize_bilinear_aa(region, out_w, out_h)  # an integer box
    rh, rw = ye - ys, xe - xs
    if out_h >= hf and out_w >= wf:  # upscaling on both axes: plain bilinear (see the module docstring)
        sx, sy = wf / out_w, hf / out_h  # src = x0 + (dst + 0.5) * sx - 0.5, in the region's pixels
        m = np.array([[sx, 0.0, x0 - xs + 0.5 * sx - 0.5], [0.0, sy, y0 - ys + 0.5 * sy - 0.5]], np.float64)
        res_cv = cv2.warpAffine(
            np.ascontiguousarray(region),
            m,
            (out_w, out_h),
            flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
            borderMode=cv2.BORDER_REPLICATE,
        )
        if res_cv.shape != (out_h, out_w, 3):
            raise RuntimeError(f"cv2.warpAffine returned shape {res_cv.shape}, expected {(out_h, out_w, 3)}")
        return res_cv
    left, top = min(max(0.0, x0 - xs), rw - 1e-3), min(max(0.0, y0 - ys), rh - 1e-3)
    box = (left, top, min(float(rw), left + wf), min(float(rh), top + hf))
    pil = Image.fromarray(np.ascontiguousarray(region), "RGB")
    res = np.asarray(pil.resize((out_w, out_h), Image.Resampling.BILINEAR, box=box))
    if res.shape != (out_h, out_w, 3):
        raise RuntimeError(f"Pillow resize returned shape {res.shape}, expected {(out_h, out_w, 3)}")
    return res
