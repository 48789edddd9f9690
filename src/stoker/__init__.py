"""stoker: keeps deep-learning accelerators fed with training data.

Public API: :func:`open_dataset` (a packed dataset through the node cache, set by
:class:`CacheOptions`),
:func:`mix` (datasets mixed by weight, a :class:`Mixture` a Loader reads like a dataset),
:class:`Loader` (decoded, augmented batches as torch tensors; its option groups
:class:`ReadOptions`, :class:`ImageOptions`, :class:`RunOptions`), :func:`pack` (its less
common settings in :class:`PackOptions`), :class:`Writer` (samples made in Python, written as a
packed dataset),
:mod:`collate` (built-in collates for ``Loader(collate=...)``), :mod:`decode` (its :func:`decode.jpeg`:
the built-in transforms' fast region decode and resize, for a ``Loader(decode=...)`` of your own;
imported on first use, as it loads torch and OpenCV), :func:`parse_size` (``"64MiB"`` ->
bytes; every byte-size argument accepts such strings), and every
public error (:mod:`stoker.errors`, all subclasses of :class:`StokerError`).
"""

from ._units import parse_size
from .errors import (
    CacheDirError,
    CacheInUseError,
    CacheLockTimeout,
    CacheModeError,
    CacheUnwritableError,
    CapacityError,
    ChecksumError,
    CollateError,
    DatasetChangedError,
    DatasetExistsError,
    DecodeError,
    EntryError,
    ExtenderRequestError,
    ForkUnsafeError,
    ImageTooLarge,
    IndexFormatError,
    NotACacheError,
    OriginError,
    OriginNotFoundError,
    OriginPermissionError,
    PackLeaseError,
    PackLeaseLostError,
    PeerUnavailable,
    ProcessGroupError,
    RankSetupError,
    SampleFnError,
    ServiceStartError,
    SharedMemoryError,
    SourceArchiveError,
    SourceError,
    SourceNotFoundError,
    NotADataLoaderError,
    NotADatasetError,
    StaleIteratorError,
    StokerError,
    UnsafePathError,
    WorkerError,
    WorkerStartError,
)
from . import collate
from .cache.spec import CacheOptions
from .loader import EpochStats, ImageOptions, Loader, ReadOptions, RunOptions
from .loader.mixture import Mixture, mix
from .store.dataset import Dataset, open_dataset
from .store.pack import pack
from .store.pack_options import PackOptions
from .store.writer import Writer

__version__ = "0.1.0"
__all__ = [
    "CacheDirError",
    "CacheInUseError",
    "CacheLockTimeout",
    "CacheModeError",
    "CacheOptions",
    "CacheUnwritableError",
    "CapacityError",
    "ChecksumError",
    "CollateError",
    "Dataset",
    "DatasetChangedError",
    "DatasetExistsError",
    "DecodeError",
    "EntryError",
    "EpochStats",
    "ExtenderRequestError",
    "ForkUnsafeError",
    "ImageOptions",
    "ImageTooLarge",
    "IndexFormatError",
    "Loader",
    "Mixture",
    "NotACacheError",
    "NotADataLoaderError",
    "NotADatasetError",
    "OriginError",
    "OriginNotFoundError",
    "OriginPermissionError",
    "PackLeaseError",
    "PackLeaseLostError",
    "PackOptions",
    "PeerUnavailable",
    "ProcessGroupError",
    "RankSetupError",
    "ReadOptions",
    "RunOptions",
    "SampleFnError",
    "ServiceStartError",
    "SharedMemoryError",
    "SourceArchiveError",
    "SourceError",
    "SourceNotFoundError",
    "StaleIteratorError",
    "StokerError",
    "UnsafePathError",
    "WorkerError",
    "WorkerStartError",
    "Writer",
    "__version__",
    "collate",
    "decode",
    "mix",
    "open_dataset",
    "pack",
    "parse_size",
]
assert __all__ == sorted(__all__), "keep stoker.__all__ sorted"


def __getattr__(name: str):
    """``stoker.decode``, imported on first use (it loads torch and OpenCV; ``import stoker`` does not)."""
    if name == "decode":
        import importlib

        return importlib.import_module(".decode", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
