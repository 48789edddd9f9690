"""stoker: keeps deep-learning accelerators fed with training data.

Public API: :func:`open_dataset` (a packed dataset through the node cache),
:class:`Loader` (decoded, augmented batches as torch tensors), :func:`pack`.
"""
from .loader import EpochStats, Loader, WorkerError
from .store.dataset import ChecksumError, Dataset, open_dataset
from .store.pack import pack
from .storage import OriginError

__version__ = "0.1.0"
__all__ = ["open_dataset", "Dataset", "Loader", "EpochStats", "WorkerError", "pack",
           "OriginError", "ChecksumError", "__version__"]
