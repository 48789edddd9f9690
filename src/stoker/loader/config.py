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
        decode: the user's ``decode(fields, rng) -> sample``, or None (:mod:`stoker.loader.batches`).
        collate: the user's ``collate(samples) -> batch``, or None (:func:`stoker.collate.default`
            when ``decode`` is set).
    """

    transform: str
    seed: int
    image_size: int
    on_error: str
    exif_orientation: bool
    batch_size: int
    decode_on: str = "cpu"
    derived: Any = None
    decode: Any = None
    collate: Any = None

    @property
    def generic(self) -> bool:
        """True when the user's decode/collate make the batches (not the built-in image recipes)."""
        return self.decode is not None or self.collate is not None

    def check_picklable(self, start_method: str) -> None:
        """Check that ``decode`` and ``collate`` can be sent to workers started with
        ``start_method`` (``fork`` sends nothing: a child inherits them).

        Raises:
            TypeError: one of them cannot be pickled; names the function and says what to do.
        """
        if start_method == "fork":
            return
        import pickle
        for role, fn in (("decode", self.decode), ("collate", self.collate)):
            if fn is None:
                continue
            try:
                pickle.dumps(fn)
            except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
                name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
                raise TypeError(
                    f"{role}={name} cannot be sent to worker processes started with {start_method!r}: it does not "
                    f"pickle ({type(exc).__name__}: {exc}). Define it at the top level of a module the workers can "
                    f"import (not a lambda or a nested function), or pass start_method='fork'") from exc
