"""The loader stage: batches of decoded, augmented samples for the training loop.

Public here: :class:`Loader` (configuration, plan and resume state; each ``iter()`` serves one
epoch), :class:`EpochStats` (what one epoch did) and :class:`WorkerError`. The data flow and
the processes are described in this package's README.md.
"""
from .epoch_stats import EpochStats
from .loader import Loader
from .procs import WorkerError

__all__ = ["EpochStats", "Loader", "WorkerError"]
