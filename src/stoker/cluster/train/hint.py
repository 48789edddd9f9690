"""Where Ray Train should put its workers: the nodes that hold most of a dataset's cached bytes.

:func:`placement_hint` applies the rule :func:`stoker.cluster.run` places its ranks by
(:func:`stoker.cluster.schedule.choose_nodes` over the cache services' ``cached_bytes``, within
the nodes' free resources) and says it in the words of Ray Train's ``ScalingConfig``.

What a ``ScalingConfig`` of Ray 2.60 can say about nodes: ``placement_strategy`` (``PACK``,
``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``: no node named), ``resources_per_worker`` (one
request for every worker: a custom resource could name one node, not a different node per
worker) and ``label_selector``: one ``{label: value}`` per worker, which Ray Train turns into the
``bundle_label_selector`` of its placement group, bundle ``i`` for worker ``i``. Every Ray node
carries the label ``ray.io/node-id`` with its node id, so a list of ``{"ray.io/node-id": id}``
pins each bundle, hence each worker, to a chosen node; this is what the hint gives. Ray Train
numbers the workers itself (grouped by node), so worker ``i`` need not be rank ``i``:
:func:`stoker.cluster.rank_context` gathers where the ranks really are, and the co-located plans
follow that.
"""

from __future__ import annotations

import ray

from ...cache.spec import CacheOptions
from ..capacity import rank_request
from ..identity import node_label
from ..jobs.gang import NODE_ID_LABEL, node_slots
from ..schedule import choose_nodes
from ..service.cache_service import get_service, prepare
from ..settings import ClusterOptions, cluster_door

#: The old keyword of :func:`placement_hint` that moved into :class:`ClusterOptions`.
MOVED = ("slots_per_node",)


def placement_hint(
    url: str,
    num_workers: int,
    resources_per_worker: dict | None = None,
    *,
    storage_options: dict | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | str | dict | None = None,
    cache: CacheOptions | None = None,
    block_bytes: int | str | None = None,
    cluster: ClusterOptions | None = None,
    **deprecated,
) -> dict:
    """Keyword arguments for Ray Train's ``ScalingConfig(**hint)`` that put its ``num_workers``
    workers on the nodes holding the most of the dataset at ``url`` (module doc):
    ``{"num_workers": n, "label_selector": [{"ray.io/node-id": node id}, ...]}``, with
    ``"resources_per_worker"`` when given. Call it in the driver after ``ray.init()``.

    ``resources_per_worker``: Ray resources of one worker (default one CPU), counted against each
    node's free resources; ``cluster``: its ``slots_per_node`` (most workers per node; the old
    ``slots_per_node=`` is still taken, with a DeprecationWarning). ``storage_options``,
    ``cache_dir``, ``cache_bytes``, ``cache``, ``block_bytes``: as :func:`stoker.cluster.run`. A
    dataset cached nowhere yet spreads the workers over the nodes by cache budget; its cache then
    goes to the nodes where the workers run (:func:`stoker.cluster.rank_context`). The cache
    services are started where missing (:func:`stoker.cluster.service.cache_service.prepare`).

    The hint is taken now: resources freed or taken before the trainer starts are not in it, and a
    node that went away leaves its worker waiting (Ray Train's own start timeout applies).
    Raises ValueError for ``num_workers`` < 1, :class:`stoker.errors.CapacityError` when the
    nodes' free resources do not hold ``num_workers`` workers, and what
    :func:`stoker.cluster.service.cache_service.prepare` raises.
    """
    cache, cluster = cluster_door("placement_hint", cache, cache_dir, cache_bytes, cluster, deprecated, MOVED)
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    services, _ds, dref = prepare(url, storage_options, cache, block_bytes)
    nodes = list(services)
    cached = ray.get([get_service(n).cached_bytes.remote(dref) for n in nodes])
    budgets = [int(services[n]["cache_bytes"]) for n in nodes]
    names = {n: node_label(n, services) for n in nodes}
    slots = node_slots(nodes, rank_request(resources_per_worker), num_workers, cluster.slots_per_node, 0.0, names)
    chosen = choose_nodes(nodes, cached, budgets, num_workers, slots)
    hint: dict = {"num_workers": int(num_workers), "label_selector": [{NODE_ID_LABEL: n} for n in chosen]}
    if resources_per_worker is not None:
        hint["resources_per_worker"] = dict(resources_per_worker)
    return hint
