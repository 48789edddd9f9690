"""Handoff: a block whose owner changed when a dataset's members grew comes from its previous owner.

When a node joins, the dataset's members grow (:func:`stoker.cluster.membership.widen`) and the
blocks the new node wins under rendezvous hashing get a new owner, whose cache does not hold
them yet, while the node that owned them before still does. As in distributed caches such as
Alluxio, which read from the worker that held a block before the hash ring changed, the new owner
fills such a block from the *previous owner* (the block's owner under the members before the
last growth, ``previous`` in the record, :mod:`stoker.cluster.service.records`): a cache-only read of that
node's data endpoint (:mod:`stoker.cluster.service.endpoint`: it never goes to the origin for
it). Only when that node is gone, does not hold the block, fails or does not answer in time
does the block come from the origin. The bytes are verified against the index like the
origin's (:meth:`stoker.store.blocks.BlockReader.fetch_block`).

Two places fill a block: a rank whose node owns it (its :class:`stoker.cluster.service.reader.BlockRouter`
reads the previous owner first) and the owner's cache service, for a peer's read or a warm-up
(:class:`PriorReads`, given to the store's fill as its first source).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .identity import node_label
from .placement import place_dataset, placement_keys

log = logging.getLogger(__name__)

#: Longest wait of a cache service for one cache-only read from a previous owner, seconds (the
#: reader that asked the service waits for it with its own, longer, peer timeout).
PRIOR_TIMEOUT_S = 10.0
#: How long a previous owner whose call failed is not asked again by a service, seconds.
PRIOR_RETRY_S = 5.0


def previous_layout(services: dict, members: list[str], previous: list[str]) -> dict:
    """How the blocks were placed before the dataset's members last grew, as far as it matters
    now: ``{"members", "keys", "budgets"}`` of the recorded ``previous`` members that are members
    of this job (``members``) and have a service now (``services``: ``{node id: info()}``, whose
    ``cache_key`` and ``cache_bytes`` place the blocks as the earlier jobs did). A previous member
    that is gone is left out (its blocks are then looked for on a node that never held them, and
    come from the origin). Plain data, sent to the ranks with the job's layout."""
    prev = [m for m in previous if m in services and m in members]
    return {
        "members": prev,
        "keys": placement_keys(services, prev),
        "budgets": [int(services[m]["cache_bytes"]) for m in prev],
    }


def prior_owner(ds, members: list[str], owner: np.ndarray, previous: dict | None) -> np.ndarray:
    """Index into ``members`` of each block's previous owner, int64 (len(ds.blocks),); -1 where
    there is none to ask: the block's owner did not change, or there is no previous placement.

    ``members``: the placement members of this job; ``owner``: each block's owner now (index into
    ``members``, :func:`stoker.cluster.placement.place_dataset`); ``previous``: the placement
    before the last growth (:func:`previous_layout`; None or no members: none).
    """
    none = np.full(len(ds.blocks), -1, dtype=np.int64)
    if not previous or not previous["members"] or set(previous["members"]) == set(members):
        return none
    if not any(previous["budgets"]):
        return none
    index = np.asarray([members.index(m) for m in previous["members"]], dtype=np.int64)
    before = index[place_dataset(ds, previous["keys"], previous["budgets"])]
    return np.where(before != np.asarray(owner, dtype=np.int64), before, -1).astype(np.int64)


class PriorReads:
    """A cache service's cache-only reads of blocks from their previous owners (module doc).

    :meth:`source` gives the store's fill a first source (:data:`stoker.store.blocks.FirstSource`)
    for one block. A previous owner whose read failed (no service, dead, timed out) is not asked
    again for ``retry_s`` seconds, so a node that hangs costs one ``timeout_s`` wait, not one per
    block. ``fetch(node, dref, b, start, stop, timeout_s)``: a cache-only read of that node's
    cache (the bytes, or None when it does not hold the block; raises when it cannot be reached:
    :meth:`stoker.cluster.service.cache_service.CacheService._read_prior` reads its data endpoint).
    Thread-safe (a service fills blocks in many threads).
    """

    def __init__(self, fetch, timeout_s: float = PRIOR_TIMEOUT_S, retry_s: float = PRIOR_RETRY_S):
        self.fetch = fetch
        self.timeout_s, self.retry_s = float(timeout_s), float(retry_s)
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def read(self, node: str, dref: dict, b: int, start: int, stop: int, timeout_s: float | None = None):
        """Shard bytes ``[start, stop)`` of block ``b`` from the cache of ``node``, or None (it does
        not hold them, or it failed, or it did not answer within ``timeout_s``, default
        :attr:`timeout_s`: logged). Never raises for the peer's faults."""
        with self._lock:
            if time.monotonic() < self._down_until.get(node, 0.0):
                return None
        try:
            data = self.fetch(
                node, dref, int(b), int(start), int(stop), self.timeout_s if timeout_s is None else float(timeout_s)
            )
        except Exception as exc:  # noqa: BLE001 - any fault of the previous owner: the origin instead
            with self._lock:
                self._down_until[node] = time.monotonic() + self.retry_s
            log.warning(
                "previous owner %s of block %s of %s unavailable (%s); using the origin",
                node_label(node),
                b,
                dref["url"],
                exc,
            )
            return None
        if data is None or len(data) != stop - start:
            return None
        return data

    def source(self, ds, dref: dict, node: str | None, timeout_s: float | None = None):
        """The first source of a fill of ``ds`` (the service's dataset of ``dref``) whose blocks'
        previous owner is ``node`` (None: none, and so no first source); ``(source, got)``:
        ``got`` is a dict where the source leaves each block's bytes it returned (``{b: bytes}``),
        so the caller tells a block filled from them (the same object) from one the origin
        gave after they failed the check."""
        got: dict[int, bytes] = {}
        if node is None:
            return None, got

        def first(b: int):
            data = self.read(node, dref, b, int(ds.blocks.start[b]), int(ds.blocks.end[b]), timeout_s)
            if data is not None:
                got[int(b)] = data
            return data

        return first, got
