"""A cluster job's registration on the node caches ends with the job, whichever process made it.

A node cache splits its budget between the datasets of the jobs registered on it
(:mod:`stoker.cache.policy`); a record counts while its process lives. In cluster mode the
processes outlive the jobs: a rank runs in a pooled Ray worker that stays up after its task,
and a cache service reads for every job. So a rank ends its registration when it finishes
(:func:`end`), and a service holds a *lease* (:func:`lease`) that each request for the dataset
renews and that runs out ``lease_s`` seconds after the last one. Without these, a finished job
keeps its share of the budget and the next job's blocks are refused.
"""

from __future__ import annotations

import os

#: How long a cache service's registration of a dataset counts after its last request, seconds.
LEASE_S = 30.0


def _registries(cache) -> list:
    """The :class:`stoker.cache.policy.JobRegistry` of each tier of a dataset's node cache."""
    tiers = [getattr(cache, "memory", None), getattr(cache, "disk", None)] if hasattr(cache, "memory") else [cache]
    return [t.jobs for t in tiers if t is not None and hasattr(t, "jobs")]


def lease(ds, lease_s: float = LEASE_S) -> None:
    """Register ``ds`` (a :class:`stoker.store.dataset.Dataset` read through a node cache) on its
    cache for ``lease_s`` seconds from now, in place of this process's registration of it."""
    for jobs in _registries(ds.cache):
        jobs.register(ds.version, int(ds.index.total_bytes), lease_s=lease_s)
    _forget_memo(ds.cache)


def end(ds) -> None:
    """End this process's registration of ``ds`` on its node cache (no-op without a cache)."""
    if ds is None or getattr(ds, "cache", None) is None:
        return
    for jobs in _registries(ds.cache):
        jobs.unregister(ds.version, os.getpid())
    _forget_memo(ds.cache)


def _forget_memo(cache) -> None:
    """Make the cache split its budget again at the next fill (it memoises the split):
    :meth:`stoker.cache.DiskCache.forget_quotas` (a tiered cache: both tiers)."""
    forget = getattr(cache, "forget_quotas", None)
    if forget is not None:
        forget()
