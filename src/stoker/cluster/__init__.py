"""Cluster mode on Ray (TDCS), drawn in this package's README.md. Its base modules and
``extender/`` need no Ray; everything else needs Ray (the ``cluster`` extra) and imports it on
first use of a name below. ``import stoker`` never imports Ray.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ClusterOptions": "settings",
    "run": "jobs.job",
    "WorkerContext": "jobs.job",
    "ClusterLoader": "jobs.job",
    "read_epochs": "jobs.job",
    "gather": "jobs.job",
    "warm": "service.warmup",
    "cluster_state": "service.warmup",
    "ray_state": "service.warmup",
    "start_services": "service.cache_service",
    "find_services": "service.cache_service",
    "rank_context": "train.rankdata",
    "rank_loader": "train.rankdata",
    "RankContext": "train.rankdata",
    "RankLoader": "train.rankdata",
    "placement_hint": "train.hint",
}

__all__ = sorted(_LAZY)


def __dir__() -> list[str]:
    """The public names (imported on first use), for ``dir()`` and tab completion."""
    return list(__all__)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
