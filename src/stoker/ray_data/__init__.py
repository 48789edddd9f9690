"""stoker's packed datasets in Ray Data: :func:`read` gives a ``ray.data.Dataset`` whose read
tasks read through the node caches of a stoker cluster, so a second pass reads nothing from
the origin, without ``materialize()``. The code is in :mod:`stoker.cluster.train.datasource`;
Ray and Ray Data are imported on the first call, not with this module.
"""

from __future__ import annotations

__all__ = ["read"]


def read(url: str, **kwargs):
    """The packed dataset at ``url`` as a ``ray.data.Dataset`` read through the cluster's node
    caches: :func:`stoker.cluster.train.datasource.read` (its keyword arguments, rows, errors)."""
    from ..cluster.train.datasource import read as read_cluster

    return read_cluster(url, **kwargs)
