"""What the decode workers (and the device decoder) need to know: one frozen record per loader.

It is built once from the :class:`stoker.loader.Loader` arguments and pickled to every worker
process with its first task queue; being frozen, no process can change it under another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerConfig"]


@dataclass(frozen=True)
class WorkerConfig:
    """How a batch's samples are decoded and augmented.

    Attributes:
        transform: ``"train"`` (RandomResizedCrop + flip, per-sample RNG) or ``"eval"``
            (resize 256 + center crop), see :mod:`stoker.decode.transforms`.
        seed: the loader's seed; each sample's RNG is seeded from (seed, epoch, sample id)
            (:func:`stoker.order.sample_seed`).
        image_size: output side S in pixels; images are uint8 (3, S, S).
        on_error: ``"raise"`` (a sample no decoder reads fails the batch) or ``"skip"``.
        exif_orientation: apply the EXIF orientation tag when decoding.
        batch_size: samples per batch (the slot layout, :mod:`stoker.loader.shm`).
        decode_on: ``"cpu"`` (the workers decode) or ``"device"`` (the workers only read and
            verify bytes; the training process decodes, :mod:`stoker.loader.device_decode`).
        derived: the derived-sample cache (:class:`stoker.loader.derived.DerivedCache`) the
            workers read from and fill, or None (set when the pipeline starts, with
            :func:`dataclasses.replace`).
    """

    transform: str
    seed: int
    image_size: int
    on_error: str
    exif_orientation: bool
    batch_size: int
    decode_on: str = "cpu"
    derived: Any = None
