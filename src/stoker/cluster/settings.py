"""A job's cluster-only settings in one frozen group, :class:`ClusterOptions`.

:func:`cluster_door` turns the keywords of ``run``, ``warm``, ``rank_context`` and
``placement_hint`` into it and into one :class:`stoker.CacheOptions`; their old flat keywords
(``run(..., job="resnet")``) still work for one release, with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from dataclasses import dataclass

from .._names import suggest_fields
from ..cache.spec import CacheOptions, moved, with_shortcuts

__all__ = ["PLACEMENTS", "ClusterOptions", "cluster_door"]

#: Where :func:`stoker.cluster.run` puts its ranks: next to the cached data (TDCS), or at random.
PLACEMENTS = ("colocated", "random")


@suggest_fields
@dataclass(frozen=True)
class ClusterOptions:
    """How a job runs on the Ray cluster.

    Attributes:
        job: the job's name (its placement group, its ranks' token; the same on every rank, unique
            among the jobs running at once). None: ``"job"`` for ``run``; for ``rank_context`` the
            Ray Train experiment name (needed only without a ``torch.distributed`` group).
        placement: ``"colocated"`` (default: ranks where the data is cached, TDCS) or ``"random"``
            (seeded by ``seed``, an int; for comparison); ``run`` only.
        slots_per_node: most ranks per node (int >= 1; None: as the nodes' free resources allow).
        peer_timeout_s: longest wait for one read from a peer before the origin (s, > 0).
        retry_s: seconds a peer that failed is skipped before it is tried again (>= 0).
        timeout_s: ``run``: seconds to wait for the ranks' results (then cancelled,
            ``GetTimeoutError``; None: no limit); ``rank_context``: the longest wait for the other
            ranks (None: 120 s).
        start_timeout_s: seconds the ranks' reservation may wait for room before
            :class:`stoker.errors.CapacityError`.
        wait: ``run`` returns the results (default), or at once the watched refs
            (:class:`stoker.cluster.jobs.gang.JobRefs`).
        process_group: ``"gloo"`` or ``"nccl"``: a ``torch.distributed`` group over the ranks, open
            while ``train_fn`` runs (:func:`stoker.cluster.jobs.rendezvous.check_backend`); None: none.

    Raises:
        TypeError / ValueError naming the field for a bad value.
    """

    job: str | None = None
    placement: str = "colocated"
    seed: int = 0
    slots_per_node: int | None = None
    peer_timeout_s: float = 30.0
    retry_s: float = 1.0
    timeout_s: float | None = None
    start_timeout_s: float = 30.0
    wait: bool = True
    process_group: str | None = None

    def __post_init__(self):
        if not isinstance(self.job, (str, type(None))):
            raise TypeError(f"ClusterOptions.job must be a name (str), got {self.job!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ClusterOptions.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.wait, bool):
            raise TypeError(f"ClusterOptions.wait must be True or False, got {self.wait!r}")
        if self.process_group not in (None, *BACKENDS):
            raise ValueError(
                f"ClusterOptions.process_group must be one of {BACKENDS} or None, got {self.process_group!r}"
            )
        for name, kind, least, strict in _NUMBERS:
            value = getattr(self, name)
            if value is None and name in ("slots_per_node", "timeout_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if kind is numbers.Integral else "a number of seconds"
                raise TypeError(f"ClusterOptions.{name} must be {what}, got {value!r}")
            if value < least or (strict and value == least):
                raise ValueError(f"ClusterOptions.{name} must be {'>' if strict else '>='} {least}, got {value}")


#: The ``torch.distributed`` backends a job's process group may use.
BACKENDS = ("gloo", "nccl")

#: The numeric fields of :class:`ClusterOptions`: (name, type, least value, whether it is excluded).
_NUMBERS = [
    ("seed", numbers.Integral, 0, False),
    ("slots_per_node", numbers.Integral, 1, False),
    ("peer_timeout_s", numbers.Real, 0, True),
    ("retry_s", numbers.Real, 0, False),
    ("timeout_s", numbers.Real, 0, True),
    ("start_timeout_s", numbers.Real, 0, False),
]


def cluster_door(
    func: str, cache, cache_dir, cache_bytes, cluster, old: dict, names: tuple[str, ...] = ()
) -> tuple[CacheOptions, ClusterOptions]:
    """``(CacheOptions, ClusterOptions)`` of a call of ``func``: ``cache`` with the shortcuts put in
    (:func:`stoker.cache.spec.with_shortcuts`), ``cluster`` (default ``ClusterOptions()``); of the
    other keywords given (``old``), ``cache_root`` (the old name of ``cache_dir``) and ``names``
    (old keywords of fields of ``cluster``) warn and go to their new place. ``names`` are also the
    fields of ``cluster`` that ``func`` reads: another field set to other than its default is a
    ValueError (it would be ignored). TypeError for an unexpected keyword, an old name given with
    its new home, or a group of another type; ValueError for a bad value."""
    cache_root = old.pop("cache_root", None)
    if cache_root is not None:
        if cache_dir is not None:
            raise TypeError("cache_root= and cache_dir= were both given: cache_root is the old name of cache_dir")
        warnings.warn("cache_root= is deprecated; use cache_dir=", DeprecationWarning, stacklevel=3)
        cache_dir = cache_root
    cluster = moved(func, old, "cluster", cluster, ClusterOptions, names) or ClusterOptions()
    if not isinstance(cluster, ClusterOptions):
        raise TypeError(f"cluster must be a stoker.cluster.ClusterOptions, got {type(cluster).__name__} {cluster!r}")
    unused = [
        f"{f.name}={getattr(cluster, f.name)!r}"
        for f in dataclasses.fields(ClusterOptions)
        if f.name not in names and getattr(cluster, f.name) != f.default
    ]
    if unused:
        raise ValueError(
            f"{func} reads only {', '.join(names)} of ClusterOptions; {', '.join(unused)} would be ignored"
        )
    return with_shortcuts(cache, cache_dir, cache_bytes), cluster


#: Every field of :class:`ClusterOptions`: the old keywords of ``run`` that moved into it.
FIELDS = tuple(f.name for f in dataclasses.fields(ClusterOptions))
