"""Single-process decode + transform rate (r_core of the decode bound, benchmarks/README.md)."""

from __future__ import annotations

import time

import numpy as np

from .reference import pillow_decode_transform
from .resample import one_intra_op_thread
from .transforms import decode_transform

__all__ = ["measure_decode_rate"]


def measure_decode_rate(
    payloads: list[bytes],
    mode: str = "train",
    min_seconds: float = 2.0,
    recipe: str = "stoker",
    *,
    size: int = 224,
    seed: int = 0,
) -> float:
    """Decode + transform rate of one process, from memory.

    Cycles over ``payloads`` (at least one full pass) until ``min_seconds`` of wall time have
    elapsed, writing into one reused output buffer for the stoker recipe, with torch's intra-op
    pool held at one thread (restored afterwards).

    Args:
        payloads: encoded images (bytes); must be non-empty and decodable.
        mode: ``"train"`` (RandomResizedCrop + flip) or ``"eval"`` (Resize + CenterCrop).
        min_seconds: minimum measuring time in seconds (wall clock, ``time.perf_counter``).
        recipe: ``"stoker"`` (:func:`~stoker.decode.transforms.decode_transform`) or
            ``"pillow"`` (the reference recipe, Pillow decode + Pillow resize).
        size: output side in pixels.
        seed: seed of the crop/flip RNG.

    Returns:
        Throughput in samples/s (float).

    Raises:
        ValueError: empty ``payloads``, unknown ``mode`` or ``recipe``.
        DecodeError: a payload cannot be decoded (stoker recipe).
    """
    if not payloads:
        raise ValueError("payloads is empty")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    rng = np.random.default_rng(seed)
    if recipe == "stoker":
        out = np.empty((3, size, size), np.uint8)

        def step(data: bytes, i: int) -> None:
            decode_transform(data, f"payload-{i}", mode, rng, size=size, out=out)

    elif recipe == "pillow":

        def step(data: bytes, i: int) -> None:
            pillow_decode_transform(data, mode, rng, size)

    else:
        raise ValueError(f"recipe must be 'stoker' or 'pillow', got {recipe!r}")
    n = 0
    count = len(payloads)
    with one_intra_op_thread():  # one core's rate: torch's resize kernel on one thread
        start = time.perf_counter()
        while True:
            i = n % count
            step(payloads[i], i)
            n += 1
            elapsed = time.perf_counter() - start
            if n >= count and elapsed >= min_seconds:
                return n / elapsed
