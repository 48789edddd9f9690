"""The cluster-only settings of a job in one frozen group, :class:`ClusterOptions`.

:func:`cluster_door` is the door through which :func:`stoker.cluster.run`, ``warm``,
``rank_context`` and ``placement_hint`` turn their keywords into it and into one
:class:`stoker.CacheOptions`::

    stoker.cluster.run(train, url, 16, {"CPU": 8, "GPU": 1}, cache_bytes="500GiB",
                       cluster=ClusterOptions(job="resnet", process_group="nccl"))

The old flat keywords (``run(..., job="resnet")``) still work for one release, with a
DeprecationWarning naming the field (:func:`stoker.cache.spec.moved`); ``cache_root=``, the old
name of ``cache_dir=``, too.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from dataclasses import dataclass

from ..cache.spec import CacheOptions, moved, with_shortcuts

__all__ = ["PLACEMENTS", "ClusterOptions", "cluster_door"]

#: Where :func:`stoker.cluster.run` puts its ranks: next to the cached data (TDCS), or at random.
PLACEMENTS = ("colocated", "random")


@dataclass(frozen=True)
class ClusterOptions:
    """How a job runs on the Ray cluster (none of it applies to a single node).

    Attributes:
        job: the job's name (str): its Ray placement group, the token its ranks agree with. The
            same on every rank and unique among the jobs running at once. Default None: ``"job"``
            for ``run``; for ``rank_context`` the Ray Train experiment name, needed only without
            a ``torch.distributed`` group of the job's size.
        placement: ``"colocated"`` (default: ranks on the nodes holding the most of the dataset,
            TDCS) or ``"random"`` (seeded by ``seed``, for comparison); ``run`` only.
        seed: the seed of ``placement="random"`` (int, default 0).
        slots_per_node: most ranks per node (int >= 1; default None: no limit but the nodes'
            free resources).
        peer_timeout_s: longest wait in seconds for one read from a peer's cache service before
            the origin is read instead (> 0, default 30).
        retry_s: seconds a peer that failed is skipped before it is tried again (>= 0, default 1).
        timeout_s: ``run``: seconds to wait for the ranks' results before they are cancelled
            (``GetTimeoutError``); ``rank_context``: the longest wait for the other ranks to
            report. > 0; default None: no limit for ``run``, 120 s for ``rank_context``.
        start_timeout_s: seconds the ranks' reservation may wait for room before
            :class:`stoker.errors.CapacityError` (>= 0, default 30).
        wait: ``run`` returns the ranks' results (default True), or at once the watched Ray
            refs (:class:`stoker.cluster.jobs.gang.JobRefs`).
        process_group: ``"gloo"`` or ``"nccl"``: open a ``torch.distributed`` process group over
            the ranks before ``train_fn`` and destroy it after (checked by ``run``:
            :func:`stoker.cluster.jobs.rendezvous.check_backend`); None (default): none.

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
        if self.job is not None and not isinstance(self.job, str):
            raise TypeError(f"ClusterOptions.job must be a name (str), got {type(self.job).__name__} {self.job!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ClusterOptions.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for name, least in (("seed", 0), ("slots_per_node", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise TypeError(f"ClusterOptions.{name} must be an integer, got {value!r}")
            if value is not None and value < least:
                raise ValueError(f"ClusterOptions.{name} must be >= {least}, got {value}")
        for name in ("peer_timeout_s", "retry_s", "timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"ClusterOptions.{name} must be a number of seconds, got {value!r}")
            if value < 0 or (value == 0 and name in ("peer_timeout_s", "timeout_s")):
                raise ValueError(f"ClusterOptions.{name} must be {'>= 0' if value else '> 0'}, got {value}")
        if not isinstance(self.wait, bool):
            raise TypeError(f"ClusterOptions.wait must be True or False, got {self.wait!r}")


def cluster_door(
    func: str, cache, cache_dir, cache_bytes, cluster, old: dict, names: tuple[str, ...] = ()
) -> tuple[CacheOptions, ClusterOptions]:
    """The :class:`stoker.CacheOptions` and :class:`ClusterOptions` that a call of ``func``
    (``"run"``, ``"warm"`` ...) stands for: ``cache`` with the shortcuts ``cache_dir`` /
    ``cache_bytes`` put in (:func:`stoker.cache.spec.with_shortcuts`), ``cluster`` (default
    ``ClusterOptions()``), and in ``old`` (the other keywords given) ``cache_root``, the old
    name of ``cache_dir``, and the old keywords ``names`` that moved into ``cluster``; each
    warns (DeprecationWarning, pointed at ``func``'s caller).

    Raises:
        TypeError: an unexpected keyword, an old name together with its new home (naming both),
            ``cache``/``cluster`` of another type.
        ValueError: a bad value (naming the field).
    """
    cache_root = old.pop("cache_root", None)
    if cache_root is not None:
        if cache_dir is not None:
            raise TypeError("cache_root= and cache_dir= were both given: cache_root is the old name of cache_dir")
        warnings.warn("cache_root= is deprecated; use cache_dir=", DeprecationWarning, stacklevel=3)
        cache_dir = cache_root
    cluster = moved(func, old, "cluster", cluster, ClusterOptions, names) or ClusterOptions()
    if not isinstance(cluster, ClusterOptions):
        raise TypeError(f"cluster must be a stoker.cluster.ClusterOptions, got {type(cluster).__name__} {cluster!r}")
    return with_shortcuts(cache, cache_dir, cache_bytes), cluster


#: Every field of :class:`ClusterOptions`: the old keywords of ``run`` that moved into it.
FIELDS = tuple(f.name for f in dataclasses.fields(ClusterOptions))
