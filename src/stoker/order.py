"""Epoch order: permutations as pure functions of (seed, epoch), split evenly over ranks.

Every permutation is registered by name and is a pure function of
``(num_samples, seed, epoch)`` (the Mosaic Streaming lesson: shuffles you can
test and reproduce). :func:`rank_plan` splits one permutation over ``world_size``
ranks so that every rank gets the same number of samples by construction
(uneven counts hang DDP).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

PermutationFn = Callable[[int, int, int], np.ndarray]
PERMUTATIONS: dict[str, PermutationFn] = {}


def register_permutation(name: str):
    """Decorator: register ``fn(num_samples, seed, epoch) -> int64 array`` under ``name``."""
    def deco(fn: PermutationFn) -> PermutationFn:
        PERMUTATIONS[name] = fn
        return fn
    return deco


@register_permutation("pcg64")
def pcg64_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Uniform random permutation of ``range(num_samples)`` from PCG64 seeded by (seed, epoch)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), 0x570CE])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


@register_permutation("sequential")
def sequential_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Identity order (``shuffle=False``)."""
    return np.arange(num_samples, dtype=np.int64)


def permutation(num_samples: int, seed: int, epoch: int, name: str = "pcg64") -> np.ndarray:
    """Return the epoch's permutation, int64 array of shape (num_samples,). KeyError for unknown names."""
    try:
        fn = PERMUTATIONS[name]
    except KeyError:
        raise KeyError(f"unknown permutation {name!r}; registered: {sorted(PERMUTATIONS)}") from None
    return fn(num_samples, seed, epoch)


def rank_plan(perm: np.ndarray, rank: int, world_size: int, even: str = "pad") -> np.ndarray:
    """The sample ids of ``rank`` for one epoch, int64 array.

    Every rank gets exactly ``ceil(N / world_size)`` samples with ``even="pad"``
    (the first ``pad`` ids of the permutation are repeated, so each sample is read
    at least once and at most ``pad < world_size`` samples twice, like PyTorch's
    DistributedSampler), or ``floor(N / world_size)`` with ``even="drop"`` (the
    last ``N mod world_size`` ids of this epoch's permutation are skipped; a
    different set each epoch). With ``N % world_size == 0`` both give every sample
    exactly once across ranks. Raises ValueError for a bad rank or mode.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    n = len(perm)
    if even == "pad":
        total = -(-n // world_size) * world_size
        if total > n:
            perm = np.concatenate([perm, perm[: total - n]])
    elif even == "drop":
        perm = perm[: (n // world_size) * world_size]
    else:
        raise ValueError(f"even must be 'pad' or 'drop', got {even!r}")
    return perm[rank::world_size]


def sample_seed(seed: int, epoch: int, sample_id: int) -> np.random.SeedSequence:
    """Seed for one sample's augmentation: pure in (seed, epoch, sample id), so the
    pixels of a sample do not depend on which worker decodes it or on resume."""
    return np.random.SeedSequence([int(seed), int(epoch), int(sample_id), 0xA06])
