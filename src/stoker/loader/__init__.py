"""The loader stage: batches of decoded, augmented samples for the training loop.

Public here: :class:`Loader` (configuration, plan and resume state; each ``iter()`` runs one
epoch), :class:`EpochStats` (what one epoch did) and :class:`WorkerError`. The data flow and
the processes are described in this package's README.md.
"""
from .loader import EpochStats, Loader, WorkerError

__all__ = ["EpochStats", "Loader", "WorkerError"]
