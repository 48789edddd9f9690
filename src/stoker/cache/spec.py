"""The node cache's settings in one frozen group, :class:`CacheOptions`, and the door through
which an entry point's cache keywords become one.

``open_dataset``, ``stoker.cluster.run``, ``warm``, ``rank_context`` and ``placement_hint`` each
take ``cache: CacheOptions | None``; ``cache_dir=`` and ``cache_bytes=`` stay beside it as the
common shortcut, filling the same fields (:func:`with_shortcuts`)::

    open_dataset(url, cache=CacheOptions(cache_bytes="500GiB", memory_bytes="8GiB"))
    open_dataset(url, "/scratch/cache", "500GiB")   # the shortcut

The object travels whole to the part that reads it (the node cache's construction in
:func:`stoker.open_dataset`, the cache services of :mod:`stoker.cluster`). An old keyword that
moved into a group still works for one release, with a DeprecationWarning (:func:`moved`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass

import numpy as np

from .._units import parse_size
from . import perms
from .disk import POLICIES

__all__ = ["DEFAULT_CACHE_BYTES", "MOVED", "CacheOptions", "moved", "with_shortcuts"]

#: The budget of a node cache when none is given: 8 GiB.
DEFAULT_CACHE_BYTES = 8 << 30
#: The ``open_dataset`` keywords that moved into :class:`CacheOptions` (each field keeps its name).
MOVED = ("memory_bytes", "memory_dir", "cache_policy", "cache_mode", "cache_read_only")


@dataclass(frozen=True)
class CacheOptions:
    """Where the node cache is, how big, and how it keeps its blocks.

    Attributes:
        cache_dir: the cache directory (str or path; default None: :func:`stoker.store.dataset.default_cache_dir`;
            in :mod:`stoker.cluster` the root under which each node's directory is made, default
            ``<default cache dir>/cluster``).
        cache_bytes: the budget in bytes (an int or a size string such as ``"500GiB"``, kept as an
            int; default None: 8 GiB, :data:`DEFAULT_CACHE_BYTES`, with a warning naming the
            place the first time). In :mod:`stoker.cluster` also a dict ``{Ray node id: size}``:
            a node not named gets no cache service (at least one budget above 0).
        memory_bytes: budget of a shared-memory tier above the disk tier (default 0: none;
            blocks go to memory first, :mod:`stoker.cache.tiered`).
        memory_dir: the memory tier's directory (default None: under /dev/shm, one per cache
            directory).
        cache_policy: ``"future"`` (default: no eviction within a dataset, the budget split
            between the datasets of live jobs by epoch rate, :mod:`stoker.cache.policy`),
            ``"noevict"`` or ``"lru"``.
        cache_mode: file mode of everything the cache creates, an int or an octal string such as
            ``"0640"`` (a cache the directory's group may read), kept as an int; default None:
            ``$STOKER_CACHE_MODE`` or 0600 (:mod:`stoker.cache.perms`). A cache made with another
            mode raises :class:`stoker.CacheModeError` when opened.
        cache_read_only: serve the cache in ``cache_dir`` as it is and write nothing there (a cache
            filled earlier, baked into an image or mounted read-only): cached blocks are read,
            every other sample comes from the origin and is not kept
            (:class:`stoker.cache.readonly.ReadOnlyCache`). None (default):
            ``$STOKER_CACHE_READ_ONLY`` ("1" turns it on), else False. Opening one with a memory
            tier raises ValueError; a directory holding no stoker cache raises
            :class:`stoker.NotACacheError`.

    Raises:
        TypeError / ValueError naming the field (``CacheOptions.cache_bytes: ...``) for a bad
        value: a size :func:`stoker.parse_size` cannot read, an unknown policy, a file mode that
        is not octal or lets others write, a read-only flag that is not a bool.
    """

    cache_dir: str | None = None
    cache_bytes: int | str | dict | None = None
    memory_bytes: int | str = 0
    memory_dir: str | None = None
    cache_policy: str = "future"
    cache_mode: int | str | None = None
    cache_read_only: bool | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        for name in ("cache_dir", "memory_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"CacheOptions.{name} must be a directory path, got {type(value).__name__} {value!r}")
            set_(self, name, None if value is None else os.fspath(value))
        if isinstance(self.cache_bytes, dict):
            set_(
                self,
                "cache_bytes",
                {k: parse_size(v, f"CacheOptions.cache_bytes[{k!r}]") for k, v in self.cache_bytes.items()},
            )
            if not any(self.cache_bytes.values()):
                raise ValueError(
                    f"CacheOptions.cache_bytes must give some node a budget above 0 bytes, got {self.cache_bytes!r}"
                )
        elif self.cache_bytes is not None:
            set_(self, "cache_bytes", parse_size(self.cache_bytes, "CacheOptions.cache_bytes"))
        set_(self, "memory_bytes", parse_size(self.memory_bytes, "CacheOptions.memory_bytes"))
        if self.cache_policy not in POLICIES:
            raise ValueError(f"CacheOptions.cache_policy must be one of {POLICIES}, got {self.cache_policy!r}")
        if self.cache_mode is not None:
            try:
                set_(self, "cache_mode", perms.parse_mode(self.cache_mode))
            except ValueError as exc:
                raise ValueError(f"CacheOptions.cache_mode: {exc}") from None
        if self.cache_read_only is not None:
            if not isinstance(self.cache_read_only, (bool, np.bool_)):
                raise TypeError(
                    f"CacheOptions.cache_read_only must be True, False or None, got "
                    f"{type(self.cache_read_only).__name__} {self.cache_read_only!r}"
                )
            set_(self, "cache_read_only", bool(self.cache_read_only))

    def for_node(self, node_id: str) -> CacheOptions | None:
        """These options as the cache service of Ray node ``node_id`` keeps them: its own budget
        (bytes) out of a ``{node id: size}`` dict, 8 GiB for None; None when the node gets no
        budget (no cache service there)."""
        budget = self.cache_bytes.get(node_id, 0) if isinstance(self.cache_bytes, dict) else self.cache_bytes
        budget = DEFAULT_CACHE_BYTES if budget is None else budget
        return dataclasses.replace(self, cache_bytes=budget) if budget else None


def with_shortcuts(cache: CacheOptions | None, cache_dir=None, cache_bytes=None) -> CacheOptions:
    """``cache`` (default ``CacheOptions()``) with the shortcuts ``cache_dir=`` / ``cache_bytes=``
    put in (each parsed once, by :class:`CacheOptions`).

    Raises:
        TypeError: ``cache`` is not a :class:`CacheOptions`, or a shortcut and the same field of
            ``cache`` were both given (naming both).
    """
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
    the old keywords ``old`` (``{name: value}``), each warned about in the house's words
    (``"<name>= is deprecated; use <keyword>=<cls>(<name>=...)"``, at ``stacklevel``).

    Args:
        func: the entry point's name, for the errors.
        old: the keywords given that ``func`` does not take itself.
        keyword: ``func``'s keyword for the group (``"cache"``, ``"cluster"``).
        given: the object passed as ``keyword=`` (or None).
        cls: the group's class; ``names``: the old keywords that moved into it (fields of ``cls``).

    Returns:
        ``given`` or the new ``cls`` (None when neither).

    Raises:
        TypeError: a key of ``old`` that is not in ``names`` (as Python words an unexpected keyword
            argument of ``func``), or an old keyword together with ``keyword=`` (naming both).
        ValueError: a value ``cls`` rejects (naming the field).
    """
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
