"""JPEG decode on the accelerator (nvJPEG) with a per-sample CPU fallback, and the train transform on it.

Backends, first that imports (:func:`find_backend`):

* ``torchvision``: ``torchvision.io.decode_jpeg(list of uint8 tensors, mode=RGB, device="cuda")``
  (nvJPEG; batched);
* ``nvimgcodec``: NVIDIA nvImageCodec's ``Decoder().decode(list of bytes)`` (nvJPEG / the
  hardware JPEG decoder), results taken zero-copy through ``__cuda_array_interface__``.

What goes to the GPU is screened on the CPU first, from the headers only (libjpeg-turbo in
strict mode): a JPEG whose headers libjpeg warns about (corrupt EXIF, stray bytes before a
marker), a CMYK/YCCK JPEG, one that does not end with an EOI marker (truncated: nvJPEG may fill
the missing part instead of failing), or one above ``max_pixels`` is decoded by the CPU path
(:func:`stoker.decode.decode_image`: libjpeg-turbo, else Pillow), as is any sample whose GPU
decode raises or returns another size than its header declares. A sample no decoder reads
raises :class:`stoker.decode.DecodeError` naming its key. So the GPU path never returns pixels
the CPU path would have refused.

The GPU decode is not bit-identical to the CPU path (nvJPEG's IDCT and chroma upsampling
differ); ``scripts/gpu_check.py`` measures the difference on the shared cases. This module is
unverified on a GPU in this repository's test suite (no device here); its fallback logic is
tested with an injected decoder on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import simplejpeg
import torch
import torch.nn.functional as F

from .._torch import check_device
from .image import DEFAULT_MAX_PIXELS, DecodeError, decode_image, read_exif_orientation
from .transforms import center_offsets, eval_resize_for, random_resized_crop_params, resized_hw

__all__ = ["GpuJpegDecoder", "GpuDecodeStats", "find_backend", "gpu_eligible"]

_CMYK = frozenset({"CMYK", "YCCK"})


def gpu_eligible(data, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int] | None:
    """``(height, width)`` if ``data`` may be decoded on the GPU, else None (see module docstring)."""
    if len(data) < 4 or bytes(data[:3]) != b"\xff\xd8\xff" or bytes(data[-2:]) != b"\xff\xd9":
        return None
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data, strict=True)
    except ValueError:
        return None
    if colorspace in _CMYK or h <= 0 or w <= 0 or h * w > max_pixels:
        return None
    return h, w


def find_backend(device) -> tuple[str, object]:
    """``(name, decode_fn)`` of the first GPU JPEG decoder that imports; ``decode_fn(list of
    bytes) -> list of (3, H, W) uint8 tensors on device``.

    Raises:
        RuntimeError: neither torchvision (with GPU decode) nor nvImageCodec is importable.
    """
    why = []
    try:
        import torchvision.io as tvio

        def tv(datas):
            ts = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
            return tvio.decode_jpeg(ts, mode=tvio.ImageReadMode.RGB, device=device)

        return "torchvision", tv
    except Exception as exc:  # noqa: BLE001 - ImportError or a torch/torchvision mismatch
        why.append(f"torchvision: {type(exc).__name__}: {exc}")
    try:
        from nvidia import nvimgcodec

        dec = nvimgcodec.Decoder()

        def nv(datas):
            out = dec.decode([bytes(d) for d in datas])
            return [torch.as_tensor(im, device=device).permute(2, 0, 1) for im in out]

        return "nvimgcodec", nv
    except Exception as exc:  # noqa: BLE001
        why.append(f"nvimgcodec: {type(exc).__name__}: {exc}")
    raise RuntimeError("no GPU JPEG decoder: " + "; ".join(why))


@dataclass
class GpuDecodeStats:
    """Samples decoded on the ``gpu``, by the CPU ``screened`` out before (headers), by the CPU
    after a GPU ``gpu_failed`` error or wrong size, and ``batch_errors`` (batched calls that
    raised and were retried one sample at a time)."""

    gpu: int = 0
    screened: int = 0
    gpu_failed: int = 0
    batch_errors: int = 0


class GpuJpegDecoder:
    """Decode batches of JPEGs on ``device``, falling back to the CPU path per sample.

    Args:
        device: ``"cuda[:N]"`` (or ``"cpu"`` with an injected ``decode_fn``, for tests).
        decode_fn: ``list of bytes -> list of (3, H, W) uint8 tensors``; default
            :func:`find_backend`.
        exif_orientation, max_pixels: as :func:`stoker.decode.decode_image`.

    Raises:
        RuntimeError: no backend (see :func:`find_backend`) or CUDA missing.
    """

    def __init__(
        self, device="cuda", decode_fn=None, *, exif_orientation: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS
    ):
        self.device = torch.device(device)
        if decode_fn is None:
            check_device(self.device)
            self.backend, decode_fn = find_backend(self.device)
        else:
            self.backend = getattr(decode_fn, "__name__", "custom")
        self._decode_fn = decode_fn
        self.exif_orientation, self.max_pixels = exif_orientation, max_pixels
        self.stats = GpuDecodeStats()

    def _cpu(self, data, key: str) -> torch.Tensor:
        arr = decode_image(data, key, exif_orientation=self.exif_orientation, max_pixels=self.max_pixels)
        return torch.from_numpy(arr).permute(2, 0, 1).to(self.device)

    def _gpu_one(self, data) -> torch.Tensor | None:
        try:
            return self._decode_fn([data])[0]
        except Exception:  # noqa: BLE001 - any backend failure means: decode it on the CPU
            return None

    def decode(self, datas: list, keys: list[str], skip_errors: bool = False) -> list[torch.Tensor | None]:
        """Decode ``datas`` (encoded bytes) to ``(3, H, W)`` uint8 tensors on the device.

        Args:
            skip_errors: a sample neither path reads becomes ``None`` instead of raising.

        Raises:
            DecodeError: a sample neither the GPU nor the CPU path reads (names its key).
        """
        out: list[torch.Tensor | None] = [None] * len(datas)
        sizes = {i: hw for i, d in enumerate(datas) if (hw := gpu_eligible(d, self.max_pixels)) is not None}
        todo = list(sizes)  # the samples the GPU decodes; the rest (and its failures) go to the CPU
        if todo:
            try:
                got = list(self._decode_fn([datas[i] for i in todo]))
                if len(got) != len(todo):
                    raise RuntimeError(f"decoder returned {len(got)} images for {len(todo)}")
            except Exception:  # noqa: BLE001 - retry one by one to find the sample(s) at fault
                self.stats.batch_errors += 1
                got = [self._gpu_one(datas[i]) for i in todo]
            for i, t in zip(todo, got):
                h, w = sizes[i]
                if t is None or tuple(t.shape) != (3, h, w) or t.dtype != torch.uint8:
                    self.stats.gpu_failed += 1
                    continue
                if self.exif_orientation:
                    t = _orient_chw(t, read_exif_orientation(datas[i], keys[i]))
                out[i] = t
                self.stats.gpu += 1
        for i, t in enumerate(out):
            if t is None:
                if i not in sizes:
                    self.stats.screened += 1
                try:
                    out[i] = self._cpu(datas[i], keys[i])
                except DecodeError:
                    if not skip_errors:
                        raise
        return out

    def train_batch(self, datas: list, keys: list[str], rngs: list, size: int = 224) -> torch.Tensor:
        """RandomResizedCrop(size) + flip of each sample on the device: ``(N, 3, size, size)`` uint8.

        Crop and flip draws as :func:`stoker.decode.transforms.train_transform` (same RNG order);
        resampling is ``F.interpolate(bilinear, antialias=True)``, torchvision's tensor
        equivalent of Pillow's BILINEAR.
        """
        return self.transform_batch(self.decode(datas, keys), "train", rngs, size)

    def transform_batch(
        self, imgs: list, mode: str, rngs: list | None, size: int = 224, resize: int | None = None
    ) -> torch.Tensor:
        """The train or eval transform of decoded ``(3, H, W)`` uint8 device tensors, on the device.

        ``"train"``: RandomResizedCrop(size) + flip, crop and flip drawn from ``rngs[j]`` exactly as
        :func:`stoker.decode.transforms.train_transform` draws them (so the boxes are the CPU
        path's). ``"eval"``: Resize(``resize``, default 256 for 224) of the shorter side +
        CenterCrop(size), torchvision's size and offset rules. Resampling is
        ``F.interpolate(bilinear, antialias=True)``, torchvision's tensor equivalent of Pillow's
        BILINEAR.

        Returns:
            ``(N, 3, size, size)`` uint8 on the device.

        Raises:
            ValueError: unknown ``mode``, train without ``rngs``, or eval with ``size > resize``.
        """
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        if mode == "train" and rngs is None:
            raise ValueError("mode='train' needs rngs (one numpy Generator per image)")
        draws = rngs or []
        resize = eval_resize_for(size) if resize is None else resize
        if mode == "eval" and size > resize:
            raise ValueError(f"crop size {size} larger than resize {resize}")
        out = torch.empty((len(imgs), 3, size, size), dtype=torch.uint8, device=self.device)
        for j, img in enumerate(imgs):
            H, W = int(img.shape[1]), int(img.shape[2])
            if mode == "train":
                top, left, h, w = random_resized_crop_params(H, W, draws[j])
                flip = bool(draws[j].random() < 0.5)
                out[j] = _resample(img[:, top : top + h, left : left + w], size, size, flip)
            else:
                nh, nw = resized_hw(H, W, resize)
                res = _resample(img, nh, nw, False)
                top, left = center_offsets(nh, nw, size)
                out[j] = res[:, top : top + size, left : left + size]
        return out


def _resample(img: torch.Tensor, out_h: int, out_w: int, flip: bool) -> torch.Tensor:
    """Antialiased bilinear resize of a ``(3, h, w)`` uint8 tensor to ``(3, out_h, out_w)`` uint8."""
    res = F.interpolate(
        img.unsqueeze(0).float(), size=(out_h, out_w), mode="bilinear", align_corners=False, antialias=True
    )
    res = res[0].round_().clamp_(0, 255).to(torch.uint8)
    return res.flip(-1) if flip else res


def _orient_chw(t: torch.Tensor, orientation: int) -> torch.Tensor:
    """EXIF orientation 1..8 on a (3, H, W) tensor, as ``stoker.decode.image._orient_array``."""
    ops = {
        2: lambda x: x.flip(-1),
        3: lambda x: x.flip(-1).flip(-2),
        4: lambda x: x.flip(-2),
        5: lambda x: x.transpose(-1, -2),
        6: lambda x: torch.rot90(x, -1, (-2, -1)),
        7: lambda x: x.transpose(-1, -2).flip(-1).flip(-2),
        8: lambda x: torch.rot90(x, 1, (-2, -1)),
    }
    return ops[orientation](t).contiguous() if orientation in ops else t
