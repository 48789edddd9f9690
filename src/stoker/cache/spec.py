"""The node cache's settings in one frozen group, :class:`CacheOptions`.

``open_dataset`` and the cluster's entry points take ``cache=CacheOptions(...)`` and pass it whole
to where the cache is built; ``cache_dir=``/``cache_bytes=`` stay beside it as the shortcut for its
first two fields (:func:`with_shortcuts`); an old keyword that moved in still works for one
release, with a DeprecationWarning (:func:`moved`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import numpy as np

from .._names import suggest_fields
from .._units import parse_size
from . import perms
from .disk import POLICIES

__all__ = ["DEFAULT_CACHE_BYTES", "MOVED", "CacheOptions", "moved", "with_shortcuts"]

#: The budget of a node cache when none is given: 8 GiB.
DEFAULT_CACHE_BYTES = 8 << 30
#: The ``open_dataset`` keywords that moved into :class:`CacheOptions` (each field keeps its name).
MOVED = ("memory_bytes", "memory_dir", "cache_policy", "cache_mode", "cache_read_only")


@suggest_fields
@dataclass(frozen=True)
class CacheOptions:
    """Where the node cache is, how big, and how it keeps its blocks.

    Attributes:
        cache_dir: the cache directory (str or path; None: :func:`stoker.cache.paths.default_cache_dir`;
            in :mod:`stoker.cluster` the root of the nodes' directories, default ``<that>/cluster``).
        cache_bytes: the budget in bytes, an int or a size string such as ``"500GiB"`` (kept as an
            int); None: 8 GiB (:data:`DEFAULT_CACHE_BYTES`), said once in a warning. In
            :mod:`stoker.cluster` also ``{Ray node id: size}``: a node not named gets no cache.
        memory_bytes: budget of a shared-memory tier above the disk tier (0, the default: none;
            :mod:`stoker.cache.tiered`); ``memory_dir``: its directory (None: under /dev/shm).
        cache_policy: ``"future"`` (default; :mod:`stoker.cache.policy`), ``"noevict"`` or ``"lru"``.
        cache_mode: file mode of all the cache creates, an int or an octal string such as
            ``"0640"`` (kept as an int); None: ``$STOKER_CACHE_MODE`` or 0600
            (:mod:`stoker.cache.perms`; a cache made with another mode raises
            :class:`stoker.CacheModeError`).
        cache_read_only: serve the cache as it is and write nothing there: cached blocks are read,
            the rest comes from the origin and is not kept (:class:`stoker.cache.readonly.ReadOnlyCache`;
            ValueError with a memory tier, :class:`stoker.NotACacheError` for a directory without
            a cache); None: ``$STOKER_CACHE_READ_ONLY`` ("1" turns it on), else False.

    Raises:
        TypeError / ValueError naming the field (``CacheOptions.cache_bytes: ...``) for a bad value.
    """

    cache_dir: str | None = None
    cache_bytes: int | str | dict | None = None
    memory_bytes: int | str = 0
    memory_dir: str | None = None
    cache_policy: str = "future"
    cache_mode: int | str | None = None
    cache_read_only: bool | None = None

    def __post_init__(self):
        set_, name = object.__setattr__, "CacheOptions.cache_bytes"
        for d in ("cache_dir", "memory_dir"):
            if getattr(self, d) is not None:
                if not isinstance(getattr(self, d), (str, os.PathLike)):
                    raise TypeError(f"CacheOptions.{d} must be a directory path, got {getattr(self, d)!r}")
                set_(self, d, os.fspath(getattr(self, d)))
        if isinstance(self.cache_bytes, dict):
            set_(self, "cache_bytes", {k: parse_size(v, f"{name}[{k!r}]") for k, v in self.cache_bytes.items()})
            if not any(self.cache_bytes.values()):
                raise ValueError(f"{name} must give some node a budget above 0 bytes, got {self.cache_bytes!r}")
        elif self.cache_bytes is not None:
            set_(self, "cache_bytes", parse_size(self.cache_bytes, name))
        set_(self, "memory_bytes", parse_size(self.memory_bytes, "CacheOptions.memory_bytes"))
        if self.cache_policy not in POLICIES:
            raise ValueError(f"CacheOptions.cache_policy must be one of {POLICIES}, got {self.cache_policy!r}")
        try:
            set_(self, "cache_mode", None if self.cache_mode is None else perms.parse_mode(self.cache_mode))
        except ValueError as exc:
            raise ValueError(f"CacheOptions.cache_mode: {exc}") from None
        if not isinstance(self.cache_read_only, (bool, np.bool_, type(None))):
            raise TypeError(f"CacheOptions.cache_read_only must be True, False or None, got {self.cache_read_only!r}")
        set_(self, "cache_read_only", None if self.cache_read_only is None else bool(self.cache_read_only))
        if self.cache_read_only and self.memory_bytes > 0:
            raise ValueError(
                "CacheOptions.cache_read_only=True cannot have a memory tier (memory_bytes > 0): "
                "the memory tier is written"
            )

    def for_node(self, node_id: str) -> CacheOptions | None:
        """These options as the cache service of Ray node ``node_id`` keeps them: its own budget
        (bytes) out of a ``{node id: size}`` dict, 8 GiB for None; None when the node gets no
        budget (no cache service there)."""
        budget = self.cache_bytes.get(node_id, 0) if isinstance(self.cache_bytes, dict) else self.cache_bytes
        budget = DEFAULT_CACHE_BYTES if budget is None else budget
        return dataclasses.replace(self, cache_bytes=budget) if budget else None


def with_shortcuts(cache: CacheOptions | None, cache_dir=None, cache_bytes=None) -> CacheOptions:
    """``cache`` (default ``CacheOptions()``) with the shortcuts ``cache_dir``/``cache_bytes`` put
    in. TypeError for a ``cache`` of another type, or a shortcut given with the same field."""
    cache = CacheOptions() if cache is None else cache
    if not isinstance(cache, CacheOptions):
        raise TypeError(f"cache must be a stoker.CacheOptions, got {type(cache).__name__} {cache!r}")
    short = {k: v for k, v in (("cache_dir", cache_dir), ("cache_bytes", cache_bytes)) if v is not None}
    for name in short:
        if getattr(cache, name) is not None:
            raise TypeError(f"{name}= and cache=CacheOptions({name}=...) were both given: keep one")
    return dataclasses.replace(cache, **short) if short else cache


def moved(func: str, old: dict, keyword: str, given, cls: type, names, stacklevel: int = 4):
    """The option object that ``keyword=`` of ``func`` stands for: ``given``, else a ``cls`` made of
    ``old`` (the old keywords given, ``{name: value}``, each a field of ``cls`` named in ``names``),
    each warned about as ``"<name>= is deprecated; use <keyword>=<cls>(<name>=...)"``; None when
    neither. TypeError for a name not in ``names`` (as Python words an unexpected keyword of
    ``func``) or an old keyword given with ``keyword=``; what ``cls`` raises for a bad value."""
    for name in old:
        if name not in names:
            raise TypeError(f"{func}() got an unexpected keyword argument {name!r}")
        if given is not None:
            raise TypeError(
                f"{name}= and {keyword}= were both given: {name} belongs in {keyword}={cls.__name__}({name}=...)"
            )
    for name in old:
        warnings.warn(
            f"{name}= is deprecated; use {keyword}={cls.__name__}({name}=...)",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return cls(**old) if old else given
