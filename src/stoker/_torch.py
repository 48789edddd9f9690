"""PyTorch adapters (the only module that imports torch)."""
from __future__ import annotations

import numpy as np


def as_tensors(images: np.ndarray, labels: np.ndarray):
    """Wrap a batch as torch tensors without copying the images.

    ``images`` uint8 (N, 3, S, S) -> torch.uint8 tensor sharing its memory;
    ``labels`` int64 (N,) -> torch.int64 tensor.
    """
    import torch
    return torch.from_numpy(images), torch.from_numpy(labels)


def load() -> None:
    """Import torch now (about a second, once per process), not inside the first batch."""
    import torch  # noqa: F401
