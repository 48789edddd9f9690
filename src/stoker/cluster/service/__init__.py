"""stoker.cluster.service: the node cache services (this folder's README.md).

The functions a driver or script calls are re-exported here (``from stoker.cluster.service import
start_services, find_services, get_service, dataset_ref, alive_nodes, stop_services``), loaded on
first use so that importing one module of the folder (the wire format, say) does not import Ray.
"""

from __future__ import annotations

import importlib

_FROM_CACHE_SERVICE = (
    "alive_nodes",
    "dataset_ref",
    "find_services",
    "get_service",
    "start_services",
    "stop_services",
)

__all__ = list(_FROM_CACHE_SERVICE)


def __getattr__(name: str):
    if name in _FROM_CACHE_SERVICE:
        return getattr(importlib.import_module(".cache_service", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
