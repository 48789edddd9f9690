"""Image decode: a libjpeg-turbo fast path for JPEG, Pillow for everything else.

The contract is the *reference* decode that ``torchvision.datasets.ImageFolder`` users get:
``PIL.Image.open(f).convert("RGB")`` as an ``(H, W, 3)`` uint8 array.  The fast path
(simplejpeg, i.e. libjpeg-turbo with the accurate integer IDCT and fancy upsampling, the same
settings Pillow uses) agrees with it to within IDCT rounding (max abs diff <= 2 per channel,
0 on every ordinary test file).  Whenever the fast path cannot promise that, the sample goes to
Pillow instead:

* libjpeg *warnings* (corrupt EXIF, stray bytes before a marker, premature end of data) are
  errors in simplejpeg's ``strict=True`` mode, so such files are re-decoded by Pillow, which
  decides whether they are readable (a truncated file is refused, never padded);
* CMYK / YCCK (Adobe) JPEGs go to Pillow so the colour conversion is Pillow's own;
* anything that is not a JPEG (sniffed from the bytes, never from the file name).

Region decode.  When only part of an image is wanted (a RandomResizedCrop box),
:func:`decode_jpeg_region` decodes just that part with stoker's own libjpeg-turbo binding
(``_jpegroi``: rows below the box are never decoded, rows above are entropy-decoded only,
columns outside skip IDCT and colour conversion).  The pixels are exactly those of the whole
image decode (tested); it is about 1.5x faster per sample on the demo's photos
(``stoker bench decode``).  The binding is optional: without it every path decodes whole images.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections import Counter

import numpy as np
import simplejpeg
from PIL import Image, ImageFile, ImageOps

from ..errors import DecodeError, ImageTooLarge  # noqa: F401 - re-exported

try:  # stoker's optional C extension (setup.py); absent when built without libjpeg headers
    from . import _jpegroi
except ImportError:  # pragma: no cover - depends on the build machine
    _jpegroi = None  # type: ignore[assignment]  # optional: the functions below check for None

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "REGION_DECODE",
    "DecodeError",
    "ImageTooLarge",
    "decode_image",
    "decode_jpeg_box",
    "decode_jpeg_region",
    "decode_stats",
    "jpeg_region_size",
]

#: True when the region decoder (``stoker.decode._jpegroi``) was built.
REGION_DECODE = _jpegroi is not None

#: Largest image (width * height, in pixels) decoded by default.  This is Pillow's own
#: decompression-bomb threshold, ``PIL.Image.MAX_IMAGE_PIXELS`` = int(1024 * 1024 * 1024 // 4 // 3)
#: = 89,478,485 (about 0.25 GiB of 24-bit RGB), above which Pillow warns.
DEFAULT_MAX_PIXELS = 89_478_485

_JPEG_MAGIC = b"\xff\xd8\xff"
_JPEG_EOI = b"\xff\xd9"
# Columns decoded beyond each side of a region: libjpeg-turbo's fancy chroma upsampling
# replicates the edge column of a cropped scanline, so the outermost decoded column can differ
# from a whole-image decode (measured: up to 42 levels in column 0).  One column suffices on
# every sampling factor tested (4:4:4, 4:2:2, 4:2:0, progressive, grayscale); 4 is a margin.
_REGION_MARGIN = 4
_CMYK_SPACES = frozenset({"CMYK", "YCCK"})

# How many samples each path decoded in this process (tests and benchmarks read it).
_stats: Counter[str] = Counter()
# Guards the temporary override of Pillow's process-global LOAD_TRUNCATED_IMAGES flag.
_truncation_lock = threading.Lock()


def decode_stats() -> dict[str, int]:
    """Counts of samples decoded per path in this process.

    Returns:
        dict with keys ``"fast"`` (libjpeg-turbo, whole image), ``"roi"`` (libjpeg-turbo, a
        region: :func:`decode_jpeg_region`), ``"fallback"`` (Pillow, after the fast path refused
        a JPEG), ``"pillow"`` (non-JPEG bytes, Pillow directly) and ``"error"``.
    """
    return {k: _stats[k] for k in ("fast", "roi", "fallback", "pillow", "error")}


#: EXIF orientation tag -> its transform of an (H, W, C) array, as ``ImageOps.exif_transpose``
#: applies it (1 and unknown values: none).
_ORIENT = {
    2: lambda a: a[:, ::-1],  # FLIP_LEFT_RIGHT
    3: lambda a: a[::-1, ::-1],  # ROTATE_180
    4: lambda a: a[::-1],  # FLIP_TOP_BOTTOM
    5: lambda a: a.transpose(1, 0, 2),  # TRANSPOSE (main diagonal)
    6: lambda a: np.rot90(a, -1),  # ROTATE_270 (90 degrees clockwise)
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # TRANSVERSE (anti-diagonal)
    8: lambda a: np.rot90(a, 1),  # ROTATE_90 (90 degrees counter-clockwise)
}


def _orient_array(arr: np.ndarray, orientation: int) -> np.ndarray:
    """Apply EXIF orientation 1..8 to an (H, W, C) array the way ``ImageOps.exif_transpose`` does."""
    op = _ORIENT.get(orientation)
    return arr if op is None else np.ascontiguousarray(op(arr))


def read_exif_orientation(data, key: str) -> int:
    """Orientation tag (1..8; 1 when absent) exactly as Pillow reads it (EXIF, then XMP).

    ``data``: the encoded image (bytes-like); ``key``: the sample key, for the error.
    Raises :class:`DecodeError` naming ``key`` when Pillow cannot read the headers.
    """
    try:
        with Image.open(io.BytesIO(data)) as im:  # lazy: parses the headers only
            value = im.getexif().get(0x0112, 1)
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types
        raise DecodeError(key, f"unreadable EXIF orientation: {type(exc).__name__}: {exc}") from exc
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _check_pixels(key: str, width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise DecodeError(key, f"header declares an empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageTooLarge(
            key, f"header declares {width}x{height} = {width * height} pixels > max_pixels={max_pixels}"
        )


def _as_rgb_array(im: Image.Image) -> np.ndarray:
    arr = np.asarray(im)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"Pillow produced an array of shape {arr.shape} dtype {arr.dtype}")
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C")
    return arr


def _pillow_decode(data, key: str, exif_orientation: bool, max_pixels: int) -> np.ndarray:
    """Decode with Pillow (the reference). Raises DecodeError / ImageTooLarge."""
    try:
        with warnings.catch_warnings():
            # Our own max_pixels check below replaces Pillow's bomb *warning*; Pillow's bomb
            # *error* (above 2 * Image.MAX_IMAGE_PIXELS) still applies and is mapped below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im: Image.Image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(key, f"Pillow decompression-bomb limit: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - UnidentifiedImageError, SyntaxError, struct.error...
        raise DecodeError(
            key,
            f"not a readable image: {type(exc).__name__}: {exc} (samples that are not "
            "images need the Loader's decode= function)",
        ) from exc
    try:
        width, height = im.size
        _check_pixels(key, width, height, max_pixels)
        with _truncation_lock:
            # Never silently pad a truncated file, even if someone set the global flag.
            saved = ImageFile.LOAD_TRUNCATED_IMAGES
            ImageFile.LOAD_TRUNCATED_IMAGES = False
            try:
                im.load()
            finally:
                ImageFile.LOAD_TRUNCATED_IMAGES = saved
        if exif_orientation:
            im = ImageOps.exif_transpose(im)
        return _as_rgb_array(im.convert("RGB"))
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise DecodeError(key, f"corrupt or truncated image: {type(exc).__name__}: {exc}") from exc
    finally:
        im.close()


def _fast_jpeg(data, key: str, max_pixels: int) -> np.ndarray | None:
    """libjpeg-turbo decode; ``None`` when the file must go to Pillow instead.

    Raises ImageTooLarge from the header alone, before any pixel buffer is allocated.
    """
    try:
        height, width, colorspace, _sub = simplejpeg.decode_jpeg_header(data, strict=True)
    except ValueError:
        return None  # libjpeg warned or failed on the headers: let Pillow judge
    _check_pixels(key, width, height, max_pixels)
    if colorspace in _CMYK_SPACES:
        return None  # Pillow's CMYK -> RGB conversion is the reference
    try:
        arr = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
    except ValueError:
        return None  # any libjpeg warning (corrupt data, premature end): Pillow decides
    if arr.shape != (height, width, 3) or arr.dtype != np.uint8:
        return None
    return arr


def decode_image(
    data: bytes | bytearray | memoryview,
    key: str,
    *,
    exif_orientation: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> np.ndarray:
    """Decode encoded image bytes to an RGB array.

    JPEGs (recognised by their ``FF D8 FF`` magic, never by the file name) go through
    libjpeg-turbo; files it only warns about, CMYK/YCCK JPEGs and every other format go through
    Pillow (``Image.open(...).convert("RGB")``, the reference).  The result matches the reference
    within 2 per channel.

    EXIF orientation policy: by default the orientation tag is **ignored**, exactly as
    ``torchvision.datasets.ImageFolder`` (Pillow ``open().convert("RGB")``) does.  With
    ``exif_orientation=True`` the tag is applied with ``PIL.ImageOps.exif_transpose`` semantics
    (tag 0x0112 from EXIF, else XMP ``tiff:Orientation``); a rotated result has H and W swapped.

    Args:
        data: the encoded file (bytes-like).
        key: the sample key, used only in error messages.
        exif_orientation: apply the EXIF orientation tag (default: ignore it).
        max_pixels: refuse images whose header declares more than this many pixels
            (width * height), before any pixel buffer is allocated.

    Returns:
        ``(H, W, 3)`` uint8 RGB array, C-contiguous and writable.

    Raises:
        ImageTooLarge: the header declares more than ``max_pixels`` pixels (or Pillow's own
            decompression-bomb limit, ``2 * PIL.Image.MAX_IMAGE_PIXELS``, trips on the Pillow path).
        DecodeError: empty, unrecognised, corrupt or truncated data (message names ``key``).
    """
    if len(data) == 0:
        _stats["error"] += 1
        raise DecodeError(key, "empty data (0 bytes)")
    try:
        if bytes(data[:3]) == _JPEG_MAGIC:
            arr = _fast_jpeg(data, key, max_pixels)
            if arr is not None:
                _stats["fast"] += 1
                if exif_orientation:
                    arr = _orient_array(arr, read_exif_orientation(data, key))
                return arr
            path = "fallback"
        else:
            path = "pillow"
        arr = _pillow_decode(data, key, exif_orientation, max_pixels)
    except DecodeError:
        _stats["error"] += 1
        raise
    _stats[path] += 1
    return arr


def jpeg_region_size(data, key: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG that :func:`decode_jpeg_region` can take, else ``None``.

    ``None`` (decode the whole image with :func:`decode_image` instead) when the region
    decoder is not built, the bytes are not a JPEG, libjpeg warns about the headers, the colour
    space is CMYK/YCCK, or the data does not end with the EOI marker (a truncated file must be
    refused whichever region is drawn, so it always takes the whole-image path; files with
    bytes after EOI take it too), or a one-scan file's entropy-coded data holds a marker other
    than a restart marker (a structural error below the region would go unseen, and the sample
    would fail in some epochs and not in others; ``_jpegroi.structure_ok``).

    Raises:
        ImageTooLarge: the header declares more than ``max_pixels`` pixels.
        DecodeError: the header declares an empty image.
    """
    if _jpegroi is None or len(data) < 4 or bytes(data[:3]) != _JPEG_MAGIC or bytes(data[-2:]) != _JPEG_EOI:
        return None
    try:
        height, width, space = _jpegroi.header(data)
    except ValueError:
        return None
    if not _jpegroi.structure_ok(data):
        return None
    _check_pixels(key, width, height, max_pixels)
    if space in (4, 5):  # JCS_CMYK, JCS_YCCK: Pillow's conversion is the reference
        return None
    return height, width


def decode_jpeg_region(data, key: str, top: int, left: int, height: int, width: int) -> np.ndarray | None:
    """Rows ``[top, top+height)`` x columns ``[left, left+width)`` of a JPEG, decoding only those.

    The result equals ``decode_image(data, key)[top:top+height, left:left+width]`` exactly
    (accurate integer IDCT, fancy upsampling).  Call :func:`jpeg_region_size` first.

    Args:
        data: JPEG bytes (bytes-like) accepted by :func:`jpeg_region_size`.
        key: sample key, for error messages.
        top, left, height, width: the region in pixels (inside the image, non-empty).

    Returns:
        ``(height, width, 3)`` uint8 RGB view of a fresh buffer (rows strided), or ``None``
        when libjpeg warned while decoding (corrupt data): hand the file to
        :func:`decode_image`, which lets the reference decoder judge it.

    Raises:
        ValueError: the region is empty or outside the image (a caller bug).
    """
    if _jpegroi is None:
        return None
    if height <= 0 or width <= 0 or top < 0 or left < 0:
        raise ValueError(f"sample {key!r}: bad region top={top} left={left} {height}x{width}")
    try:
        buf, x0, out_w = _jpegroi.decode_region(data, top, left, height, width, _REGION_MARGIN)
    except IndexError as exc:  # the region is not inside the image: a caller bug
        raise ValueError(f"sample {key!r}: {exc}") from None
    except ValueError:  # libjpeg warned or failed: the reference decoder judges the file
        return None
    _stats["roi"] += 1
    arr = np.frombuffer(buf, np.uint8).reshape(height, out_w, 3)
    return arr[:, left - x0 : left - x0 + width]


def decode_jpeg_box(data, key: str, hw: tuple[int, int], box: tuple[int, ...], max_pixels: int) -> np.ndarray:
    """The ``(top, left, height, width)`` ``box`` of a JPEG of size ``hw`` that :func:`jpeg_region_size`
    took: decoded alone, or, where libjpeg warns inside it, cut from :func:`decode_image` (which
    judges the file). ``(height, width, 3)`` uint8; raises as :func:`decode_image` does."""
    top, left, h, w = box
    part = decode_jpeg_region(data, key, top, left, h, w)
    if part is not None:
        return part
    img = decode_image(data, key, max_pixels=max_pixels)
    if img.shape[:2] != hw:
        raise DecodeError(key, f"decoded size {img.shape[:2]} differs from the JPEG header's {hw}")
    return img[top : top + h, left : left + w]
