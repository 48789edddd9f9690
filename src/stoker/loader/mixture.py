"""Weighted mixtures of datasets: what :func:`stoker.mix` returns, and the pure plan of a
mixture's epoch (no I/O: every function here is a function of sizes, weights, seed and epoch,
so its properties are tested without a Loader).

An epoch of a mixture is a sequence of **chunks**, each one batch (``batch_size`` samples) of
one source; a :class:`stoker.Loader` over a mixture serves the chunks as its batches.

- **Counts** (:func:`epoch_chunks`): the epoch holds ``M`` chunks, dealt to the sources by their
  weights with the largest-remainder (Hamilton) method, so each source's count is within one
  batch of ``weight * M * batch_size``. ``M`` is ``samples_per_epoch // batch_size`` when given;
  by default the largest ``M`` for which the largest-weight source (the first of equals) fits
  its share once: that source is read once per epoch (less under one batch).
- **A source smaller than its share** (``small=``): ``"repeat"`` (default) repeats it, each of
  its samples ``floor`` or ``ceil(share / size)`` times (whole passes of its own permutations,
  then part of one more); ``"take"`` takes the whole batches it has (``size // batch_size``
  chunks) and reports it (:attr:`MixEpoch.short`, which the Loader turns into a warning naming
  the source and the numbers): the epoch is shorter and the other sources keep their counts.
- **Order** (:func:`interleave`): the chunks of the sources are interleaved evenly by stride
  scheduling (the k-th chunk of a source with c chunks sits at ``(k + u) / c`` of the epoch,
  ``u`` uniform in [0, 1) seeded by (seed, epoch, source): Waldspurger and Weihl's stride
  scheduling, 1995, with a random phase), so every prefix of the epoch holds each source's
  weight within ``1 + S * w`` chunks (``S`` sources, ``w`` its weight: each source is within one
  chunk of its own schedule, and the prefix's length within ``S`` of the schedule's time). Each
  source's samples come from that source's own permutation (:func:`stoker.order.permutation` of
  its size, the loader's order, a seed of its own from (seed, source, pass)): within its share
  each sample exactly once.
- The plan is the same on every rank: ranks split the chunks (:mod:`stoker.loader.mixed`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..order import DEFAULT_WINDOW_BLOCKS, permutation

__all__ = ["SMALL_RULES", "MixEpoch", "Mixture", "epoch_chunks", "interleave", "mix", "mix_epoch", "source_ids"]

#: What a source smaller than its share does: ``"repeat"`` it, or ``"take"`` what it has.
SMALL_RULES = ("repeat", "take")
_PHASE_SALT = 0x313C
_SOURCE_SALT = 0x5043


def _weights(weights: Sequence[float], n: int) -> np.ndarray:
    """``weights`` as float64 summing to 1. TypeError / ValueError naming the bad one."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise TypeError(f"mix: weights must be a list of numbers, one per source, got {weights!r}")
    if len(weights) != n:
        raise ValueError(f"mix: {len(weights)} weights for {n} sources")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise TypeError(f"mix: weight {i} must be a number, got {type(w).__name__} {w!r}")
        if not (math.isfinite(float(w)) and float(w) > 0):
            raise ValueError(f"mix: weight {i} must be a positive finite number, got {w!r}")
    arr = np.asarray([float(x) for x in weights], dtype=np.float64)
    return arr / arr.sum()


def _hamilton(w: np.ndarray, total: int) -> np.ndarray:
    """``total`` dealt by the weights ``w`` (sum 1): floors, then one more to the largest
    remainders (the first on ties). int64, sums to ``total``."""
    exact = w * total
    out = np.floor(exact).astype(np.int64)
    left = total - int(out.sum())
    out[np.argsort(-(exact - out), kind="stable")[:left]] += 1
    return out


def epoch_chunks(
    sizes: Sequence[int],
    weights: Sequence[float],
    batch_size: int,
    samples_per_epoch: int | None = None,
    small: str = "repeat",
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Chunks (batches) of each source in one epoch, and the sources cut short.

    Args:
        sizes: samples of each source (ints >= 0).
        weights: the sources' weights (positive; normalised here).
        batch_size: samples per chunk (>= 1).
        samples_per_epoch: the epoch's samples, rounded down to whole batches; None: the
            largest-weight source read once (see the module doc).
        small: a rule of :data:`SMALL_RULES`.

    Returns:
        ``(chunks, short)``: int64 ``(S,)`` chunks per source; ``short``: ``(source, samples
        wanted, samples it has)`` of each source cut to what it has (``small="take"``).

    Raises:
        ValueError: no source, mismatched or bad weights, a bad ``small`` or ``batch_size``, an
            epoch of no whole batch (``samples_per_epoch`` under a batch, or the largest-weight
            source under one batch), named.
    """
    n = len(sizes)
    if n == 0:
        raise ValueError("mix: a mixture needs at least one source")
    w = _weights(weights, n)
    if small not in SMALL_RULES:
        raise ValueError(f"mix: small must be one of {SMALL_RULES}, got {small!r}")
    if batch_size < 1:
        raise ValueError(f"mix: batch_size must be >= 1, got {batch_size}")
    size = np.asarray(sizes, dtype=np.int64)
    if samples_per_epoch is not None:
        total = int(samples_per_epoch) // batch_size
        if total < 1:
            raise ValueError(f"mix: samples_per_epoch={samples_per_epoch} is under one batch of {batch_size}")
    else:
        k = int(np.argmax(w))
        total = int(size[k] // batch_size / w[k] + 1e-9)
        while total > 0 and _hamilton(w, total)[k] * batch_size > size[k]:
            total -= 1
        if total < 1:
            raise ValueError(
                f"mix: source {k} (the largest weight, {w[k]:.3g}) has {int(size[k])} samples, under one batch "
                f"of {batch_size}: pass samples_per_epoch= to size the epoch"
            )
    chunks = _hamilton(w, total)
    short = []
    for s in range(n):
        if chunks[s] * batch_size > size[s] and small == "take":
            short.append((s, int(chunks[s] * batch_size), int(size[s])))
            chunks[s] = size[s] // batch_size
    return chunks, short


def interleave(chunks: Sequence[int] | np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The source of each chunk of the epoch, int64 ``(sum(chunks),)``: source ``s`` exactly
    ``chunks[s]`` times, its k-th chunk at ``(k + u_s) / chunks[s]`` of the epoch (stride
    scheduling with a phase ``u_s`` uniform in [0, 1) from (seed, epoch); ties in random order).
    A pure function of its arguments."""
    c = np.asarray(chunks, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), _PHASE_SALT])))
    phase = rng.random(len(c))
    src = np.repeat(np.arange(len(c), dtype=np.int64), c)
    k = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    where = (k + phase[src]) / np.maximum(c[src], 1)
    tie = rng.random(len(src))
    return src[np.lexsort((tie, where))]


def source_ids(
    size: int,
    count: int,
    seed: int,
    epoch: int,
    source: int,
    order: str = "uniform",
    groups: Any = None,
    window: int = DEFAULT_WINDOW_BLOCKS,
) -> np.ndarray:
    """``count`` sample positions of one source (``0..size-1``), int64, in serving order: whole
    passes of the source's own permutations (each of order ``order`` over ``groups``, seeded by
    (seed, source, pass), of ``epoch``), then the first ids of one more, so each sample is served
    ``count // size`` or ``count // size + 1`` times (exactly once when ``count <= size``).
    ValueError for ``count > 0`` of an empty source."""
    if count <= 0:
        return np.zeros(0, np.int64)
    if size <= 0:
        raise ValueError(f"mix: source {source} has no samples, and its share is {count}")
    parts = []
    for p in range(-(-count // size)):
        pseed = int(np.random.SeedSequence([int(seed), int(source), p, _SOURCE_SALT]).generate_state(1)[0])
        parts.append(permutation(size, pseed, epoch, order, groups=groups, window=window))
    return np.concatenate(parts)[:count].astype(np.int64, copy=False)


@dataclass(frozen=True)
class MixEpoch:
    """The plan of one mixture epoch (:func:`mix_epoch`).

    Attributes:
        chunk_size: samples per chunk (the Loader's batch size).
        source: the source of each chunk, int64 ``(M,)``.
        start: each chunk's first position in its source's ``ids``, int64 ``(M,)``.
        ids: per source, its sample positions in serving order (int64, ``chunks[s] * batch_size``).
        short: ``(source, samples wanted, samples it has)`` of the sources cut short (``"take"``).
    """

    chunk_size: int
    source: np.ndarray
    start: np.ndarray
    ids: tuple[np.ndarray, ...]
    short: tuple[tuple[int, int, int], ...] = ()

    def chunk(self, j: int) -> tuple[int, np.ndarray]:
        """``(source, sample positions)`` of chunk ``j``."""
        s, a = int(self.source[j]), int(self.start[j])
        return s, self.ids[s][a : a + self.chunk_size]

    def counts(self) -> np.ndarray:
        """Samples of each source in the epoch, int64 ``(S,)``."""
        return np.asarray([len(x) for x in self.ids], dtype=np.int64)


def mix_epoch(
    sizes: Sequence[int],
    weights: Sequence[float],
    batch_size: int,
    seed: int,
    epoch: int,
    *,
    samples_per_epoch: int | None = None,
    small: str = "repeat",
    order: str = "uniform",
    groups: Sequence[Any] | None = None,
    window: int = DEFAULT_WINDOW_BLOCKS,
) -> MixEpoch:
    """The plan of ``epoch``: :func:`epoch_chunks`, :func:`interleave`, and :func:`source_ids`
    per source (``groups[s]``: source s's block of each sample, for the ``blockwise`` order).
    A pure function of its arguments: the same on every rank and process. ValueError as
    :func:`epoch_chunks`."""
    chunks, short = epoch_chunks(sizes, weights, batch_size, samples_per_epoch, small)
    src = interleave(chunks, seed, epoch)
    start = np.zeros(len(src), dtype=np.int64)
    for s in range(len(chunks)):
        at = np.flatnonzero(src == s)
        start[at] = np.arange(len(at), dtype=np.int64) * batch_size
    ids = tuple(
        source_ids(
            int(sizes[s]),
            int(chunks[s]) * batch_size,
            seed,
            epoch,
            s,
            order,
            None if groups is None else groups[s],
            window,
        )
        for s in range(len(chunks))
    )
    return MixEpoch(int(batch_size), src, start, ids, tuple(short))


class Mixture:
    """Datasets mixed by weight (:func:`stoker.mix`): read by a :class:`stoker.Loader` like a dataset.

    Attributes:
        sources: the datasets (:class:`stoker.store.dataset.Dataset`, whole or subsets), each
            read through its own node cache as when read alone.
        weights: their weights, normalised to sum 1 (float).
        samples_per_epoch: the epoch's samples (rounded down to whole batches by the Loader), or
            None (the largest-weight source read once).
        small: what a source smaller than its share does (:data:`SMALL_RULES`).
        names: a short name per source (``name=`` of :func:`stoker.mix`, else ``"0"``, ``"1"``, ...),
            used in ``loader.stats.sources`` and warnings.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        *,
        samples_per_epoch: int | None = None,
        small: str = "repeat",
        names: Sequence[str] | None = None,
    ) -> None:
        sources = list(sources)
        if not sources:
            raise ValueError("mix: a mixture needs at least one source")
        for i, ds in enumerate(sources):
            if not hasattr(ds, "blocks") or not hasattr(ds, "version"):
                raise TypeError(
                    f"mix: source {i} must be a stoker Dataset (stoker.open_dataset), got {type(ds).__name__}"
                )
        self.sources = sources
        self.weights = tuple(float(x) for x in _weights(weights, len(sources)))
        if small not in SMALL_RULES:
            raise ValueError(f"mix: small must be one of {SMALL_RULES}, got {small!r}")
        if samples_per_epoch is not None and (
            isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, numbers.Integral)
        ):
            raise TypeError(f"mix: samples_per_epoch must be an int, got {samples_per_epoch!r}")
        self.samples_per_epoch = None if samples_per_epoch is None else int(samples_per_epoch)
        self.small = small
        self.names = tuple(str(i) for i in range(len(sources))) if names is None else tuple(str(x) for x in names)
        if len(self.names) != len(sources) or len(set(self.names)) != len(self.names):
            raise ValueError(f"mix: names must be {len(sources)} distinct names, got {list(self.names)}")

    def sizes(self) -> list[int]:
        """Samples of each source."""
        return [len(ds) for ds in self.sources]

    def identity(self) -> dict:
        """What a resume state of a loader over this mixture must agree on: each source's URL,
        content version and subset, the weights, the rule and the epoch size (plain values)."""
        return {
            "sources": [
                {
                    "name": name,
                    "url": str(getattr(ds, "url", "")),
                    "version": ds.version,
                    "subset": getattr(ds, "selection_digest", None),
                    "samples": len(ds),
                }
                for name, ds in zip(self.names, self.sources, strict=True)
            ],
            "weights": [round(w, 12) for w in self.weights],
            "small": self.small,
            "samples_per_epoch": self.samples_per_epoch,
        }

    def __len__(self) -> int:
        return sum(self.sizes())

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{name}={getattr(ds, 'url', '?')!r}:{w:.3g}"
            for name, ds, w in zip(self.names, self.sources, self.weights, strict=True)
        )
        return f"Mixture({parts}, small={self.small!r}, samples_per_epoch={self.samples_per_epoch})"


def mix(
    sources: Sequence[Any],
    weights: Sequence[float],
    *,
    samples_per_epoch: int | None = None,
    small: str = "repeat",
    names: Sequence[str] | None = None,
) -> Mixture:
    """Datasets mixed by weight, for a :class:`stoker.Loader`: ``stoker.mix([web, code, books],
    weights=[0.6, 0.3, 0.1])``. See :class:`Mixture` for the arguments and this module's doc
    for the epoch's counts, order and the ``small=`` rule.

    Raises:
        TypeError: a source that is not a stoker Dataset, a weight that is not a number.
        ValueError: no source, a weight per source missing or not positive, a bad ``small``,
            names not one per source or repeated.
    """
    return Mixture(sources, weights, samples_per_epoch=samples_per_epoch, small=small, names=names)
