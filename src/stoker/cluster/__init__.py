"""Cluster mode on Ray (TDCS): a cache service per node, blocks placed by weighted rendezvous
hashing, reads local → peer → origin, co-located training workers, a Kubernetes scheduler
extender.

``placement``, ``schedule``, ``counters`` and ``extender`` need only the standard library and
numpy; everything else needs Ray (the ``cluster`` extra) and imports it on first use
of a name below. ``import stoker`` never imports Ray.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "run": "job",
    "WorkerContext": "job",
    "ClusterLoader": "job",
    "read_epochs": "job",
    "gather": "job",
    "warm": "warmup",
    "cluster_state": "warmup",
    "ray_state": "warmup",
    "start_services": "service",
    "find_services": "service",
    "rank_context": "rankdata",
    "rank_loader": "rankdata",
    "RankContext": "rankdata",
    "RankLoader": "rankdata",
    "placement_hint": "hint",
}

__all__ = sorted(_LAZY)


def __dir__() -> list[str]:
    """The public names (imported on first use), for ``dir()`` and tab completion."""
    return list(__all__)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
