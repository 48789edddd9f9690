"""A rank's dataset read through the cluster, as :func:`stoker.cluster.run`'s ranks and
:func:`stoker.cluster.rank_context` open it: the dataset opened on the rank's node (through its
node cache where the node has a cache service), its reads routed node cache -> owning peer ->
origin (:class:`stoker.cluster.service.reader.BlockRouter`), and the job's announcement to the services
(``hold`` while it runs, ``release`` at its end: :mod:`stoker.cluster.registration`)."""

from __future__ import annotations

import logging

import numpy as np
import ray

from ...store.blocks import BlockReader
from ..counters import ByteCounters
from .cache_service import dataset_ref, get_service
from .reader import BlockRouter

log = logging.getLogger(__name__)

__all__ = ["announce", "open_on_node", "route"]


def open_on_node(url: str, storage_options: dict, service: dict | None, block_bytes: int):
    """The dataset at ``url`` for a rank on a node: through the node cache of ``service`` (the
    node's service info, whose ``cache`` is the node's :class:`stoker.CacheOptions`), or uncached
    when the node has none; ``block_bytes`` as the job's. Unchecked (the driver or rank 0 checked
    it): the caller compares its ``version`` with the one the job was placed with."""
    from ...store.dataset import open_dataset

    cache = False if service is None else service["cache"]
    return open_dataset(url, cache=cache, storage_options=storage_options, check=False, block_bytes=block_bytes)


def route(
    ds,
    storage_options: dict,
    members: list[str],
    owner: np.ndarray,
    node: str,
    counters: ByteCounters,
    peer_timeout_s: float,
    retry_s: float,
    prior: np.ndarray | None = None,
    names: list[str] | None = None,
) -> tuple:
    """``(routed dataset, router)``: a view of ``ds`` whose reads go node cache -> owning peer ->
    origin (``owner``: the member index owning each block; ``node``: this rank's node id, -1 as
    member when it is none; ``prior``: each block's previous owner, -1: none,
    :func:`stoker.cluster.handoff.prior_owner`; ``names``: how messages name each member,
    :func:`stoker.cluster.identity.node_label`), counted in ``counters``; every peer looked up and called once, off
    the read path; the :class:`stoker.cluster.service.reader.BlockRouter` (the caller closes it: its
    connections to the peers' data endpoints)."""
    router = BlockRouter(
        dataset_ref(ds, storage_options),
        members,
        np.asarray(owner),
        members.index(node) if node in members else -1,
        counters,
        timeout_s=peer_timeout_s,
        retry_s=retry_s,
        prior=prior,
        names=names,
    )
    routed = ds.with_reader(BlockReader(ds, router=router))
    router.connect()
    return routed, router


def announce(nodes: list[str], method: str, dref: dict, token: str, timeout_s: float = 10.0) -> None:
    """Call ``method(dref, token)`` (``"hold"`` / ``"release"``) on the cache service of every
    node, all at once; a node without a service is skipped, and one that does not answer within
    ``timeout_s`` seconds is left to its lease (logged, never raised: the job's own outcome
    matters more)."""
    refs = []
    for n in nodes:
        try:
            refs.append(getattr(get_service(n), method).remote(dref, token))
        except ValueError:
            continue
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a service down or Ray gone: its lease runs out by itself
        log.warning("cache services: %s of %s not confirmed by every node: %s", method, dref["url"], exc)
