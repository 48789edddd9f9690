"""The loader stage: batches of decoded, augmented samples for the training loop.

Public here: :class:`Loader` (configuration, plan and resume state; each ``iter()`` serves one
epoch), its option groups :class:`ReadOptions`, :class:`ImageOptions` and :class:`RunOptions`
(:mod:`.options`), :class:`EpochStats` (what one epoch did) and :class:`WorkerError`. The data
flow and the processes are described in this package's README.md.
"""

from ..errors import WorkerError
from .epoch_stats import EpochStats
from .loader import Loader
from .options import ImageOptions, ReadOptions, RunOptions

__all__ = ["EpochStats", "ImageOptions", "Loader", "ReadOptions", "RunOptions", "WorkerError"]
