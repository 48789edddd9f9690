"""Single-process decode + transform rate (r_core of the decode bound, benchmarks/README.md), for
the benchmarks, the demo and `stoker plan`.

One timed run on a shared machine catches whatever else the cores were doing at that moment (the
demo's per-core rate once read 788/s and 1,200/s in two runs on one machine).
:func:`measure_decode_rounds` times several short rounds instead, the recipes taking turns, so a
caller can spread the rounds over its run and take the median (:func:`median_rate`): one slow or
fast moment then moves the figure by one round out of many, and each recipe sees the same moments.
Each round is timed on two clocks: the wall clock (what the core gave this process) and the
thread's CPU clock (what one core does when it is all this process's: time spent waiting for a
core that other processes held is not counted, so it holds still while the machine's load moves).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from stoker.decode.resample import one_intra_op_thread
from stoker.decode.transforms import decode_transform

from .reference import pillow_decode_transform

__all__ = ["DecodeRound", "measure_decode_rate", "measure_decode_rounds", "median_rate", "time_decode_round"]


class DecodeRound(NamedTuple):
    """One timed round of :func:`time_decode_round`: ``samples`` decoded in ``wall_s`` seconds of
    wall time and ``cpu_s`` seconds of the thread's CPU time."""

    samples: int
    wall_s: float
    cpu_s: float

    @property
    def wall_rate(self) -> float:
        """Samples per wall second (0.0 for an empty round)."""
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_rate(self) -> float:
        """Samples per CPU second of the decoding thread: one core's rate with the core to itself."""
        return self.samples / self.cpu_s if self.cpu_s > 0 else 0.0


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
    return time_decode_round(payloads, mode, min_seconds, recipe, size=size, seed=seed).wall_rate


def time_decode_round(
    payloads: list[bytes],
    mode: str = "train",
    min_seconds: float = 0.5,
    recipe: str = "stoker",
    *,
    size: int = 224,
    seed: int = 0,
) -> DecodeRound:
    """One timed round of :func:`measure_decode_rate`: at least one pass over ``payloads`` and
    ``min_seconds`` of wall time, timed on the wall clock (``time.perf_counter``) and on this
    thread's CPU clock (``time.thread_time``; torch's resize kernel and OpenCV run on this thread,
    held to one).

    Returns:
        :class:`DecodeRound` (samples, wall seconds, CPU seconds).

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
    return time_loop(lambda i: step(payloads[i], i), len(payloads), min_seconds)


def time_loop(step: Callable[[int], object], count: int, min_seconds: float) -> DecodeRound:
    """Time ``step(i)`` cycled over ``i = 0 .. count - 1`` (at least one pass and ``min_seconds``
    of wall time) on one torch intra-op thread (one core's rate), on the wall clock and this
    thread's CPU clock. ``count`` must be >= 1; what ``step`` raises propagates."""
    n = 0
    with one_intra_op_thread():  # one core's rate: torch's resize kernel on one thread
        start, cpu_start = time.perf_counter(), time.thread_time()
        while True:
            step(n % count)
            n += 1
            elapsed = time.perf_counter() - start
            if n >= count and elapsed >= min_seconds:
                return DecodeRound(n, elapsed, time.thread_time() - cpu_start)


def measure_decode_rounds(
    payloads: list[bytes],
    rounds: int = 3,
    recipes: tuple[str, ...] = ("stoker", "pillow"),
    round_seconds: float = 0.5,
    mode: str = "train",
    *,
    size: int = 224,
    seed: int = 0,
) -> dict[str, list[DecodeRound]]:
    """Decode + transform timings of one process in ``rounds`` interleaved rounds per recipe.

    Each recipe first decodes a few payloads untimed (first-call costs: buffers, torch's kernel
    set-up), then round by round every recipe is timed once, in turn (stoker, pillow, stoker,
    pillow, ...), each for at least ``round_seconds`` and one pass over ``payloads``
    (:func:`time_decode_round`), so the recipes share whatever the machine did meanwhile.

    Args:
        payloads, mode, size, seed: as :func:`measure_decode_rate` (each round reseeds ``seed``).
        rounds: timed rounds per recipe (>= 1).
        recipes: the recipes, in the order they take turns.
        round_seconds: minimum wall seconds of one round.

    Returns:
        ``{recipe: [DecodeRound of each round, in order]}``; ``median_rate([r.cpu_rate for r in
        ...])`` summarises one.

    Raises:
        ValueError: ``rounds < 1``, no recipe, and what :func:`time_decode_round` raises.
    """
    if rounds < 1 or not recipes:
        raise ValueError(f"rounds must be >= 1 and recipes non-empty, got {rounds}, {recipes!r}")
    warm = payloads[: min(len(payloads), 8)]
    for recipe in recipes:
        time_decode_round(warm, mode, 0.0, recipe, size=size, seed=seed)
    out: dict[str, list[DecodeRound]] = {r: [] for r in recipes}
    for _ in range(rounds):
        for recipe in recipes:
            out[recipe].append(time_decode_round(payloads, mode, round_seconds, recipe, size=size, seed=seed))
    return out


def median_rate(rates: list[float]) -> float:
    """The median of measured rates (samples/s): the figure a run of timed rounds stands for.

    Raises:
        ValueError: ``rates`` is empty.
    """
    if not rates:
        raise ValueError("no decode rate was measured")
    return float(statistics.median(rates))
